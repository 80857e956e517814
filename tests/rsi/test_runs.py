import json

import pytest
from treadle.rsi.loop import LoopConfig
from treadle.rsi.math_tasks import make_seeds
from treadle.rsi.runs import RunMismatchError, run
from typer.testing import CliRunner


def _files(d):
    return {n: (d / n).read_text() for n in ("problems.jsonl", "log.jsonl", "ledger.jsonl", "repairs.jsonl",
                                             "state.json", "curve.json")}


def test_resume_gives_the_same_run_as_one_go(tmp_path):
    seeds = make_seeds(6, 0)
    one = run(tmp_path / "one", seeds, (), LoopConfig(rounds=3))
    run(tmp_path / "two", seeds, (), LoopConfig(rounds=2))
    # an interrupted round 2: stray records of a round that state.json does not mark done
    with (tmp_path / "two" / "problems.jsonl").open("a") as f:
        f.write(json.dumps({"round": 2, "text": "stray"}) + "\n")
    two = run(tmp_path / "two", seeds, (), LoopConfig(rounds=3))
    assert one["curve"] == two["curve"]
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert (tmp_path / "one" / "curve.png").stat().st_size > 1000
    assert (tmp_path / "one" / "harness" / "v0.json").exists()


def test_heldout_content_never_changes_the_update_path(tmp_path):
    seeds = make_seeds(6, 0)
    a = run(tmp_path / "a", seeds, make_seeds(3, 5, prefix="h"), LoopConfig(rounds=2))
    b = run(tmp_path / "b", seeds, make_seeds(4, 6, prefix="h"), LoopConfig(rounds=2))
    fa, fb = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert fa == fb
    assert sorted(p.name for p in (tmp_path / "a" / "harness").iterdir()) == \
        sorted(p.name for p in (tmp_path / "b" / "harness").iterdir())
    assert "transfer" in a and "transfer" in b


def test_config_mismatch_and_bad_seeds(tmp_path):
    seeds = make_seeds(4, 0)
    run(tmp_path / "r", seeds, (), LoopConfig(rounds=1))
    with pytest.raises(RunMismatchError, match=r"differs in \['margin'\]"):
        run(tmp_path / "r", seeds, (), LoopConfig(rounds=1, margin=0.1))
    with pytest.raises(RunMismatchError, match="already holds a run"):
        run(tmp_path / "r", seeds, (), LoopConfig(rounds=1), resume=False)
    with pytest.raises(ValueError, match="both in training and held-out"):
        run(tmp_path / "x", seeds, seeds[:1], LoopConfig(rounds=1))
    assert not (tmp_path / "x").exists()


def test_cli_errors_are_one_line_naming_the_flag(tmp_path):
    from treadle.cli import app

    r = CliRunner()
    p = tmp_path / "seeds.jsonl"
    p.write_text('{"id": "a", "expression": "1+2"}\n{"id": "a", "expression": "3"}\n')
    res = r.invoke(app, ["rsi", "run", "--out", str(tmp_path / "o"), "--seed-file", str(p)])
    assert res.exit_code == 2 and res.output.startswith("Error: --seed-file:") and "duplicated seed id 'a'" in res.output
    res = r.invoke(app, ["rsi", "run", "--out", str(tmp_path / "o"), "--solver", "oracle"])
    assert res.exit_code == 2 and res.output.startswith("Error: --solver:")
    (tmp_path / "f").write_text("")
    res = r.invoke(app, ["rsi", "run", "--out", str(tmp_path / "f")])
    assert res.exit_code == 2 and res.output.startswith("Error: --out:")
    assert not (tmp_path / "o").exists()


def test_cli_run_and_diff(tmp_path):
    from treadle.cli import app

    r = CliRunner()
    out = tmp_path / "run"
    res = r.invoke(app, ["rsi", "run", "--out", str(out), "--rounds", "2", "--seeds", "8"])
    assert res.exit_code == 0, res.output
    assert "held-out transfer" in res.output
    rows = [json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines()]
    assert rows and all(x["verifier_version"] == "math-sympy-1" for x in rows)
    vs = sorted((out / "harness").iterdir())
    res = r.invoke(app, ["rsi", "diff", str(vs[0]), str(vs[0])])
    assert res.exit_code == 0 and "(no differences)" in res.output
    res = r.invoke(app, ["rsi", "diff", str(vs[0]), str(out / "config.json")])
    assert res.exit_code == 2 and res.output.startswith("Error: NEW:")


def test_contaminated_exports_go_to_repairs(tmp_path):
    seeds = make_seeds(4, 0)
    run(tmp_path / "a", seeds, (), LoopConfig(rounds=1))
    rows = [json.loads(x) for x in (tmp_path / "a" / "problems.jsonl").read_text().splitlines()]
    bench = tmp_path / "bench.txt"
    bench.write_text(rows[-1]["text"] + "\n")
    run(tmp_path / "b", seeds, (), LoopConfig(rounds=1), decontamination=(str(bench),))
    kept = [json.loads(x) for x in (tmp_path / "b" / "problems.jsonl").read_text().splitlines()]
    rep = [json.loads(x) for x in (tmp_path / "b" / "repairs.jsonl").read_text().splitlines()]
    assert rows[-1]["text"] not in {r["text"] for r in kept}
    assert any(r["reason"] == "contaminated" and r["text"] == rows[-1]["text"] for r in rep)
    assert len(kept) < len(rows)


def test_an_interrupted_start_leaves_whole_files_and_a_resume_repairs_them(tmp_path, monkeypatch):
    """Kill the run at every file write of its start (config, seeds, held-out, harness): after each, every
    file present is whole (no torn file, no temporary left after the resume), and the resumed run equals
    an uninterrupted one."""
    import os

    import treadle.rsi.runs as runs_mod

    seeds, held = make_seeds(6, 0), make_seeds(3, 5, prefix="h")
    ref = tmp_path / "ref"
    run(ref, seeds, held, LoopConfig(rounds=1))
    real_replace = os.replace
    for k in range(1, 6):
        out = tmp_path / f"cut{k}"
        calls = {"n": 0}

        def cut(src, dst, _k=k):
            calls["n"] += 1
            if calls["n"] == _k:
                raise KeyboardInterrupt  # the process dies between writing the temporary file and the rename
            return real_replace(src, dst)

        monkeypatch.setattr(runs_mod.os, "replace", cut)
        with pytest.raises(KeyboardInterrupt):
            run(out, seeds, held, LoopConfig(rounds=1))
        monkeypatch.setattr(runs_mod.os, "replace", real_replace)
        if (out / "config.json").exists():  # whatever exists is whole
            assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
        for name in ("seeds.jsonl", "heldout.jsonl"):
            if (out / name).exists():
                assert (out / name).read_text() == (ref / name).read_text(), (k, name)
        run(out, seeds, held, LoopConfig(rounds=1))
        assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
        for name in ("seeds.jsonl", "heldout.jsonl", "state.json", "problems.jsonl"):
            assert (out / name).read_text() == (ref / name).read_text(), (k, name)
        assert not list(out.rglob("*.tmp")), k


def test_a_resume_repairs_a_cut_or_missing_seed_file(tmp_path):
    seeds, held = make_seeds(6, 0), make_seeds(3, 5, prefix="h")
    run(tmp_path / "ref", seeds, held, LoopConfig(rounds=1))
    out = tmp_path / "run"
    run(out, seeds, held, LoopConfig(rounds=1))
    text = (out / "seeds.jsonl").read_text()
    (out / "seeds.jsonl").write_text(text[: len(text) // 2])      # cut by an older writer
    (out / "heldout.jsonl").unlink()                             # or lost
    run(out, seeds, held, LoopConfig(rounds=1))
    for name in ("seeds.jsonl", "heldout.jsonl"):
        assert (out / name).read_text() == (tmp_path / "ref" / name).read_text()

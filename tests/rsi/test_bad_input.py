"""`treadle rsi` bad input found in review: folders where files belong, unreadable files, seeds that
divide by zero, and the flag named in the 'no training seeds' error. One line, exit 2, no run folder made."""
import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.rsi.decontam import BenchmarkIndex, DecontaminationFileError
from treadle.rsi.math_tasks import SeedError, load_seed_file


def _err(args, flag):
    res = CliRunner().invoke(app, ["rsi", *map(str, args)])
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1 and res.output.startswith(f"Error: {flag}:"), res.output
    return res.output


def test_seed_file_kinds(tmp_path):
    with pytest.raises(SeedError, match="is a folder"):
        load_seed_file(tmp_path)
    p = tmp_path / "s.jsonl"
    p.write_text('{"id": "a", "expression": "1+2"}\n{"id": "b", "expression": "3/(2-2)"}\n')
    with pytest.raises(SeedError, match=r"s\.jsonl:2: seed expression '3/\(2-2\)' divides by zero"):
        load_seed_file(p)
    p.write_text('{"id": "a", "expression": "-3"}\n')
    with pytest.raises(SeedError, match=r"s\.jsonl:1: seed expression '-3': only non-negative"):
        load_seed_file(p)
    p.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SeedError, match="cannot be read"):
        load_seed_file(p)
    with pytest.raises(DecontaminationFileError, match="is a folder"):
        BenchmarkIndex().add_file(tmp_path)


def test_cli_bad_files(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    out = tmp_path / "run"
    assert "is a folder" in _err(["run", "--out", out, "--seed-file", d], "--seed-file")
    assert "is a folder" in _err(["run", "--out", out, "--decontaminate", d], "--decontaminate")
    z = tmp_path / "z.jsonl"
    z.write_text('{"id": "a", "expression": "1/0"}\n')
    assert "divides by zero" in _err(["run", "--out", out, "--seed-file", z], "--seed-file")
    one = tmp_path / "one.jsonl"
    one.write_text('{"id": "a", "expression": "1+2"}\n')
    msg = _err(["run", "--out", out, "--seed-file", one, "--heldout-fraction", "0.5"], "--seed-file")
    assert "--heldout-fraction" in msg
    assert not out.exists()
    assert "is a folder" in _err(["diff", d, d], "OLD")
    b = tmp_path / "b.json"
    b.write_bytes(b"\xff\xfe\x00")
    assert "cannot read" in _err(["diff", b, b], "OLD")


def test_resume_after_a_torn_line_and_a_broken_config(tmp_path):
    import json

    out = tmp_path / "run"
    r = CliRunner()
    assert r.invoke(app, ["rsi", "run", "--out", str(out), "--seeds", "4", "--rounds", "1"]).exit_code == 0
    log = out / "log.jsonl"
    log.write_text(log.read_text() + '{"round": 1, "torn')  # the next round killed mid-write
    res = r.invoke(app, ["rsi", "run", "--out", str(out), "--seeds", "4", "--rounds", "2"])
    assert res.exit_code == 0, res.output
    rounds = [json.loads(x)["round"] for x in log.read_text().splitlines()]
    assert max(rounds) == 1 and sorted(set(rounds)) == [0, 1]
    (out / "config.json").write_text("{bad")
    msg = _err(["run", "--out", out, "--seeds", "4", "--rounds", "2"], "--out")
    assert "not a readable run config" in msg and (out / "config.json").read_text() == "{bad"


def test_out_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("mine")
    for cmd in ("run", "ablate"):
        assert _err([cmd, "--out", f], "--out") == f"Error: --out: run folder {str(f)!r} exists and is a file, not a folder\n"
    assert f.read_text() == "mine"

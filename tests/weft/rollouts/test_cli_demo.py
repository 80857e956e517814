"""``treadle weft sample`` (typer app) and the demo section."""
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from treadle.weft.rollouts.cli import app

runner = CliRunner()


@pytest.mark.parametrize("args, flag", [
    (["--k", "0"], "--k"),
    (["--harness", "xml"], "--harness"),
    (["--view", "chat"], "--view"),
    (["--method", "best"], "--method"),
    (["--rate", "wrong_argument"], "--rate"),
    (["--rate", "typo=0.1"], "--rate"),
    (["--policy", "llm"], "--llm-config"),
    (["--disclosure", "most"], "--disclosure"),
])
def test_bad_flags_are_one_line_exit_2_before_any_work(tmp_path, args, flag):
    r = runner.invoke(app, ["sample", str(tmp_path / "run"), *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {flag}:"), r.output
    assert not (tmp_path / "run" / "trajectories.jsonl").exists()


def test_sample_writes_run_folder_and_resumes(tmp_path):
    args = ["sample", str(tmp_path), "--k", "1", "--k", "2", "--rate", "skipped_call=0.2", "--harness", "react"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2  # tasks x methods x ks
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {(r["method"], r["k"]) for r in rows} == {(m, k) for m in ("prefix", "end_to_end") for k in (1, 2)}
    sft = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert all(set(s) == {"messages", "tools"} and s["messages"][0]["role"] == "system" for s in sft)
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and len((tmp_path / "trajectories.jsonl").read_text().splitlines()) == 8
    r = runner.invoke(app, [*args[:-2], "--harness", "hermes"])
    assert r.exit_code == 2 and "another config" in r.output


def test_demo_section(tmp_path):
    from treadle.weft.rollouts.demo import run

    console = Console(record=True, width=200)
    run(tmp_path, True, console)
    text = console.export_text()
    assert "rejection sampling" in text and "views x harnesses" in text
    rows = [json.loads(x) for x in (tmp_path / "methods" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and (tmp_path / "methods" / "sft.jsonl").stat().st_size > 0
    assert (tmp_path / "methods" / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

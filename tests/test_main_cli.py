"""The `treadle` command: version, backends, demo section, bench argument errors."""
import json

from typer.testing import CliRunner

from treadle import __version__
from treadle.cli import app

runner = CliRunner()


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output


def test_backends_json_lists_every_op_for_both_devices():
    res = runner.invoke(app, ["backends", "--json"])
    assert res.exit_code == 0, res.output
    table = json.loads(res.output)
    assert "grpo_advantages" in table
    for devs in table.values():
        assert set(devs) == {"cpu", "cuda"}
        assert all(d["backend"] in ("reference", "cpp", "cuda", "triton") and d["reason"] for d in devs.values())


def test_demo_grpo_op_section(tmp_path):
    res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--quick", "--run-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "max |A - reference|" in res.output
    rows = json.loads((tmp_path / "grpo-op" / "advantages.json").read_text())
    assert {r["backend"] for r in rows} >= {"reference", "cpp"}
    assert all(r["max_err"] < 1e-6 for r in rows)


def test_demo_unknown_section_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["demo", "--sections", "nope", "--run-dir", str(tmp_path)])
    assert res.exit_code != 0
    assert res.exit_code == 2 and "unknown demo section" in res.output


def test_bench_unknown_suite():
    res = runner.invoke(app, ["bench", "--ops", "nope"])
    assert res.exit_code != 0
    assert "no such benchmark suite" in res.output


def test_demo_run_folder_rule(tmp_path, monkeypatch):
    """Quick demos go to their own folder; a finished run is kept, other settings refused, --overwrite replaces;
    run.json records version, commit, command line, machine and times."""
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--quick"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "runs" / "demo-quick" / "grpo-op" / "advantages.json").exists()
    assert not (tmp_path / "runs" / "demo").exists()
    record = json.loads((tmp_path / "runs" / "demo-quick" / "run.json").read_text())
    assert record["status"] == "finished" and record["treadle_version"] == __version__
    assert record["started"] <= record["ended"] and record["machine"]["cpu_count"] >= 1
    assert record["config"] == {"sections": ["grpo-op"], "quick": True} and "git_commit" in record
    before = (tmp_path / "runs" / "demo-quick" / "grpo-op" / "advantages.json").stat().st_mtime_ns
    res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--quick"])
    assert res.exit_code == 0 and "already holds this finished demo run" in res.output, res.output
    assert (tmp_path / "runs" / "demo-quick" / "grpo-op" / "advantages.json").stat().st_mtime_ns == before
    res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--out", "runs/demo-quick"])  # full settings there
    assert res.exit_code == 2 and "another config" in res.output and "quick" in res.output, res.output
    res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--out", "runs/demo-quick", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "runs" / "demo-quick" / "run.json").read_text())["config"]["quick"] is False


def test_out_and_its_old_name_run_dir(tmp_path):
    res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--quick", "--out", str(tmp_path / "a"),
                              "--run-dir", str(tmp_path / "b")])
    assert res.exit_code == 2 and "--run-dir is the old name of --out" in res.output
    assert "--run-dir" not in runner.invoke(app, ["demo", "--help"]).output  # a hidden alias


def test_a_non_run_folder_is_never_deleted(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    for extra in ([], ["--overwrite"]):
        res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--quick", "--out", str(tmp_path), *extra])
        assert res.exit_code == 2 and "not a treadle run folder" in res.output
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_demo_section_given_twice_is_refused_before_any_work(tmp_path):
    """``--sections scale,scale`` ran the section twice into one sub-folder (minutes of repeated work)."""
    res = runner.invoke(app, ["demo", "--quick", "--sections", "grpo-op,scale,grpo-op", "--out", str(tmp_path / "d")])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--sections" in lines[0] and "['grpo-op'] given twice" in lines[0], res.output
    assert not (tmp_path / "d").exists()

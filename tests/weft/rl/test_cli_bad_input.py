"""`treadle weft groups|train` and `treadle model train-tiny --task`: bad input is one line naming the flag,
exit 2, before any work (no model is loaded or trained, no folder is written)."""
import json

import pytest
from typer.testing import CliRunner

from treadle.models.cli import app as model_app
from treadle.weft.cli import app

runner = CliRunner()


@pytest.mark.parametrize("args,flag", [
    (["groups", "-G", "1"], "--group-size"),
    (["groups", "--group-size", "0"], "--group-size"),
    (["groups", "--episodes", "0"], "--episodes"),
    (["groups", "--chunk", "0"], "--chunk"),
    (["groups", "--split", "test"], "--split"),
    (["groups", "--estimator", "ppo"], "--estimator"),
    (["train", "--grouping", "turn"], "--grouping"),
    (["train", "--seeds", "a,b"], "--seeds"),
    (["train", "--seeds", "1,1"], "--seeds"),
    (["train", "--steps", "0"], "--steps"),
    (["train", "--jobs", "0"], "--jobs"),
    (["train", "--eval-episodes", "0"], "--eval-episodes"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, monkeypatch, args, flag):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    r = runner.invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert flag in r.output
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_groups_refuses_a_folder_of_another_config(tmp_path, monkeypatch):
    from treadle.run_dirs import open_run_dir

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    run = open_run_dir(out, command="weft groups", config={"model": "other"}).start()
    (out / "config.json").write_text('{"model": "other"}')
    run.end("finished")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = runner.invoke(app, ["groups", "--out", str(out)])
    assert r.exit_code == 2 and "--out" in r.output and "another config" in r.output and "model" in r.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not (tmp_path / "cache").exists()


def test_groups_refuses_a_user_folder_and_records_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    r = runner.invoke(app, ["groups", "--out", str(mine), "--quick"])
    assert r.exit_code == 2 and "not a treadle run folder" in r.output, r.output
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and not (tmp_path / "cache").exists()
    # --model is checked (folder, config, tokenizer) before the run folder is written
    out = tmp_path / "out"
    r = runner.invoke(app, ["groups", "--out", str(out), "--model", str(tmp_path / "no-such-model")])
    assert r.exit_code == 2 and "--model" in r.output
    assert not out.exists()


def test_train_refuses_a_folder_that_is_not_a_run_folder(tmp_path, monkeypatch):
    """Results without a run.json (e.g. an older treadle's comparison) are not ours to resume or delete
    (the run-folder rule; tests/weft/rl/test_train_run_folder.py has the rest)."""
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    for extra in ([], ["--overwrite"]):
        r = runner.invoke(app, ["train", "--out", str(out), *extra])
        assert r.exit_code == 2 and "not a treadle run folder" in " ".join(r.output.split()), r.output
    assert not (tmp_path / "cache").exists() and sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_train_refuses_the_removed_resume_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    r = runner.invoke(app, ["train", "--out", str(tmp_path / "out"), "--overwrite", "--resume"])
    assert r.exit_code == 2 and "--resume" in r.output and "resumes by itself" in r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_train_tiny_unknown_task(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    r = runner.invoke(model_app, ["train-tiny", "--task", "chess"])
    assert r.exit_code == 2 and "--task" in r.output
    assert not (tmp_path / "cache").exists()


def test_train_tiny_tools_goes_through_the_one_train_tiny_path(tmp_path, monkeypatch):
    """`train-tiny --task tools` shares the math path: the slot is kept when it holds the same settings,
    refused (exit 2, naming --out and the differing field) when it holds others, and a bad value names
    its flag."""
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "tools"
    r = runner.invoke(model_app, ["train-tiny", "--task", "tools", "--quick", "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert (out / "treadle_checkpoint.json").exists() and "held-out" in r.output
    r = runner.invoke(model_app, ["train-tiny", "--task", "tools", "--quick", "--out", str(out)])
    assert r.exit_code == 0 and "already holds this model" in r.output and "recorded held-out success" in r.output
    marker = (out / "treadle_checkpoint.json").read_text()
    r = runner.invoke(model_app, ["train-tiny", "--task", "tools", "--quick", "--out", str(out), "--seed", "3"])
    assert r.exit_code == 2 and "--out" in r.output and "differs in seed" in r.output
    assert (out / "treadle_checkpoint.json").read_text() == marker
    r = runner.invoke(model_app, ["train-tiny", "--task", "tools", "--seed", "-1", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--seed" in r.output and not (tmp_path / "x").exists()


def test_groups_run_folder_is_recorded_and_resumed(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    args = ["groups", "--quick", "--episodes", "1", "-G", "2", "--chunk", "1", "--out", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "chunk 0: 1 groups" in r.output and "chunk 1: 1 groups" in r.output
    rows = (out / "rows.jsonl").read_text()
    rec = json.loads((out / "run.json").read_text())
    assert rec["command"] == "weft groups" and rec["status"] == "finished" and rec["history"] == []
    assert rec["config"]["G"] == 2 and rec["config"]["episodes"] == 1
    r = runner.invoke(app, args)  # the same config: resumed, no chunk sampled again, rows unchanged
    assert r.exit_code == 0 and "chunk 0" not in r.output and "2 groups x G=2" in r.output, r.output
    assert (out / "rows.jsonl").read_text() == rows
    rec = json.loads((out / "run.json").read_text())
    assert rec["status"] == "finished" and len(rec["history"]) == 1

"""`treadle weft groups|train` and `treadle model train-tiny --task`: bad input is one line naming the flag,
exit 2, before any work (no model is loaded or trained, no folder is written)."""
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
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"model": "other"}')
    r = runner.invoke(app, ["groups", "--out", str(out)])
    assert r.exit_code == 2 and "--out" in r.output and "differs in" in r.output
    assert (out / "config.json").read_text() == '{"model": "other"}'
    assert not (tmp_path / "cache").exists()


def test_train_refuses_a_finished_comparison_without_overwrite(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    r = runner.invoke(app, ["train", "--out", str(out)])
    assert r.exit_code == 2 and "--overwrite" in r.output
    assert not (tmp_path / "cache").exists()


def test_train_refuses_overwrite_with_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    r = runner.invoke(app, ["train", "--out", str(tmp_path / "out"), "--overwrite", "--resume"])
    assert r.exit_code == 2 and "--overwrite and --resume" in r.output
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

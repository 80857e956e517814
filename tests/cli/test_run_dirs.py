"""treadle.run_dirs: the one run-folder rule, and what run.json records."""
import json

import pytest

from treadle import __version__
from treadle.run_dirs import RunDirError, open_run_dir, read_run_record


def _finish(path, config, command="x"):
    run = open_run_dir(path, command=command, config=config).start()
    (path / "result.txt").write_text("r")
    run.end("finished")
    return run


def test_new_folder_starts_and_records_the_run(tmp_path):
    run = open_run_dir(tmp_path / "r", command="x", config={"a": 1})
    assert not (tmp_path / "r").exists()  # checking changes nothing
    assert not run.resumed and not run.finished
    run.start()
    rec = read_run_record(tmp_path / "r")
    assert rec["status"] == "running" and rec["ended"] is None and rec["treadle_version"] == __version__
    assert rec["config"] == {"a": 1} and rec["command"] == "x" and isinstance(rec["argv"], list)
    assert {"host", "os", "python", "cpu", "cpu_count"} <= set(rec["machine"])
    run.end("finished")
    rec = read_run_record(tmp_path / "r")
    assert rec["status"] == "finished" and rec["ended"] >= rec["started"]


def test_same_config_resumes_other_config_is_refused_overwrite_replaces(tmp_path):
    p = tmp_path / "r"
    _finish(p, {"a": 1, "b": [1, 2]})
    again = open_run_dir(p, command="x", config={"a": 1, "b": (1, 2)})  # tuples and lists are the same JSON
    assert again.resumed and again.finished
    with pytest.raises(RunDirError, match=r"--out .* another config \(a: 1 -> 2\).*--overwrite"):
        open_run_dir(p, command="x", config={"a": 2, "b": [1, 2]})
    assert (p / "result.txt").exists()
    over = open_run_dir(p, command="x", config={"a": 2, "b": [1, 2]}, overwrite=True)
    assert (p / "result.txt").exists()  # nothing deleted before start()
    over.start()
    assert not (p / "result.txt").exists() and read_run_record(p)["config"]["a"] == 2


def test_ignored_keys_may_change_on_resume(tmp_path):
    p = tmp_path / "r"
    _finish(p, {"a": 1, "steps": 10})
    run = open_run_dir(p, command="x", config={"a": 1, "steps": 20}, ignore=("steps",))
    assert run.resumed
    run.start()
    rec = read_run_record(p)
    assert rec["config"]["steps"] == 20 and len(rec["history"]) == 1 and rec["history"][0]["status"] == "finished"


def test_folders_that_are_not_ours_are_never_deleted(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    for overwrite in (False, True):
        with pytest.raises(RunDirError, match="not a treadle run folder"):
            open_run_dir(tmp_path, command="x", config={}, overwrite=overwrite)
    _finish(tmp_path / "other", {}, command="scale train")
    with pytest.raises(RunDirError, match="holds a `treadle scale train` run"):
        open_run_dir(tmp_path / "other", command="stair train", config={}, overwrite=True)
    assert (tmp_path / "mine.txt").read_text() == "keep"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not open_run_dir(empty, command="x", config={}).resumed


def test_unusable_paths(tmp_path):
    (tmp_path / "f").write_text("x")
    for bad in (tmp_path / "f", tmp_path / "f" / "sub", "/proc/treadle-nope"):
        with pytest.raises(RunDirError, match="--out"):
            open_run_dir(bad, command="x", config={})
    assert read_run_record(tmp_path) is None


def test_an_attempt_that_saved_nothing_does_not_lock_the_folder(tmp_path):
    """A run refused for bad input after its start (or failed, or interrupted) with nothing written but
    run.json: the corrected command takes the folder; a run that wrote results is still refused."""
    from typer import _click as click  # the click that typer (and usage_error) raise
    from rich.console import Console

    from treadle.cli_runs import recorded

    p = tmp_path / "r"
    run = open_run_dir(p, command="x", config={"target_modules": ["nope"]})
    with pytest.raises(click.exceptions.UsageError), recorded(run, Console(quiet=True)):
        raise click.exceptions.UsageError("--target-modules: 'nope' not found")
    rec = read_run_record(p)
    assert rec["status"] == "refused" and "--target-modules" in rec["error"]
    again = open_run_dir(p, command="x", config={"target_modules": ["q_proj"]})
    assert not again.finished
    again.start()
    rec = read_run_record(p)
    assert rec["config"] == {"target_modules": ["q_proj"]} and rec["history"][0]["status"] == "refused"
    (p / "result.txt").write_text("r")
    again.end("failed")
    with pytest.raises(RunDirError, match="another config"):  # results exist: never taken silently
        open_run_dir(p, command="x", config={"target_modules": ["v_proj"]})

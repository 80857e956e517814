"""``treadle weft train``'s run folder follows the project rule (treadle.run_dirs): run.json records the run; a
finished run of the same settings is shown, not re-run; another config is refused with one line naming --out
(exit 2, nothing touched); a refused run leaves the folder reusable; a folder of the removed GRPO loop is refused
with one usage error. (A run interrupted mid-way continues from TRL's checkpoint: test_trl_cli.py.)"""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app


@pytest.fixture(scope="module")
def start_policy(tmp_path_factory, tiny_policy, tok):
    d = tmp_path_factory.mktemp("policy") / "tiny"
    tiny_policy.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _args(out, policy, *extra):
    return ["weft", "train", "--grouping", "atomic", "--seeds", "0", "--steps", "1", "--eval-episodes", "1",
            "--quick", "--model", str(policy), "--out", str(out), *extra]


def _files(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, start_policy):
    out = tmp_path_factory.mktemp("weft") / "run"
    r = CliRunner().invoke(app, _args(out, start_policy), env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    return out


def test_run_json_records_the_run_and_a_finished_run_is_shown_not_rerun(finished, start_policy):
    rec = json.loads((finished / "run.json").read_text())
    assert rec["command"] == "weft train" and rec["status"] == "finished" and rec["ended"]
    assert rec["config"]["steps"] == 1 and rec["config"]["sampler"] == "trl" and rec["machine"]["cpu_count"]
    assert "treadle_version" in rec and "git_commit" in rec and rec["argv"]
    assert list((finished / "atomic-seed0" / "trl").glob("checkpoint-*"))  # TRL's checkpoints
    before = _files(finished)
    r = CliRunner().invoke(app, _args(finished, start_policy), env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "already holds this finished comparison" in " ".join(r.output.split()), r.output
    assert _files(finished) == before


@pytest.mark.parametrize("change", [["--steps", "2"], ["--eval-episodes", "2"]])
def test_another_config_is_refused_with_one_line_and_nothing_touched(finished, start_policy, change):
    before = _files(finished)
    args = _args(finished, start_policy)
    i = args.index(change[0])
    args[i + 1] = change[1]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("Error: --out") and "\n" not in err and "another config" in err, err
    assert change[0].lstrip("-").replace("-", "_") in err and "--overwrite" in err
    assert _files(finished) == before


def test_a_folder_of_the_removed_loop_is_one_usage_error(tmp_path, start_policy):
    out = tmp_path / "old"
    out.mkdir()
    old = {"command": "weft train", "status": "finished", "config": {"groupings": ["atomic"], "sampler": "hf"}}
    (out / "run.json").write_text(json.dumps(old))
    (out / "summary.json").write_text("{}")
    before = _files(out)
    r = CliRunner().invoke(app, _args(out, start_policy), env={"COLUMNS": "300"})
    err = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "removed GRPO loop" in err and "--overwrite" in err and "Traceback" not in r.output
    assert _files(out) == before


def test_refused_run_leaves_the_folder_reusable(tmp_path, start_policy):
    from treadle.run_dirs import open_run_dir

    out = tmp_path / "run"
    r = CliRunner().invoke(app, _args(out, tmp_path / "no-such-policy"), env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "--model" in r.stderr and "Traceback" not in r.output, r.output
    assert not out.exists()  # --model is checked before the run folder is written
    # a run refused once it started (nothing but run.json written) leaves the folder to the corrected command
    run = open_run_dir(out, command="weft train", config={"model": "bad"}).start()
    run.end("refused", error="--model: bad")
    open_run_dir(out, command="weft train", config={"other": 1})


def test_a_non_run_folder_is_refused(tmp_path, start_policy):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    r = CliRunner().invoke(app, _args(out, start_policy, "--overwrite"), env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "not a treadle run folder" in r.stderr, r.output
    assert _files(out) == {out / "mine.txt": b"keep"}


def test_kl_coef_reaches_the_runs_and_is_part_of_the_config(tmp_path, finished, start_policy):
    """``--kl-coef`` sets the runs' ``kl_coef`` (TRL's ``beta``) and is part of the comparison's config: adding it
    to a finished comparison of the same other settings is refused."""
    before = _files(finished)
    r = CliRunner().invoke(app, _args(finished, start_policy, "--kl-coef", "0.04"), env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "kl_coef" in r.stderr and "\n" not in r.stderr.strip(), r.output
    assert _files(finished) == before
    out = tmp_path / "kl"
    r = CliRunner().invoke(app, _args(out, start_policy, "--kl-coef", "0.5"), env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "atomic-seed0" / "summary.json").read_text())
    assert summary["config"]["kl_coef"] == 0.5 and all("kl" in rec for rec in summary["log"])
    assert json.loads((out / "run.json").read_text())["config"]["kl_coef"] == 0.5


@pytest.mark.parametrize("value", ["-0.1", "nan", "inf"])
def test_bad_kl_coef_is_one_line_before_any_work(tmp_path, start_policy, value):
    out = tmp_path / "run"
    r = CliRunner().invoke(app, _args(out, start_policy, "--kl-coef", value), env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "--kl-coef" in r.stderr and "Traceback" not in r.output, r.output
    assert not out.exists()

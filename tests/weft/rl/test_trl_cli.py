"""``treadle weft train``: atomic-turn and trajectory GRPO on trl.GRPOTrainer from the CLI, under the
run-folder rule (run.json; a finished run is shown, not re-run; another config refused, nothing touched;
--overwrite runs again)."""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.testing import require_module


@pytest.fixture(scope="module")
def start_policy(tmp_path_factory, tiny_policy, tok):
    d = tmp_path_factory.mktemp("policy") / "tiny"
    tiny_policy.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _args(out, policy, *extra):
    return ["weft", "train", "--seeds", "0", "--steps", "1", "--eval-episodes", "1", "--quick", "--model",
            str(policy), "--out", str(out), *extra]


def _files(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_trl_engine_is_the_default_and_follows_the_run_folder_rule(tmp_path, start_policy):
    require_module("trl")
    out = tmp_path / "run"
    r = CliRunner().invoke(app, _args(out, start_policy), env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "run.json").read_text())
    assert rec["status"] == "finished" and rec["config"]["engine"] == "trl" and rec["config"]["groupings"] == ["atomic"]
    seed = json.loads((out / "atomic-seed0" / "summary.json").read_text())
    assert seed["engine"] == "trl" and seed["log"] and "turn_success_sampled" in seed["after"]
    assert list((out / "atomic-seed0" / "trl").glob("checkpoint-*"))  # TRL's own checkpoints: its resume
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["groupings"]) == {"atomic"}
    before = _files(out)
    r = CliRunner().invoke(app, _args(out, start_policy), env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "already holds this finished comparison" in " ".join(r.output.split()), r.output
    assert _files(out) == before
    r = CliRunner().invoke(app, _args(out, start_policy, "--kl-coef", "0.1"), env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "another config" in r.stderr and "--out" in r.stderr, r.output
    assert _files(out) == before
    r = CliRunner().invoke(app, _args(out, start_policy, "--overwrite"), env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["status"] == "finished"


def test_both_groupings_on_trl(tmp_path, start_policy):
    require_module("trl")
    out = tmp_path / "run"
    r = CliRunner().invoke(app, _args(out, start_policy, "--grouping", "both"), env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["config"]["groupings"] == ["atomic", "trajectory"]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["groupings"]) == {"atomic", "trajectory"}
    traj = json.loads((out / "trajectory-seed0" / "summary.json").read_text())
    assert traj["config"]["grouping"] == "trajectory" and traj["global_step"] == traj["config"]["num_iterations"]
    assert (out / "start-policy" / "config.json").exists()


@pytest.mark.parametrize("extra,flag", [(["--parallel", "ddp"], "--parallel"), (["--jobs", "1"], "--jobs"),
                                        (["--resume"], "--resume"), (["--engine", "loop"], "--engine"),
                                        (["--engine", "ray"], "--engine")])
def test_flags_of_the_removed_loop_are_one_usage_error_before_any_work(tmp_path, monkeypatch, extra, flag):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["weft", "train", "--out", str(out), *extra])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and flag in text and "loop was removed" in text and "Traceback" not in text, r.output
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_an_interrupted_seed_continues_from_trls_checkpoint(tmp_path, tiny_policy, tok):
    require_module("trl")
    from transformers import TrainerCallback

    from treadle.weft.rl.sft import gold_episodes
    from treadle.weft.rl.config import WeftTrainConfig
    from treadle.weft.rl.trl_run import train_seed

    class Stop(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            raise KeyboardInterrupt

    cfg = WeftTrainConfig.quick(steps=2, num_iterations=1, eval_episodes=1)
    held = gold_episodes(1, "heldout", start=900_000)
    run = tmp_path / "atomic-seed0"
    with pytest.raises(KeyboardInterrupt):
        train_seed(run, (tiny_policy, tok), cfg, held=held, callbacks=[Stop()])
    assert [p.name for p in (run / "trl").glob("checkpoint-*")] == ["checkpoint-1"]
    assert not (run / "summary.json").exists() and (run / "before.json").exists()
    s = train_seed(run, (tiny_policy, tok), cfg, held=held)
    # TRL's trainer state came back from checkpoint-1 (its log entry) and step 2 ran
    assert s["global_step"] == 2 and [r["step"] for r in s["log"]] == [1, 2]
    assert sorted(p.name for p in (run / "trl").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]

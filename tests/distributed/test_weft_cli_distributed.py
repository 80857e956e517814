"""``treadle weft train --parallel``: refused outside torchrun and for anything but ddp or fsdp2 (one line, exit 2,
nothing written); under ``torchrun --nproc-per-node 2 -m treadle`` it trains and rank 0 alone writes the
run folder and the step checkpoint (one short wiring check: the resume equivalences are API tests)."""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app

ARGS = ["weft", "train", "--quick", "--grouping", "atomic", "--seeds", "0", "--steps", "1"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2", "zero3"])
def test_parallel_refused_before_any_work(tmp_path, outside_torchrun, parallel):
    r = CliRunner().invoke(app, [*ARGS, "--parallel", parallel, "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "--parallel" in text and "Traceback" not in text
    if parallel == "ddp":  # outside torchrun: says how to launch it and what is missing
        assert "torchrun" in text and "RANK" in text
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_torchrun_two_ranks_writes_one_run_folder(tmp_path, treadle_cli):
    """The CLI wiring only (one torchrun job): rank 0 alone writes the run folder (run.json, one log line per
    step, the whole batch's counts) and the step checkpoint; the config does not follow the world size (one
    episode per step: rank 1 has none), so the run continues on any number of ranks. That a resumed run
    equals the uninterrupted one (1 <-> 2 ranks, ddp <-> fsdp2, one process) is tested on the API:
    test_weft_resume_distributed.py; the run-folder rule: tests/weft/rl/test_train_run_folder.py."""
    import torch

    two = treadle_cli([*ARGS, "--parallel", "ddp", "--out", tmp_path / "two"], ranks=2, timeout=900)
    assert "ddp on 2 ranks" in two.stdout
    run = tmp_path / "two" / "atomic-seed0"
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0]  # one line per step (not one per rank)
    # the whole batch's numbers: 2 turn groups (1 episode, on rank 0) of G = 2
    assert steps[0]["groups"] == 2 and steps[0]["segments"] == 4
    summary = json.loads(run.joinpath("summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["turns_per_step"] == 2
    state = torch.load(run / "checkpoint" / "state.pt", weights_only=False)
    assert state["next_step"] == 1 and state["config"]["sampler"] == "row-keyed"
    assert state["config"] | {"sampler": None} == summary["config"] | {"sampler": None}
    rec = json.loads((tmp_path / "two" / "run.json").read_text())
    assert rec["command"] == "weft train" and rec["status"] == "finished" and rec["config"]["sampler"] == "row-keyed"
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["groupings"]["atomic"]


def test_checkpoint_every_below_one_is_refused(tmp_path, outside_torchrun):
    r = CliRunner().invoke(app, [*ARGS, "--checkpoint-every", "0", "--out", str(tmp_path / "run")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "--checkpoint-every" in text and "Traceback" not in text, r.output
    assert not (tmp_path / "run").exists()

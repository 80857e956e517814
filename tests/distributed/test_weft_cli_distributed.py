"""``treadle weft train --parallel``: refused outside torchrun and for anything but ddp or fsdp2 (one line, exit 2,
nothing written); under ``torchrun --nproc-per-node 2 -m treadle`` it trains and rank 0 alone writes the
run folder."""
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
    two = treadle_cli([*ARGS, "--parallel", "ddp", "--out", tmp_path / "two"], ranks=2, timeout=900)
    assert "ddp on 2 ranks" in two.stdout and "one episode per rank" in two.stdout
    run = tmp_path / "two" / "atomic-seed0"
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0]  # one line per step (not one per rank)
    # the whole batch's numbers: 4 turn groups (2 episodes, one per rank) of G = 2
    assert steps[0]["groups"] == 4 and steps[0]["segments"] == 8
    summary = json.loads(run.joinpath("summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["turns_per_step"] == 4
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["groupings"]["atomic"]


def test_checkpoint_every_below_one_is_refused(tmp_path, outside_torchrun):
    r = CliRunner().invoke(app, [*ARGS, "--checkpoint-every", "0", "--out", str(tmp_path / "run")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "--checkpoint-every" in text and "Traceback" not in text, r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_torchrun_interrupted_run_resumes_from_its_step_checkpoint(tmp_path, treadle_cli):
    """A run whose summary is missing (interrupted after its last checkpoint) continues from the checkpoint,
    a finished one is reused with --resume, and a checkpoint of another config (1 rank: other turns per step
    under --quick) is not used."""
    import torch

    args = [*ARGS[:-1], "2", "--parallel", "ddp", "--out", tmp_path / "w"]
    treadle_cli(args, ranks=2, timeout=900)
    run = tmp_path / "w" / "atomic-seed0"
    first = json.loads((run / "summary.json").read_text())
    state = torch.load(run / "checkpoint" / "state.pt", weights_only=False)
    assert state["next_step"] == 2 and len(state["records"]) == 2 and first["resumed_from_step"] is None
    again = treadle_cli([*args, "--resume"], ranks=2, timeout=900)
    assert "1 finished runs reused" in again.stdout
    (run / "summary.json").unlink()  # interrupted after the last step's checkpoint
    (tmp_path / "w" / "summary.json").unlink()
    resumed = treadle_cli(args, ranks=2, timeout=900)
    assert "atomic-seed0: resumed at step 2 of 2" in " ".join(resumed.stdout.split())
    second = json.loads((run / "summary.json").read_text())
    assert second["resumed_from_step"] == 2 and second["evals"] == first["evals"]
    assert [r["loss"] for r in second["records"]] == [r["loss"] for r in first["records"]]
    assert [json.loads(x)["step"] for x in (run / "steps.jsonl").read_text().splitlines()] == [0, 1]
    one = treadle_cli([*args, "--resume"], ranks=1, timeout=900)
    text = " ".join(one.stdout.split())
    assert "not used: another config (differs in turns_per_step)" in text and "0 finished runs reused" in text
    assert json.loads((run / "summary.json").read_text())["config"]["turns_per_step"] == 2


@pytest.mark.slow
def test_torchrun_fsdp2_trains_and_its_checkpoint_resumes_under_ddp(tmp_path, treadle_cli):
    """``--parallel fsdp2`` under torchrun: rank 0 writes one run folder and a full-tensor step checkpoint,
    which a DDP job (a run interrupted before its summary) resumes from."""
    args = [*ARGS, "--out", tmp_path / "w"]
    two = treadle_cli([*args, "--parallel", "fsdp2"], ranks=2, timeout=900)
    assert "fsdp2 on 2 ranks" in two.stdout
    run = tmp_path / "w" / "atomic-seed0"
    first = json.loads((run / "summary.json").read_text())
    assert first["parallel"] == "fsdp2" and first["world_size"] == 2
    assert [json.loads(x)["step"] for x in (run / "steps.jsonl").read_text().splitlines()] == [0]
    (run / "summary.json").unlink()
    (tmp_path / "w" / "summary.json").unlink()
    ddp = treadle_cli([*args, "--parallel", "ddp"], ranks=2, timeout=900)
    assert "atomic-seed0: resumed at step 1 of 1" in " ".join(ddp.stdout.split())
    second = json.loads((run / "summary.json").read_text())
    assert second["parallel"] == "ddp" and second["evals"] == first["evals"]
    assert [r["loss"] for r in second["records"]] == [r["loss"] for r in first["records"]]

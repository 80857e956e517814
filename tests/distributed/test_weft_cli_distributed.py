"""``treadle weft train --parallel``: refused outside torchrun and for anything but ddp (one line, exit 2,
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

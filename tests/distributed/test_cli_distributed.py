"""``treadle stair train --parallel``: refused outside torchrun (one line, exit 2); under ``torchrun
--nproc-per-node 2 -m treadle`` the Trainer runs DDP and one run folder is written, whose normals equal a
one-process run."""
import json

import pytest
import torch
from typer.testing import CliRunner

from treadle.cli import app

ARGS = ["stair", "train", "--quick", "--steps", "2", "--sessions", "4", "--batch-size", "3", "--turns", "2",
        "--responses", "gold", "--threads", "1"]


def test_parallel_outside_torchrun_is_one_line_exit_2(tmp_path, outside_torchrun):
    r = CliRunner().invoke(app, [*ARGS, "--parallel", "ddp", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "--parallel" in text and "torchrun" in text and "RANK" in text and "Traceback" not in text
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    r = CliRunner().invoke(app, [*ARGS, "--parallel", "zero3", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "--parallel" in r.output


@pytest.mark.slow
def test_torchrun_two_ranks_equals_one_process(tmp_path, treadle_cli):
    treadle_cli([*ARGS, "--out", tmp_path / "one"])
    two = treadle_cli([*ARGS, "--parallel", "ddp", "--out", tmp_path / "two"], ranks=2)
    assert "ddp on 2 ranks" in two.stdout
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / d / "normals.safetensors"))["normals"] for d in ("one", "two"))
    torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-5)
    steps = [json.loads(x) for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines() if '"step"' in x]
    ref = [json.loads(x) for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines() if '"step"' in x]
    assert [s["step"] for s in steps] == [1, 2]
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in ref], rel=1e-5)


def test_scale_parallel_needs_an_adapter_and_torchrun(tmp_path, outside_torchrun):
    base = ["scale", "train", "--quick", "--parallel", "fsdp2", "--out", str(tmp_path / "run")]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 2 and "--adapter" in r.output and "Traceback" not in r.output, r.output
    ad = tmp_path / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    r = CliRunner().invoke(app, [*base, "--adapter", str(ad)])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "--parallel" in text and "torchrun" in text and "Traceback" not in text
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("cmd", [["stair", "train", "--quick"], ["scale", "train", "--quick"]])
def test_a_launched_rank_without_parallel_is_refused(tmp_path, outside_torchrun, cmd):
    """Under torchrun without --parallel every rank would write the run folder: refused, before any work."""
    outside_torchrun.setenv("WORLD_SIZE", "2")
    r = CliRunner().invoke(app, [*cmd, "--out", str(tmp_path / "run")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "--parallel ddp" in text and "Traceback" not in text, r.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()

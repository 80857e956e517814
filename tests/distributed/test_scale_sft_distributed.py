"""``treadle scale sft --parallel ddp|fsdp2`` (SCALE Stage I under torchrun: the Trainer's DDP, or its FSDP2
on accelerators): --batch-size stays the global batch, rank 0 alone writes the run folder, and the adapter
and per-step losses equal a one-process run."""
import json

import pytest
import torch
from typer.testing import CliRunner

from treadle.cli import app

ARGS = ["scale", "sft", "--quick", "--steps", "4", "--batch-size", "6", "--threads", "1"]


def test_sft_parallel_refusals_are_one_line_exit_2(tmp_path, outside_torchrun):
    monkeypatch = outside_torchrun
    r = CliRunner().invoke(app, [*ARGS, "--parallel", "ddp", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "--parallel" in r.output and "torchrun" in r.output, r.output
    r = CliRunner().invoke(app, [*ARGS, "--parallel", "fsdp2", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "--parallel" in r.output, r.output
    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun rank without --parallel
    r = CliRunner().invoke(app, [*ARGS, "--out", str(tmp_path / "run")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "--parallel ddp" in text and "Traceback" not in text, r.output
    monkeypatch.setenv("WORLD_SIZE", "4")  # 6 problems do not split over 4 ranks
    r = CliRunner().invoke(app, [*ARGS, "--parallel", "ddp", "--out", str(tmp_path / "run")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "--batch-size" in text and "multiple of the 4" in text, r.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_torchrun_two_ranks_stage_one_equals_one_process(tmp_path, treadle_cli):
    treadle_cli([*ARGS, "--out", tmp_path / "one"])
    two = treadle_cli([*ARGS, "--parallel", "ddp", "--out", tmp_path / "two"], ranks=2)
    assert two.stdout.count("Stage I (TRL SFTTrainer") == 1  # rank 0 alone prints
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / d / "adapter" / "adapter_model.safetensors")) for d in ("one", "two"))
    assert sorted(a) == sorted(b) and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    # LoRA B starts at zero: training moved it, so equal adapters are a real check
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 1e-3
    steps = [json.loads(x) for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]  # one line per step: rank 1 wrote nothing
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in ref], rel=1e-5)
    assert json.loads((tmp_path / "two" / "run.json").read_text())["status"] == "finished"

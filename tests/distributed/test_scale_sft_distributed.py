"""``treadle scale sft --parallel ddp`` (SCALE Stage I on TRL's own DDP under torchrun): --batch-size stays the
global batch, rank 0 alone writes the run folder, and the adapter and per-step losses equal a one-process run."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from treadle.cli import app

ARGS = ["scale", "sft", "--quick", "--steps", "4", "--batch-size", "6", "--threads", "1"]


def _clean_env(monkeypatch, tmp_path):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "300")


def test_sft_parallel_refusals_are_one_line_exit_2(tmp_path, monkeypatch):
    _clean_env(monkeypatch, tmp_path)
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
def test_torchrun_two_ranks_stage_one_equals_one_process(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun next to the interpreter"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TREADLE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "COLUMNS": "300"}
    one = subprocess.run([sys.executable, "-m", "treadle", *ARGS, "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "treadle", *ARGS, "--parallel",
                          "ddp", "--out", str(tmp_path / "two")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
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

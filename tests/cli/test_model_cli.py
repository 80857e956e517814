"""``treadle model train-tiny / eval``: the quick model has its own slot, bad values are one-line errors
naming the flag (exit 2), the valid boundary values run, another model's slot is never replaced silently."""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app


pytestmark = pytest.mark.usefixtures("cli_env")  # tests/conftest.py


def _refused(argv, *words):
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("argv,flag", [
    (["model", "train-tiny", "--steps", "-5"], "--steps"), (["model", "train-tiny", "--steps", "0"], "--steps"),
    (["model", "train-tiny", "--threads", "-1"], "--threads"), (["model", "eval", "--per-level", "-3"], "--per-level"),
    (["model", "eval", "--per-level", "0"], "--per-level"), (["model", "train-tiny", "--out", "/proc/treadle-x"], "--out"),
])
def test_bad_values_are_one_line_errors_before_any_work(tmp_path, argv, flag):
    _refused(argv, flag)
    assert not (tmp_path / "cache").exists()


def test_quick_never_writes_the_default_slot_and_other_settings_are_refused(tmp_path):
    r = CliRunner().invoke(app, ["model", "train-tiny", "--quick", "--steps", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    cache = tmp_path / "cache"
    assert (cache / "tiny-qwen3-quick" / "config.json").exists()
    assert not (cache / "tiny-qwen3").exists()
    before = (cache / "tiny-qwen3-quick" / "model.safetensors").read_bytes()
    # the same settings again: kept, not retrained
    r = CliRunner().invoke(app, ["model", "train-tiny", "--quick", "--steps", "1"])
    assert r.exit_code == 0 and "already holds this model" in r.output, r.output
    # other settings into the same slot: refused, nothing replaced
    _refused(["model", "train-tiny", "--quick", "--steps", "2"], "--out", "other settings", "steps", "--overwrite")
    assert (cache / "tiny-qwen3-quick" / "model.safetensors").read_bytes() == before
    r = CliRunner().invoke(app, ["model", "train-tiny", "--quick", "--steps", "2", "--overwrite", "--no-progress"])
    assert r.exit_code == 0, r.output
    manifest = [p for p in (cache / "tiny-qwen3-quick").iterdir() if p.suffix == ".json" and "treadle" in p.name]
    assert manifest and json.loads(manifest[0].read_text())["config"]["steps"] == 2
    # model eval at its boundary value (1 problem per level) on that checkpoint
    r = CliRunner().invoke(app, ["model", "eval", str(cache / "tiny-qwen3-quick"), "--per-level", "1"])
    assert r.exit_code == 0, r.output
    assert "held-out greedy accuracy" in r.output


def test_commands_pin_one_thread_for_the_embedded_tiny_model_only(tmp_path):
    import torch
    from rich.console import Console

    from treadle.cli_models import load_model

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        load_model(None, True, Console(file=open(tmp_path / "log", "w")), threads=None)  # the quick tiny model
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        load_model(str(tmp_path / "cache" / "tiny-qwen3-quick"), False, None, threads=None)  # a --model path
        assert torch.get_num_threads() == 2
        load_model(None, True, None, threads=0)  # 0: leave as is
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

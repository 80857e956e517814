"""SCALE Stage I step checkpoints: a run stopped after k steps and resumed, in one process or on 2 gloo
ranks (the Trainer's DDP), ends with the uninterrupted one-process run's per-step losses and LoRA weights
(data order: the global batches); the checkpoints are the HF Trainer's (written once) and checkpoints of
another config are refused before any change."""
import json

import pytest
import torch

from treadle.testing import require_module

require_module("trl")

from transformers import TrainerCallback  # noqa: E402

from treadle.models import build_tiny_model, build_tokenizer  # noqa: E402
from treadle.scale.sft import SFTConfig, sft  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
# 4 steps of a global batch of 6 (3 per rank at 2 ranks), checkpoints after steps 2 and 4; stopped after step 2
CFG = dict(steps=4, batch_size=6, probe_size=4, r=4, lora_alpha=8)
EVERY, STOP = 2, 2
TOL = dict(rtol=1e-4, atol=1e-6)


def _model():
    tok = build_tokenizer()
    return build_tiny_model("qwen3", seed=0, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **SMALL), tok


class Stopped(RuntimeError):
    pass


class StopAfter(TrainerCallback):
    """Raises :class:`Stopped` once the checkpoint of step ``STOP`` is written: an interrupted run."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == STOP:
            raise Stopped(f"stopped after step {state.global_step}")


def _run(out, parallel=None, stop=False):
    torch.set_num_threads(1)
    model, tok = _model()
    try:
        res = sft(model, tok, SFTConfig.quick(**CFG), out, parallel=parallel, checkpoint_every=EVERY,
                  callbacks=[StopAfter()] if stop else ())
    except Stopped:
        return None
    return {"losses": res.losses, "lora": {k: v.detach().clone() for k, v in _full_lora(res.model).items()}}


def _full_lora(pm):
    return {k: v.detach().cpu() for k, v in pm.state_dict().items() if "lora_" in k}


def _rank(out, parallel, stop):
    """A gloo rank (spawn_gloo sets the torchrun variables the HF Trainer / accelerate read)."""
    return _run(out, parallel, stop)


def _same(got, ref):
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert sorted(got["lora"]) == sorted(ref["lora"])
    for k, v in ref["lora"].items():
        torch.testing.assert_close(got["lora"][k], v, **TOL)
    # LoRA B starts at zero: training moved it, so equal weights are a real check
    assert max(v.abs().max().item() for k, v in ref["lora"].items() if "lora_B" in k) > 1e-3


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref") / "run")


def test_one_process_resume_equals_uninterrupted(tmp_path, uninterrupted):
    out = tmp_path / "run"
    assert _run(out, stop=True) is None
    assert sorted(p.name for p in (out / "trainer").glob("checkpoint-*")) == ["checkpoint-2"]
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1]
    _same(_run(out), uninterrupted)
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == STOP


def test_checkpoints_of_another_config_are_refused_before_any_change(tmp_path, uninterrupted):
    out = tmp_path / "run"
    assert _run(out, stop=True) is None
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    model, tok = _model()
    with pytest.raises(ValueError, match=r"another config \(differs in \['lr'\]\)"):
        sft(model, tok, SFTConfig.quick(**{**CFG, "lr": 1e-3}), out, checkpoint_every=EVERY)
    assert not any("lora_" in n for n, _ in model.named_parameters())  # the model was not wrapped
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match="checkpoint_every"):
        sft(model, tok, SFTConfig.quick(**CFG), out, checkpoint_every=0)


def test_one_process_stopped_resume_on_two_ddp_ranks(tmp_path, run_ranks, uninterrupted):
    assert _run(tmp_path / "ddp", stop=True) is None
    for got in run_ranks(_rank, 2, str(tmp_path / "ddp"), "ddp", False):
        _same(got, uninterrupted)
    steps = [json.loads(x)["step"] for x in (tmp_path / "ddp" / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # the first two kept from the stopped run, written once
    assert json.loads((tmp_path / "ddp" / "summary.json").read_text())["resumed_from_step"] == STOP

"""STAIR training on 2 gloo ranks (DDP and FSDP2) equals one process on the same global batches:
losses per step and the trained normals; checkpoints written once and resumed on another world size."""
import json

import pytest
import torch

from treadle.models import build_tiny_model, build_tokenizer
from treadle.stair.training import StairTrainConfig, train

W = 2
# batch_size 3 over 2 ranks: parts of 2 and 1 sessions with different token counts, so a per-rank mean
# (without the global denominators) would give another loss and gradient
CFG = dict(layers=(1, 3), steps=3, sessions=6, batch_size=3, turns=3, responses="gold", amp=False, save_every=2,
           lr=5e-2)


# the normals are float32 parameters and the loss is computed in float32 (stair_loss), so the two runs
# differ by float32 rounding (~1e-6 after 3 Adam steps); the normals move ~1e-1 from their start, and a
# wrong denominator (per-rank means) changes the update by ~1e-2: TOL tells them apart
TOL = dict(rtol=1e-4, atol=2e-5)


def test_the_tolerance_can_fail(single):
    start = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    assert (single["normals"] - start).abs().max() > 5e-2


def _model():
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", seed=0, vocab_size=len(tok), pad_token_id=tok.pad_token_id).double()
    return model, tok


def _worker(parallel, run_dir, cfg, resume):
    model, tok = _model()
    r = train(model, tok, StairTrainConfig(**cfg), run_dir, parallel=parallel, resume=resume, progress=False,
              backend="cpp")
    w = model.model.layers[0].self_attn.q_proj.weight  # FSDP2 leaves the frozen weights sharded in place
    shard = (type(w).__name__, tuple(w.to_local().shape) if hasattr(w, "to_local") else tuple(w.shape), tuple(w.shape))
    return {"normals": r["normals"], "first": r["first_loss"], "last": r["last_loss"], "start": r["start_step"],
            "q_proj": shard}


def _losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "log.jsonl").read_text().splitlines() if '"step"' in x]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("single")
    model, tok = _model()
    r = train(model, tok, StairTrainConfig(**CFG), d, resume=False, progress=False, backend="cpp")
    from safetensors.torch import load_file

    return {"dir": d, "normals": load_file(str(d / "normals.safetensors"))["normals"], "first": r["first_loss"],
            "last": r["last_loss"]}


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_match_one_process(parallel, single, run_ranks, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    d = tmp_path / "run"
    res = run_ranks(_worker, W, parallel, d, CFG, False)
    for r in res:  # every rank ends with the same full normals, equal to the single process's
        torch.testing.assert_close(r["normals"]["normals"], single["normals"], **TOL)
    torch.testing.assert_close(torch.tensor(_losses(d)), torch.tensor(_losses(single["dir"])), rtol=1e-6, atol=1e-6)
    # written once, by rank 0, in the single-process format: the normals file loads as a single-process one
    from safetensors.torch import load_file

    torch.testing.assert_close(load_file(str(d / "normals.safetensors"))["normals"], single["normals"], **TOL)
    assert json.loads((d / "config.json").read_text())["world_size"] == W
    kind, local, full = res[0]["q_proj"]
    if parallel == "fsdp2":  # frozen backbone weights: a Shard(0) DTensor, half the rows on each rank
        assert kind == "DTensor" and local[0] * W == full[0] and local[1:] == full[1:]
    else:
        assert kind == "Parameter" and local == full
    assert len(_losses(d)) == CFG["steps"]  # one log line per step (not one per rank)


def test_resume_on_another_world_size(single, run_ranks, tmp_path, monkeypatch):
    """2 FSDP2 ranks train 2 steps (checkpoint at step 2), then ONE process resumes to step 3: the result
    equals the uninterrupted single-process run."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    d = tmp_path / "run"
    run_ranks(_worker, W, "fsdp2", d, {**CFG, "steps": 2}, False)
    model, tok = _model()
    r = train(model, tok, StairTrainConfig(**CFG), d, resume=True, progress=False, backend="cpp")
    assert r["start_step"] == 2
    from safetensors.torch import load_file

    torch.testing.assert_close(load_file(str(d / "normals.safetensors"))["normals"], single["normals"], **TOL)
    torch.testing.assert_close(torch.tensor(_losses(d)), torch.tensor(_losses(single["dir"])), rtol=1e-6, atol=1e-6)

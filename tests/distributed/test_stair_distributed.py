"""STAIR on ``transformers.Trainer`` with 2 gloo ranks (the Trainer's DDP) equals one process on the same
global batches: losses per step and the trained normals; a Trainer checkpoint written by 2 ranks resumes
in one process and continues the uninterrupted run."""
import json

import pytest
import torch

from treadle.models import build_tiny_model, build_tokenizer
from treadle.stair.training import StairTrainConfig, train

W = 2
# batch_size 3 over 2 ranks: parts of 2 and 1 sessions with different token counts, so a per-rank mean
# (without the global denominators) would give another loss and gradient; grad_accum 2: the Trainer's
# accumulation over two micro-batches per step
CFG = dict(layers=(1, 3), steps=3, sessions=6, batch_size=3, grad_accum=2, turns=3, responses="gold", amp=False,
           save_every=2, lr=5e-2)


# the normals are float32 parameters and the loss is computed in float32 (stair_loss), so the two runs
# differ by float32 rounding (~1e-6 after 3 Adam steps); the normals move ~1e-1 from their start, and a
# wrong denominator (per-rank means) changes the update by ~1e-2: TOL tells them apart
TOL = dict(rtol=1e-4, atol=2e-5)


def _model():
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", seed=0, vocab_size=len(tok), pad_token_id=tok.pad_token_id).double()
    return model, tok


def _worker(run_dir, cfg):
    model, tok = _model()
    r = train(model, tok, StairTrainConfig(**cfg), run_dir, parallel="ddp", resume=False, progress=False,
              backend="cpp")
    return {"normals": r["normals"], "world": r["world_size"]}


def _losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "log.jsonl").read_text().splitlines() if '"step"' in x]


def test_two_ranks_match_one_process_and_resume_in_one(run_ranks, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.set_num_threads(1)
    one = tmp_path / "one"
    model, tok = _model()
    start = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    single = train(model, tok, StairTrainConfig(**CFG), one, resume=False, progress=False, backend="cpp")
    assert (single["normals"]["normals"] - start).abs().max() > 5e-2  # the tolerance can fail

    two = tmp_path / "two"
    res = run_ranks(_worker, W, two, CFG)
    for r in res:  # every rank ends with the normals of the single process
        assert r["world"] == W
        torch.testing.assert_close(r["normals"]["normals"], single["normals"]["normals"], **TOL)
    torch.testing.assert_close(torch.tensor(_losses(two)), torch.tensor(_losses(one)), rtol=1e-6, atol=1e-6)
    # written once, by the main process: one log line per step, one normals file
    assert len(_losses(two)) == CFG["steps"]
    torch.testing.assert_close(load_file(str(two / "normals.safetensors"))["normals"],
                               single["normals"]["normals"], **TOL)
    assert json.loads((two / "config.json").read_text())["world_size"] == W

    # the 2-rank run's checkpoint of step 2 resumed by ONE process for step 3 continues the uninterrupted run
    part = tmp_path / "part"
    part.mkdir()
    import shutil

    shutil.copytree(two / "checkpoint-2", part / "checkpoint-2")
    shutil.copy(two / "config.json", part / "config.json")
    model, tok = _model()
    r = train(model, tok, StairTrainConfig(**CFG), part, resume=True, progress=False, backend="cpp")
    assert r["start_step"] == 2
    torch.testing.assert_close(r["normals"]["normals"], single["normals"]["normals"], **TOL)
    assert _losses(part) == pytest.approx(_losses(one)[2:], rel=1e-6)

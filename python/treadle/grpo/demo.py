"""``treadle demo`` section "grpo-op": the advantage op on a realistic batch, every backend here."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.table import Table

import treadle
from treadle.ops import grpo_advantages


def realistic_batch(num_prompts: int = 512, max_group: int = 16, seed: int = 0):
    """Ragged groups (1..max_group samples), shuffled ids, 0/1 rewards with a few partial credits,
    some rejected rows and some flagged turns: ``(rewards, group_ids, valid, flags)``."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_group + 1, (num_prompts,), generator=gen)
    ids = torch.repeat_interleave(torch.randint(0, 2**62, (num_prompts,), generator=gen), sizes)
    perm = torch.randperm(ids.numel(), generator=gen)
    ids = ids[perm]
    p = torch.rand(ids.numel(), generator=gen)
    rewards = (p < 0.4).float() + 0.5 * (p > 0.9).float()
    valid = torch.rand(ids.numel(), generator=gen) > 0.02
    flags = torch.rand(ids.numel(), generator=gen) < 0.05
    return rewards, ids, valid, flags


def advantage_table(run_dir: Path, quick: bool, console) -> None:
    rewards, ids, valid, flags = realistic_batch(64 if quick else 4096)
    ref = grpo_advantages(rewards.double(), ids, valid=valid, flags=flags, backend="reference")
    t = Table(title=f"grpo_advantages on {rewards.numel()} rows, {ids.unique().numel()} ragged groups (shuffled ids)")
    for col in ("backend", "time (ms)", "max |A - reference|", "mean A", "zeros"):
        t.add_column(col)
    rows = []
    available = [b for b in ("reference", "cpp", "triton") if _can(b)]
    for b in available:
        grpo_advantages(rewards, ids, valid=valid, flags=flags, backend=b)  # warm-up
        t0 = time.perf_counter()
        a = grpo_advantages(rewards, ids, valid=valid, flags=flags, backend=b)
        ms = (time.perf_counter() - t0) * 1e3
        err = (a.double() - ref).abs().max().item()
        rows.append({"backend": b, "ms": ms, "max_err": err})
        t.add_row(b, f"{ms:.3f}", f"{err:.2e}", f"{a.mean().item():+.4f}", str(int((a == 0).sum())))
    console.print(t)
    console.print("backends chosen by default:", {k: v["cpu"]["backend"] for k, v in treadle.backends().items()})
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "advantages.json").write_text(json.dumps(rows, indent=1))


def _can(backend: str) -> bool:
    from treadle import dispatch

    try:
        dispatch.choose("grpo_advantages", "cpu", backend)
        return True
    except dispatch.BackendUnavailableError:
        return False

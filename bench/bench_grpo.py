"""GRPO advantages: treadle's C++ op vs verl (loop and vectorised estimators), TRL's
view-by-position computation and a plain PyTorch scatter version, in one run.

    treadle bench --ops grpo            (or: pytest bench/bench_grpo.py --benchmark-enable)

Cases: N = 4,096 / 65,536 / 1,048,576 rows; groups of 8, of 16, and ragged 1..32; ids shuffled.
verl's per-sample loop is measured up to N = 65,536 (at 1M it takes minutes). TRL's path needs
contiguous equal-size groups, so it runs on the same rewards in TRL's layout and not on ragged cases.
Bandwidth: bytes the op must touch (rewards 4 B + ids 8 B + output 4 B per row) / time, as a fraction
of ``torch.clone`` bandwidth on the same buffers.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.ops import grpo_advantages
from treadle.reference.grpo import grpo_advantages_scatter

SIZES = [4096, 65536, 1048576]
LAYOUTS = ["g8", "g16", "ragged1-32"]


def make_batch(n: int, layout: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if layout == "ragged1-32":
        sizes = torch.randint(1, 33, (n,), generator=gen)
        sizes = sizes[: int((sizes.cumsum(0) <= n).sum())]
        sizes = torch.cat([sizes, torch.tensor([n - int(sizes.sum())])]) if int(sizes.sum()) < n else sizes
    else:
        g = int(layout[1:])
        sizes = torch.full((n // g,), g)
    ids_sorted = torch.repeat_interleave(torch.randperm(sizes.numel(), generator=gen) * 7919 + 11, sizes)
    rewards_sorted = (torch.rand(n, generator=gen) < 0.4).float() + torch.rand(n, generator=gen) * 0.1
    perm = torch.randperm(n, generator=gen)
    return rewards_sorted[perm].contiguous(), ids_sorted[perm].contiguous(), rewards_sorted, sizes


def _verl():
    try:
        from verl.trainer.ppo import core_algos

        return core_algos
    except Exception:  # noqa: BLE001
        return None


CORE = _verl()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("impl", ["treadle_cpp", "torch_scatter", "verl_vectorized", "verl_loop", "trl_view"])
def test_grpo_advantages(benchmark, peer_table, impl, n, layout):
    rewards, ids, rewards_contig, sizes = make_batch(n, layout)
    case = f"N={n} {layout}"
    extra = {}
    if impl == "treadle_cpp":
        fn = lambda: grpo_advantages(rewards, ids, backend="cpp")  # noqa: E731
    elif impl == "torch_scatter":
        fn = lambda: grpo_advantages_scatter(rewards, ids)  # noqa: E731
    elif impl.startswith("verl"):
        if CORE is None:
            pytest.skip("verl not importable")
        if impl == "verl_loop" and n > 65536:
            pytest.skip("verl's per-sample loop takes minutes at 1M rows")
        if impl == "verl_vectorized" and n > 65536:
            pytest.skip("verl's vectorized estimator needs more than 24 GB at 1M rows (killed by the OOM killer here)")
        index = np.array([str(i) for i in ids.tolist()], dtype=object)
        est = CORE.get_adv_estimator_fn("grpo" if impl == "verl_loop" else "grpo_vectorized")
        tlr, mask = rewards.unsqueeze(1), torch.ones(n, 1)
        fn = lambda: est(token_level_rewards=tlr.clone(), response_mask=mask, index=index)  # noqa: E731
    else:  # TRL: groups are contiguous views, so only fixed sizes, and only in TRL's own layout
        if layout.startswith("ragged"):
            pytest.skip("TRL's view-by-position path needs equal contiguous groups")
        from trl.trainer.utils import nanstd

        g = int(layout[1:])

        def fn():
            mean = torch.nanmean(rewards_contig.view(-1, g), dim=1).repeat_interleave(g)
            std = nanstd(rewards_contig.view(-1, g), dim=1).repeat_interleave(g)
            return (rewards_contig - mean) / (std + 1e-4)
    rounds = 1 if impl == "verl_loop" else None
    if rounds:
        benchmark.pedantic(fn, rounds=2, iterations=1, warmup_rounds=0)
    else:
        benchmark(fn)
    if impl in ("treadle_cpp", "torch_scatter") and getattr(benchmark, "stats", None) is not None:
        # process CPU time (all threads) next to the wall time: on a shared machine it shows the work
        # done, where wall time also shows waiting for a core
        extra["cpu_ms"] = round(_cpu_median(fn) * 1e3, 3)
    if impl == "treadle_cpp" and getattr(benchmark, "stats", None) is not None:
        t = benchmark.stats.stats.median
        buf = torch.empty(n * 16, dtype=torch.uint8)
        import time

        best = min(_timed(lambda: buf.clone(), time) for _ in range(20))
        clone_bw = 2 * buf.numel() / best  # read + write
        op_bw = 16 * n / t
        extra.update({"GB/s": round(op_bw / 1e9, 2), "of_clone_bw": round(op_bw / clone_bw, 3)})
    peer_table.record(case, impl, benchmark, **extra)


def _cpu_median(fn, reps: int = 30) -> float:
    import statistics
    import time

    fn()
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return statistics.median(out)


def _timed(fn, time):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["g16", "ragged1-32"])
@pytest.mark.parametrize("n", [65536, 1048576])
@pytest.mark.parametrize("impl", ["treadle_cuda", "treadle_triton", "torch_scatter"])
def test_grpo_advantages_cuda(benchmark, peer_table, impl, n, layout):
    rewards, ids, _, _ = make_batch(n, layout)
    rewards, ids = rewards.cuda(), ids.cuda()
    if impl == "torch_scatter":
        op = lambda: grpo_advantages_scatter(rewards, ids)  # noqa: E731
    else:
        b = impl.removeprefix("treadle_")
        op = lambda: grpo_advantages(rewards, ids, backend=b)  # noqa: E731

    def fn():
        op()
        torch.cuda.synchronize()

    fn()
    benchmark(fn)
    peer_table.record(f"cuda N={n} {layout}", impl, benchmark)

"""GRPO advantages: treadle's C++ op vs verl (loop and vectorised estimators), TRL's
view-by-position computation and a plain PyTorch scatter version, in one run.

    treadle bench --ops grpo            (or: pytest bench/bench_grpo.py --benchmark-enable)

Cases: N = 4,096 / 65,536 / 1,048,576 rows; groups of 8, of 16, and ragged 1..32, in two layouts:
* contiguous (``g8``, ``g16``, ``ragged1-32``): every group's rows together, ids numbered 0, 1, 2... in
  order of first appearance: what TRL (``num_generations`` consecutive completions a prompt) and verl
  (``repeat(interleave=True)``, uids mapped by ``treadle.grpo.group_ids_from_uids``) hand the op;
* shuffled (``*-shuffled``): the same rows in random order (atomic-turn groups, mixed batches).
Every implementation runs on the same tensors of a case. TRL's view-by-position path needs contiguous
equal-size groups, so it runs on ``g8`` and ``g16`` only. verl's per-sample loop is measured up to
N = 65,536 (at 1M it takes minutes), its vectorised estimator too (at 1M it needs > 24 GB).
``treadle_cpp_general`` is the same C++ op with the grouped-contiguous fast path off
(``TREADLE_GRPO_CONTIGUOUS=0``), on contiguous cases only: what the fast path saves.
Bandwidth: bytes the op must touch (rewards 4 B + ids 8 B + output 4 B per row) / time, as a fraction
of ``torch.clone`` bandwidth on the same buffers; ``limit_ms`` is that streaming time, the
memory-bound limit of the op.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from treadle.ops import grpo_advantages
from treadle.reference.grpo import grpo_advantages_scatter

SIZES = [4096, 65536, 1048576]
LAYOUTS = ["g8", "g16", "ragged1-32", "g16-shuffled", "ragged1-32-shuffled"]


def make_batch(n: int, layout: str, seed: int = 0):
    """``(rewards, ids)`` of one case: float32 rewards (40% near 1, else near 0), int64 ids."""
    gen = torch.Generator().manual_seed(seed)
    kind = layout.removesuffix("-shuffled")
    if kind == "ragged1-32":
        sizes = torch.randint(1, 33, (n,), generator=gen)
        sizes = sizes[: int((sizes.cumsum(0) <= n).sum())]
        sizes = torch.cat([sizes, torch.tensor([n - int(sizes.sum())])]) if int(sizes.sum()) < n else sizes
    else:
        sizes = torch.full((n // int(kind[1:]),), int(kind[1:]))
    ids = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    rewards = (torch.rand(n, generator=gen) < 0.4).float() + torch.rand(n, generator=gen) * 0.1
    if layout.endswith("-shuffled"):
        perm = torch.randperm(n, generator=gen)
        rewards, ids = rewards[perm].contiguous(), ids[perm].contiguous()
    return rewards, ids


def trl_view(rewards: torch.Tensor, g: int) -> torch.Tensor:
    """TRL's GRPOTrainer advantage computation (groups = consecutive ``g`` rows; eps 1e-4)."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
    std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
    return (rewards - mean) / (std + 1e-4)


_CORE: list = []


def _verl():
    """verl's core_algos, or None (imported on first use: it takes seconds, and the guard never needs it)."""
    if not _CORE:
        try:
            from verl.trainer.ppo import core_algos

            _CORE.append(core_algos)
        except Exception:  # noqa: BLE001
            _CORE.append(None)
    return _CORE[0]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("impl", ["treadle_cpp", "treadle_cpp_general", "torch_scatter", "verl_vectorized",
                                  "verl_loop", "trl_view"])
def test_grpo_advantages(benchmark, peer_table, impl, n, layout, monkeypatch):
    rewards, ids = make_batch(n, layout)
    case = f"N={n} {layout}"
    extra = {}
    if impl == "treadle_cpp":
        fn = lambda: grpo_advantages(rewards, ids, backend="cpp")  # noqa: E731
    elif impl == "treadle_cpp_general":
        if layout.endswith("-shuffled"):
            pytest.skip("the fast path only applies to contiguous groups")
        monkeypatch.setenv("TREADLE_GRPO_CONTIGUOUS", "0")
        fn = lambda: grpo_advantages(rewards, ids, backend="cpp")  # noqa: E731
    elif impl == "torch_scatter":
        fn = lambda: grpo_advantages_scatter(rewards, ids)  # noqa: E731
    elif impl.startswith("verl"):
        CORE = _verl()
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
    else:  # TRL: groups are contiguous views, so only fixed sizes in TRL's own layout
        if layout.startswith("ragged") or layout.endswith("-shuffled"):
            pytest.skip("TRL's view-by-position path needs equal contiguous groups")
        g = int(layout[1:])
        fn = lambda: trl_view(rewards, g)  # noqa: E731
    if impl == "verl_loop":
        benchmark.pedantic(fn, rounds=2, iterations=1, warmup_rounds=0)
    else:
        benchmark(fn)
    if impl.startswith("treadle_cpp") or impl == "torch_scatter":
        if getattr(benchmark, "stats", None) is not None:
            # process CPU time (all threads) next to the wall time: on a shared machine it shows the
            # work done, where wall time also shows waiting for a core
            extra["cpu_ms"] = round(_cpu_median(fn) * 1e3, 3)
    if impl == "treadle_cpp" and getattr(benchmark, "stats", None) is not None:
        t = benchmark.stats.stats.median
        buf = torch.empty(n * 16, dtype=torch.uint8)
        import time

        best = min(_timed(lambda: buf.clone(), time) for _ in range(20))
        clone_bw = 2 * buf.numel() / best  # read + write
        op_bw = 16 * n / t
        extra.update({"GB/s": round(op_bw / 1e9, 2), "of_clone_bw": round(op_bw / clone_bw, 3),
                      "limit_ms": round(16 * n / clone_bw * 1e3, 4)})
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
@pytest.mark.parametrize("layout", ["g16", "ragged1-32-shuffled"])
@pytest.mark.parametrize("n", [65536, 1048576])
@pytest.mark.parametrize("impl", ["treadle_cuda", "treadle_triton", "torch_scatter"])
def test_grpo_advantages_cuda(benchmark, peer_table, impl, n, layout):
    rewards, ids = make_batch(n, layout)
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

"""STAIR reflected bank read-out: treadle's fused op vs two attention calls and vs the naive reference.
One run, side by side, forward and forward+backward (gradients for q and the normals).

    pytest bench/bench_stair.py --benchmark-enable                       (CPU)
    TREADLE_BENCH_DEVICE=cuda pytest bench/bench_stair.py -k cuda --benchmark-enable   (GPU)

Cases: CPU fp32 ``B=1, Hq=16, Hkv=4, D=128, T=1024, M=8192``; GPU bf16 ``B=1, Hq=32, Hkv=8,
D=128, T=4096`` with ``M=32768`` (the paper's 32K bank) and ``M=2048``. Implementations:

* ``treadle_stair`` (eps = 0) and ``treadle_stair_eps0.1``: :func:`treadle.ops.stair_readout`, mode
  "diff" (C++ kernel on CPU, Triton on CUDA).
* ``two_sdpa``: what one writes without treadle at eps = 0: reflect q, then
  ``sdpa(q_R, k, v) - sdpa(q, k, v)`` (GQA via ``enable_gqa``); fwd+bwd is autograd through both.
* ``two_flash_attn``: the same with flash-attn's ``flash_attn_func`` (CUDA, where it installs).
* ``naive_reference``: :func:`treadle.reference.stair.stair_readout_reference` (materialises T x M).
  On CPU it runs at T = 256 and 512 and is extrapolated linearly to T = 1024 (time and memory are
  linear in T; at T = 1024 it needs several GB per T x M buffer on a shared 24 GB machine); on CUDA
  it runs at M = 2048 only.

On CUDA the Triton kernels run at configs pinned per (dtype, head dims, eps) from the sm_90a compile
check (``python bench/stair_aot.py``), never autotuned; each case records the configs it launched.

On CPU, ``test_stair_interleaved_ratio`` also runs treadle_stair and two_sdpa alternately in one process
and reports the per-round ratio (median and minimum, wall and CPU time): the figure that survives load.

Reported per case: time (CPU: the minimum of the rounds, since the 2-core machine is shared and load
spikes only ever add time; CUDA: the median), ratios (peer / treadle, > 1 = treadle faster), on CUDA the achieved
TFLOP/s (FLOPs: forward 6 T M D at eps = 0, 8 T M D at eps > 0, 8 T M D for two attention calls;
backward 6 T M D for treadle, 20 T M D for two attention backward passes) and, on CPU, peak extra
memory (RSS above the inputs, each variant in a fresh process). Targets: CPU forward at eps = 0
<= 0.85x the two-SDPA time, fwd+bwd >= 1.6x faster than autograd through two SDPA calls, peak extra
memory <= 1/20 of the naive reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

from treadle.ops import stair_readout
from treadle.reference.stair import stair_readout_reference

DEVICE = os.environ.get("TREADLE_BENCH_DEVICE", "cpu")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
if DEVICE == "cuda":
    SHAPES = [dict(B=1, Hq=32, Hkv=8, D=128, T=4096, M=32768), dict(B=1, Hq=32, Hkv=8, D=128, T=4096, M=2048)]
else:
    SHAPES = [dict(B=1, Hq=16, Hkv=4, D=128, T=1024, M=8192)]
IMPLS = ["treadle_stair", "treadle_stair_eps0.1", "two_sdpa", "two_flash_attn", "naive_reference"]
DEV_MARK = [pytest.mark.cuda] if DEVICE == "cuda" else []
H200_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM dense bf16 peak
_MEDIANS: dict[str, dict[str, float]] = {}
# treadle's backend for stair_readout (None: as dispatched; bench/guard.py pins "cpp", so that an inherited
# TRITON_INTERPRET=1, which makes the dispatcher pick the Triton interpreter on CPU, is never timed)
OPS_BACKEND: str | None = None


def _inputs(shape, backward: bool, T: int | None = None, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    B, Hq, Hkv, D, M = shape["B"], shape["Hq"], shape["Hkv"], shape["D"], shape["M"]
    T = T or shape["T"]
    mk = lambda *s: torch.randn(*s, generator=g, device=DEVICE, dtype=DTYPE)  # noqa: E731
    q = mk(B, Hq, T, D).requires_grad_(backward)
    k, v = mk(B, Hkv, M, D), mk(B, Hkv, M, D)
    n = torch.randn(Hq, D, generator=g, device=DEVICE, dtype=torch.float32).requires_grad_(backward)
    dout = mk(B, Hq, T, D)
    return q, k, v, n, dout


def _reflect(q, n):
    u = (n / n.norm(dim=-1, keepdim=True)).to(q.dtype)[None, :, None, :]
    return q - 2 * u * (q * u).sum(-1, keepdim=True)


def _fn(impl: str, q, k, v, n):
    """A zero-argument forward for ``impl`` (None when the implementation is unavailable)."""
    if impl == "treadle_stair":
        return lambda: stair_readout(q, k, v, n, backend=OPS_BACKEND)
    if impl == "treadle_stair_eps0.1":
        return lambda: stair_readout(q, k, v, n, eps=0.1, backend=OPS_BACKEND)
    if impl == "two_sdpa":
        return lambda: (F.scaled_dot_product_attention(_reflect(q, n), k, v, enable_gqa=True)
                        - F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    if impl == "two_flash_attn":
        if DEVICE != "cuda":
            return None
        try:
            from flash_attn import flash_attn_func
        except Exception:  # noqa: BLE001 - not installed / no wheel for this torch
            return None

        def fa():  # flash-attn takes (B, T, H, D)
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            return (flash_attn_func(_reflect(q, n).transpose(1, 2), kt, vt) - flash_attn_func(qt, kt, vt)).transpose(1, 2)
        return fa
    if impl == "naive_reference":
        return lambda: stair_readout_reference(q, k, v, n)
    raise KeyError(impl)


def _runner(impl, shape, backward, T=None):
    q, k, v, n, dout = _inputs(shape, backward, T)
    fwd = _fn(impl, q, k, v, n)
    if fwd is None:
        return None
    if not backward:
        def run():
            with torch.no_grad():
                fwd()
    else:
        def run():
            fwd().backward(dout)
            q.grad = n.grad = None
    return run


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _flops(impl: str, shape, mode: str, T: int) -> float:
    tmd = shape["B"] * shape["Hq"] * T * shape["M"] * shape["D"]
    if impl.startswith("treadle"):
        f = 8 if impl.endswith("eps0.1") else 6
        return tmd * (f + (6 if mode == "fwd+bwd" else 0))
    return tmd * (8 + (20 if mode == "fwd+bwd" else 0))


def _key(shape, mode):
    return (f"{DEVICE} {str(DTYPE).removeprefix('torch.')} B={shape['B']} Hq={shape['Hq']} Hkv={shape['Hkv']} "
            f"D={shape['D']} T={shape['T']} M={shape['M']} {mode}")


CASES = [(i, mode) for i in range(len(SHAPES)) for mode in ("fwd", "fwd+bwd")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [pytest.param(c, marks=DEV_MARK) for c in CASES],
                         ids=[f"{DEVICE}-M{SHAPES[i]['M']}-{m}" for i, m in CASES])
def test_stair_readout(benchmark, peer_table, impl, case):
    i, mode = case
    shape = SHAPES[i]
    backward = mode == "fwd+bwd"
    key = _key(shape, mode)
    extrapolate = impl == "naive_reference" and DEVICE == "cpu"
    if impl == "naive_reference" and DEVICE == "cuda" and shape["M"] > 4096:
        pytest.skip("the naive reference needs ~8 x T x M x Hq elements; run at M = 2048 only")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    T_run = [shape["T"] // 4, shape["T"] // 2] if extrapolate else [shape["T"]]
    meds = []
    for idx, T in enumerate(T_run):
        run = _runner(impl, shape, backward, T)
        if run is None:
            pytest.skip(f"{impl} is not available here")

        def timed():
            run()
            _sync()

        if idx < len(T_run) - 1:  # the smaller T of the extrapolation: timed by hand
            if getattr(benchmark, "disabled", False):
                return
            timed()
            ts = []
            for _ in range(2):
                t0 = time.perf_counter()
                timed()
                ts.append(time.perf_counter() - t0)
            meds.append(min(ts))
            continue
        benchmark.pedantic(timed, rounds=2 if extrapolate else (3 if DEVICE == "cpu" else 20), warmup_rounds=1)
        stats = getattr(benchmark, "stats", None)
        if stats is None:
            return
        meds.append(stats.stats.min if DEVICE == "cpu" else stats.stats.median)
    med = meds[-1] if not extrapolate else meds[1] + (meds[1] - meds[0]) / (T_run[1] - T_run[0]) * (shape["T"] - T_run[1])
    _MEDIANS.setdefault(key, {})[impl] = med
    extra = {}
    if extrapolate:
        extra["note"] = f"extrapolated from T={T_run}"
    if DEVICE == "cuda":
        tf = _flops(impl, shape, mode, shape["T"]) / med / 1e12
        extra["TFLOPs"] = f"{tf:.0f} ({100 * tf / H200_BF16_DENSE_TFLOPS:.0f}% of {H200_BF16_DENSE_TFLOPS:.0f})"
        extra["peak_mem_GiB"] = f"{torch.cuda.max_memory_allocated() / 2 ** 30:.2f}"
        if impl.startswith("treadle"):  # the pinned Triton configs this case launched
            from treadle.triton_kernels import stair as ks
            extra["triton_configs"] = " ".join(f"{w}:{c.label}" for w, c in sorted(ks.last_configs.items()))
        torch.cuda.reset_peak_memory_stats()
    ours = _MEDIANS[key].get("treadle_stair")
    if ours is not None and impl != "treadle_stair":
        extra["vs_treadle"] = f"{med / ours:.2f}x"
    peer_table.record(key, impl, seconds=med, **extra)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU: the shared machine's load moves sequential timings")
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_stair_interleaved_ratio(benchmark, peer_table, mode, rounds: int = 5):
    """treadle_stair and two_sdpa alternately, ``rounds`` times each in one process: the ratio of each
    round's pair (two_sdpa / treadle, wall time and process CPU time), median and minimum. Load on a shared
    machine shifts both sides of a round alike, where sequential per-implementation timings (above) can
    catch a spike on one side only; this is the figure to quote for the CPU targets."""
    if getattr(benchmark, "disabled", False):
        pytest.skip("--benchmark-disable")
    shape, backward = SHAPES[0], mode == "fwd+bwd"
    runs = {impl: _runner(impl, shape, backward) for impl in ("treadle_stair", "two_sdpa")}
    for run in runs.values():  # warm-up
        run()
    wall: dict[str, list[float]] = {impl: [] for impl in runs}
    cpu: dict[str, list[float]] = {impl: [] for impl in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for impl in order:
            c0, t0 = time.process_time(), time.perf_counter()
            runs[impl]()
            wall[impl].append(time.perf_counter() - t0)
            cpu[impl].append(time.process_time() - c0)
    wr = sorted(p / t for p, t in zip(wall["two_sdpa"], wall["treadle_stair"]))
    cr = sorted(p / t for p, t in zip(cpu["two_sdpa"], cpu["treadle_stair"]))
    key = _key(shape, mode) + f" interleaved x{rounds}"
    med = rounds // 2
    peer_table.record(key, "treadle_stair", seconds=sorted(wall["treadle_stair"])[med],
                      min_s=f"{min(wall['treadle_stair']):.3f}",
                      cpu_median_s=f"{sorted(cpu['treadle_stair'])[med]:.3f}")
    peer_table.record(key, "two_sdpa", seconds=sorted(wall["two_sdpa"])[med],
                      min_s=f"{min(wall['two_sdpa']):.3f}", cpu_median_s=f"{sorted(cpu['two_sdpa'])[med]:.3f}",
                      per_round_ratio_wall=f"median {wr[med]:.2f}x min {wr[0]:.2f}x",
                      per_round_ratio_cpu=f"median {cr[med]:.2f}x min {cr[0]:.2f}x",
                      treadle_over_two_sdpa=f"{1 / wr[med]:.2f}")
    benchmark.extra_info.update(wall_ratio_median=wr[med], cpu_ratio_median=cr[med])
    benchmark.pedantic(lambda: None, rounds=1)


_MEM_SCRIPT = textwrap.dedent("""
    import json, sys, time, torch
    sys.path.insert(0, sys.argv[1])
    import bench_stair as bs
    impl, backward, T = sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
    run = bs._runner(impl, bs.SHAPES[0], backward, T)
    def status(field):  # kB fields of /proc/self/status
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))
    import gc; gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS high-water mark (VmHWM)
        f.write("5")
    before = status("VmRSS")
    t0 = time.perf_counter()
    run()
    secs = time.perf_counter() - t0
    peak = status("VmHWM")
    print(json.dumps({"extra_peak": max(peak - before, 0), "seconds": secs}))
""")


def _peak(impl: str, backward: bool, T: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, os.path.dirname(os.path.abspath(__file__)), impl,
                          "1" if backward else "0", str(T)], capture_output=True, text=True, timeout=900, check=True,
                         env={**os.environ, "TREADLE_BENCH_DEVICE": "cpu"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU peak memory (RSS); CUDA cases report max_memory_allocated")
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_stair_peak_memory(benchmark, peer_table, mode):
    if getattr(benchmark, "disabled", False):
        pytest.skip("--benchmark-disable")
    backward = mode == "fwd+bwd"
    shape = SHAPES[0]
    T = shape["T"]
    mib = 2 ** 20
    key = _key(shape, mode) + " peak extra memory"
    ours = _peak("treadle_stair", backward, T)
    sdpa = _peak("two_sdpa", backward, T)
    n1, n2 = _peak("naive_reference", backward, T // 4), _peak("naive_reference", backward, T // 2)
    naive = n2["extra_peak"] + (n2["extra_peak"] - n1["extra_peak"]) / (T // 4) * (T - T // 2)
    peer_table.record(key, "treadle_stair", seconds=ours["seconds"], peak_MiB=f"{ours['extra_peak'] / mib:.0f}")
    peer_table.record(key, "two_sdpa", seconds=sdpa["seconds"], peak_MiB=f"{sdpa['extra_peak'] / mib:.0f}")
    peer_table.record(key, "naive_reference(extrapolated)", seconds=n2["seconds"] * 2,
                      peak_MiB=f"{naive / mib:.0f}", naive_over_treadle=f"{naive / max(ours['extra_peak'], 1):.1f}x")
    benchmark.extra_info.update(treadle_MiB=ours["extra_peak"] / mib, naive_MiB=naive / mib)
    benchmark.pedantic(lambda: None, rounds=1)

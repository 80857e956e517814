"""The GPU figures of treadle's ops against their peers, side by side in one process (bench/gpu_check.sh).

Each section is independent (a failure is recorded with its traceback and the next section runs) and
writes into one JSON file; times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed
between repetitions, warm-up first). Shapes and targets:

* ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 GEMM;
* STAIR read-out at B=1, T=4096, M=32768, Hq=32, Hkv=8, D=128, bf16, eps=0 and eps=0.1, forward and
  forward+backward (grads for q and the normals), against two SDPA calls
  ``sdpa(q_reflected) - sdpa(q)`` (the identity the op computes at eps = 0): SDPA as dispatched with
  ``enable_gqa=True``, and flash-attention on K/V pre-expanded to Hq heads (expansion not timed); the
  faster peer is the one compared. Targets: forward >= 1.25x at eps = 0, backward >= 2x;
* SCALE gated LoRA, d_in = d_out = 4096, r = 16, 16,384 tokens, bf16: time added over the base GEMM
  (target <= 5%), forward and forward+backward, with the PEFT-style PyTorch composition beside it, and
  the fused op's own Triton GEMM with the LoRA off against cuBLAS (what the design stands on);
* GRPO advantages at N = 16M rows (groups of 16, contiguous and shuffled ids), float32 rewards:
  treadle's CUDA and Triton kernels vs verl's vectorized estimator (its ``group_mean_std`` and
  ``as_torch_index``, loaded from the verl sources when importable or carried; target >= 5x) and a
  torch scatter version; the fraction of the measured copy bandwidth reached (target >= 50%), and
  one CUDA-graph replay of the Triton kernels;
* top-k entropy from hidden states at vocab 151,936 (d = 4096, 4,096 tokens, bf16, k = 100): time and
  peak memory vs materialising the full logits (target <= 1.1x the time at >= 8x less memory).

    python bench/gpu_figures.py OUT.json [--quick]
    GPU_FIGURES_SECTIONS="ceilings grpo" python bench/gpu_figures.py OUT.json     (a subset)
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

RESULTS: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
QUICK = "--quick" in sys.argv
# GPU_FIGURES_DEVICE=cpu: a smoke run of this script's plumbing on tiny shapes (no timings of value)
DEV = os.environ.get("GPU_FIGURES_DEVICE", "cuda")
SMOKE = DEV != "cuda"
if SMOKE:
    QUICK = True


def bench(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench: CUDA events, L2 cleared between calls)."""
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25 if not QUICK else 5, rep=rep_ms if not QUICK else 40,
                          return_mode="median"))


def peak_mib(fn) -> float:
    if SMOKE:
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def section(name):
    def wrap(f):
        def run():
            t0 = time.time()
            print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
            try:
                RESULTS[name] = f()
            except Exception as exc:  # recorded, the next section still runs
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
                print(traceback.format_exc()[-3000:], flush=True)
            RESULTS[name + "_wall_s"] = round(time.time() - t0, 1)
            print(json.dumps({name: RESULTS[name]}, indent=1, default=str)[:3000], flush=True)
            if not SMOKE:
                torch.cuda.empty_cache()
        run.section = name
        return run
    return wrap


@section("ceilings")
def ceilings():
    n = 2 ** 30 if not SMOKE else 2 ** 20  # 1 GiB
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    s = 8192 if not SMOKE else 256
    x = torch.randn(s, s, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(s, s, device=DEV, dtype=torch.bfloat16)
    gms = bench(lambda: x @ y)
    return {"copy_GBps": 2 * n / ms / 1e6, "bf16_gemm_TFLOPs": 2 * s ** 3 / gms / 1e9,
            "device": torch.cuda.get_device_name(0) if not SMOKE else DEV}


def _stair_inputs(B, Hq, Hkv, T, M, D, dtype, grad):
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, Hq, T, D, device=DEV, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, M, D, device=DEV, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, M, D, device=DEV, dtype=dtype, generator=g)
    n = torch.randn(Hq, D, device=DEV, dtype=torch.float32, generator=g)
    if grad:
        q.requires_grad_()
        n.requires_grad_()
    return q, k, v, n


def _reflect(q, n):
    u = n / n.norm(dim=-1, keepdim=True)
    u = u.to(q.dtype)[None, :, None, :]
    return q - 2 * u * (q * u).sum(-1, keepdim=True)


@section("stair")
def stair():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from treadle.ops import stair_readout

    B, Hq, Hkv, D = 1, 32, 8, 128
    T, M = (4096, 32768) if not QUICK else (1024, 4096)
    if SMOKE:
        Hq, Hkv, T, M = 4, 2, 16, 64
    out = {"shape": dict(B=B, Hq=Hq, Hkv=Hkv, T=T, M=M, D=D, dtype="bf16")}
    flops_fwd = 4 * B * Hq * T * M * D  # one attention pass (QK^T and PV)
    for eps in (0.0, 0.1):
        row = {}
        for grad in (False, True):
            q, k, v, n = _stair_inputs(B, Hq, Hkv, T, M, D, torch.bfloat16, grad)
            kx, vx = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
            dout = torch.randn(B, Hq, T, D, device=DEV, dtype=torch.bfloat16)
            mode = "fwd+bwd" if grad else "fwd"

            def ours():
                o = stair_readout(q, k, v, n, eps=eps)
                if grad:
                    o.backward(dout)

            def sdpa_gqa():
                o = F.scaled_dot_product_attention(_reflect(q, n), k, v, enable_gqa=True) - \
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                if grad:
                    o.backward(dout)

            def sdpa_flash():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    o = F.scaled_dot_product_attention(_reflect(q, n), kx, vx) - \
                        F.scaled_dot_product_attention(q, kx, vx)
                if grad:
                    o.backward(dout)

            ctx = torch.enable_grad() if grad else torch.no_grad()
            with ctx:
                t_ours = bench(ours)
                r = {"treadle_ms": t_ours, "treadle_peak_MiB": peak_mib(ours)}
                for name, fn in (("sdpa_gqa", sdpa_gqa), ("sdpa_flash_expanded", sdpa_flash)):
                    try:
                        r[f"{name}_ms"] = bench(fn)
                        r[f"{name}_peak_MiB"] = peak_mib(fn)
                    except Exception as exc:
                        r[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if not grad:  # agreement at the benchmark shape (at eps = 0 both sides compute the same thing)
                with torch.no_grad():
                    a = stair_readout(q, k, v, n, eps=eps).float()
                    p_ = (F.scaled_dot_product_attention(_reflect(q, n), k, v, enable_gqa=True).float()
                          - F.scaled_dot_product_attention(q, k, v, enable_gqa=True).float())
                    r["max_abs_diff_vs_sdpa"] = float((a - p_).abs().max())
                    r["max_abs_out"] = float(a.abs().max())
            peers = [r[k_] for k_ in ("sdpa_gqa_ms", "sdpa_flash_expanded_ms") if k_ in r]
            if peers:
                r["best_peer_ms"] = min(peers)
                r["speedup_vs_best_peer"] = min(peers) / t_ours
            if not grad:
                r["treadle_TFLOPs_two_passes"] = 2 * flops_fwd / t_ours / 1e9
            row[mode] = r
            q.grad = n.grad = None
        fwd, both = row.get("fwd", {}), row.get("fwd+bwd", {})
        if "best_peer_ms" in fwd and "best_peer_ms" in both:
            ob = both["treadle_ms"] - fwd["treadle_ms"]
            pb = both["best_peer_ms"] - fwd["best_peer_ms"]
            row["bwd_only"] = {"treadle_ms": ob, "best_peer_ms": pb, "speedup": pb / ob if ob > 0 else None}
        if eps == 0:
            row["note"] = "at eps = 0 the peers compute the same quantity; at eps > 0 they are a timing yardstick only"
        out[f"eps={eps}"] = row
    from treadle.triton_kernels import stair as ks

    out["autotune"] = {w: str(getattr(ks._tuned.get(w), "best_config", None)) for w in ("fwd", "bwd")} \
        if hasattr(ks, "_tuned") else None
    return out


@section("scale")
def scale():
    from treadle.ops import gated_lora_linear

    d, r, ntok = (4096, 16, (16384 if not QUICK else 2048)) if not SMOKE else (64, 16, 32)
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(ntok, d, device=DEV, dtype=dt, generator=g)
    W = torch.randn(d, d, device=DEV, dtype=dt, generator=g) / 64
    A = torch.randn(r, d, device=DEV, dtype=dt, generator=g) / 64
    Bm = torch.randn(d, r, device=DEV, dtype=dt, generator=g) / 4
    w = 0.01 * torch.randn(d, device=DEV, generator=g)
    b = torch.zeros(1, device=DEV)
    dy = torch.randn(ntok, d, device=DEV, dtype=dt, generator=g)
    kw = dict(scaling=2.0, L=-0.5, U=2.0, tau=1.0)
    out = {"shape": dict(d_in=d, d_out=d, r=r, tokens=ntok, dtype="bf16")}
    for grad in (False, True):
        xx = x.clone().requires_grad_(grad)
        ww, bb = w.clone().requires_grad_(grad), b.clone().requires_grad_(grad)

        def base():
            y = F.linear(xx, W)
            if grad:
                y.backward(dy)

        def ours():
            y = gated_lora_linear(xx, W, None, A, Bm, ww, bb, **kw)
            if grad:
                y.backward(dy)

        def peft_style():
            yb = F.linear(xx, W)
            v = torch.tanh((xx.detach().float() @ ww + bb) / kw["tau"])
            lam = 1 + (1 - kw["L"]) * v.clamp(max=0) + (kw["U"] - 1) * v.clamp(min=0)
            y = yb + lam.to(dt)[:, None] * (F.linear(F.linear(xx, A), Bm) * kw["scaling"])
            if grad:
                y.backward(dy)

        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            t = {name: bench(fn) for name, fn in (("base_gemm", base), ("treadle", ours), ("peft_style", peft_style))}
            if not grad and not SMOKE:  # the Triton GEMM the fused op stands on, LoRA off, vs cuBLAS
                from treadle.ops.gated_lora import triton_base_linear

                t["triton_gemm_lora_off"] = bench(lambda: triton_base_linear(xx, W))
        t = {f"{k}_ms": v for k, v in t.items()}
        if "triton_gemm_lora_off_ms" in t:
            t["triton_gemm_over_cublas"] = t["triton_gemm_lora_off_ms"] / t["base_gemm_ms"] - 1
            t["treadle_added_over_triton_gemm"] = t["treadle_ms"] / t["triton_gemm_lora_off_ms"] - 1
        t["treadle_added_over_base"] = t["treadle_ms"] / t["base_gemm_ms"] - 1
        t["peft_style_added_over_base"] = t["peft_style_ms"] / t["base_gemm_ms"] - 1
        out["fwd+bwd" if grad else "fwd"] = t
    return out


def _verl_groupwise():
    """verl's groupwise helpers (``as_torch_index``, ``group_mean_std``): from an importable verl, or
    from verl's own ``verl/utils/groupwise.py`` carried beside this run (verl's package ``__init__``
    imports Ray, which the GPU machine lacks; this one module needs only numpy and torch)."""
    try:
        from verl.utils import groupwise  # noqa: F401

        return groupwise, "verl (imported)"
    except Exception:
        pass
    import glob
    import importlib.util
    import types

    paths = glob.glob(os.environ.get("VERL_SRC", "/tmp/site") + "/verl/utils/groupwise.py")
    if not paths:
        return None, "verl not available"
    for name in ("verl", "verl.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    dev = types.ModuleType("verl.utils.device")
    dev.get_device_name = lambda: DEV
    sys.modules["verl.utils.device"] = dev
    spec = importlib.util.spec_from_file_location("verl.utils.groupwise", paths[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, f"verl/utils/groupwise.py from {paths[0]}"


@section("grpo")
def grpo():
    from treadle.ops import grpo_advantages

    N = (16 * 2 ** 20 if not QUICK else 2 ** 20) if not SMOKE else 4096
    G = 16
    gen = torch.Generator(device=DEV).manual_seed(0)
    rewards = torch.rand(N, device=DEV, generator=gen)
    contiguous = torch.arange(N, device=DEV) // G
    shuffled = contiguous[torch.randperm(N, device=DEV, generator=gen)]
    gw, where = _verl_groupwise()
    out = {"N": N, "group_size": G, "rewards": "float32", "ids": "int64", "verl": where}
    bw = RESULTS.get("ceilings", {}).get("copy_GBps")
    bytes_min = N * (4 + 8 + 4)  # read rewards and ids, write advantages
    for layout, ids in (("contiguous", contiguous), ("shuffled", shuffled)):
        row = {}
        ids_np = ids.cpu().numpy()
        for be in (("cuda", "triton") if not SMOKE else ("cpp",)):
            try:
                a = grpo_advantages(rewards, ids, backend=be)
                row[f"treadle_{be}_ms"] = bench(lambda: grpo_advantages(rewards, ids, backend=be))
            except Exception as exc:
                row[f"treadle_{be}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if gw is not None:
            def verl():
                g = gw.as_torch_index(ids_np, device=rewards.device)
                mean_g, std_g, _ = gw.group_mean_std(rewards, g, eps=0.0, device=rewards.device)
                return (rewards - mean_g[g]) / (std_g[g] + 1e-6)

            def verl_given_index():
                mean_g, std_g, _ = gw.group_mean_std(rewards, ids, eps=0.0, device=rewards.device)
                return (rewards - mean_g[ids]) / (std_g[ids] + 1e-6)

            try:
                row["verl_vectorized_ms"] = bench(verl, rep_ms=400)
                row["verl_vectorized_from_tensor_ids_ms"] = bench(verl_given_index)
                ref = verl_given_index()
                row["max_abs_diff_vs_verl"] = float((grpo_advantages(rewards, ids) - ref).abs().max())
            except Exception as exc:
                row["verl_error"] = f"{type(exc).__name__}: {exc}"[:300]

        def scatter():
            n = torch.zeros(int(ids.max()) + 1, device=DEV).index_add_(0, ids, torch.ones_like(rewards))
            s = torch.zeros_like(n).index_add_(0, ids, rewards)
            mean = s / n
            var = torch.zeros_like(n).index_add_(0, ids, (rewards - mean[ids]) ** 2) / (n - 1)
            return (rewards - mean[ids]) / (var.sqrt()[ids] + 1e-6)

        row["torch_scatter_ms"] = bench(scatter)
        if not SMOKE:  # the Triton kernels take their route on the device: one CUDA graph replays them
            try:
                expect = grpo_advantages(rewards, ids, backend="triton")
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    got = grpo_advantages(rewards, ids, backend="triton")
                g.replay()
                torch.cuda.synchronize()
                row["triton_cuda_graph_max_abs_diff"] = float((got - expect).abs().max())
            except Exception as exc:
                row["triton_cuda_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        # where treadle's CUDA op spends its time (the glue in csrc/cuda/grpo_advantages_cuda.cpp)
        def dense():
            keys, perm = torch.sort(ids)
            starts = torch.ones_like(keys)
            starts[1:] = keys[1:] != keys[:-1]
            seg = torch.cumsum(starts, 0) - 1
            return torch.empty_like(seg).index_put_((perm,), seg)
        row["profile_sort_ids_ms"] = bench(lambda: torch.sort(ids))
        row["profile_dense_group_index_ms"] = bench(dense)
        row["profile_zero_work_buffers_ms"] = bench(lambda: torch.zeros(4 * N + 8, dtype=torch.float64, device=DEV))
        best = min(v for k, v in row.items() if k.startswith("treadle_") and k.endswith("_ms"))
        row["treadle_best_ms"] = best
        row["treadle_GBps_min_bytes"] = bytes_min / best / 1e6
        if bw:
            row["fraction_of_copy_bandwidth"] = bytes_min / best / 1e6 / bw
        for peer in ("verl_vectorized_ms", "verl_vectorized_from_tensor_ids_ms", "torch_scatter_ms"):
            if peer in row:
                row[f"speedup_vs_{peer[:-3]}"] = row[peer] / best
        out[layout] = row
    return out


@section("topk_entropy")
def topk():
    from treadle.ops import topk_entropy, topk_entropy_from_hidden

    V, d, ntok = (151936, 4096, (4096 if not QUICK else 512)) if not SMOKE else (1000, 32, 16)
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(ntok, d, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    W = (torch.randn(V, d, device=DEV, dtype=torch.bfloat16, generator=g) / 64).requires_grad_(False)

    def ours():
        topk_entropy_from_hidden(h, W, k=100).backward()

    def full():
        topk_entropy(h @ W.t(), k=100).backward()

    out = {"shape": dict(V=V, d=d, tokens=ntok, k=100, dtype="bf16")}
    out["from_hidden_ms"] = bench(ours)
    out["from_hidden_peak_MiB"] = peak_mib(ours)
    out["full_logits_ms"] = bench(full)
    out["full_logits_peak_MiB"] = peak_mib(full)
    out["memory_ratio_full_over_ours"] = out["full_logits_peak_MiB"] / max(out["from_hidden_peak_MiB"], 1e-9)
    out["time_ratio_ours_over_full"] = out["from_hidden_ms"] / out["full_logits_ms"]
    return out


def main():
    path = next((a for a in sys.argv[1:] if not a.startswith("--")), "gpu_figures.json")
    torch.backends.cuda.matmul.allow_tf32 = True
    RESULTS["torch"] = torch.__version__
    import triton

    RESULTS["triton"] = triton.__version__
    only = os.environ.get("GPU_FIGURES_SECTIONS", "").split()  # e.g. "ceilings grpo": a subset
    for f in (ceilings, grpo, scale, topk, stair):
        if only and f.section not in only:
            continue
        f()
        with open(path, "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

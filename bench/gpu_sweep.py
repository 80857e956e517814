"""Time each op at the launch configs that the sm_90a AOT check passes, on the device, in one process.

``bench/gpu_figures.py`` times every op at its pinned config; this script times the alternatives the
AOT check also compiles clean (0 spills, no serialised wgmma), so that one short GPU window shows which
config to pin: STAIR forward (eps 0 and eps 0.1) and backward at the bench shape, the SCALE fused GEMM
(LoRA on and off) and its ``programs`` count against ``F.linear``, GRPO's block sizes and its time
under CUDA-graph replay, and top-k entropy's chunk size.
Each row is written to the JSON file as soon as it is measured, so a run cut short keeps what it got.

    python bench/gpu_sweep.py OUT.json              (on the GPU; bench/gpu_check.sh runs it last)
    GPU_FIGURES_DEVICE=cpu python bench/gpu_sweep.py OUT.json     (plumbing only, tiny shapes)
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_figures import DEV, SMOKE, _reflect, _stair_inputs, bench  # noqa: E402

OUT: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__}
PATH = next((a for a in sys.argv[1:] if not a.startswith("--")), "gpu_sweep.json")
BUDGET_S = float(os.environ.get("GPU_SWEEP_BUDGET_S", "150"))
START = time.time()


def save() -> None:
    with open(PATH, "w") as fh:
        json.dump(OUT, fh, indent=1, default=str)


def measure(section: str, label: str, fn, check=None) -> None:
    """Time ``fn`` into ``OUT[section][label]`` (ms, or the error), unless the time budget is spent;
    ``check()`` adds what it returns (e.g. the max |diff| against a peer) to the row."""
    rows = OUT.setdefault(section, {})
    if time.time() - START > BUDGET_S:
        rows[label] = "skipped (time budget)"
        return
    t0 = time.time()
    try:
        rows[label] = {"ms": bench(fn), "wall_s": round(time.time() - t0, 1)}
        if check is not None:
            rows[label].update(check())
    except Exception as exc:  # a config that fails is a result
        rows[label] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    print(f"[{time.strftime('%H:%M:%S')}] {section} {label}: {rows[label]}", flush=True)
    save()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def stair() -> None:
    """Forward and backward configs, each with its max |diff| against the peers it must agree with
    (at eps = 0 two SDPA calls and their gradients; at eps > 0 the fused three-state loop)."""
    from treadle.ops import stair_readout
    from treadle.triton_kernels import stair as ks

    C = ks.Config
    fwd0, fwd1, bwd0 = ("fwd", "tma", False, False), ("fwd", "tma", False, True), ("bwd", "tma", False, None)
    pinned = {k_: ks._CONFIGS[k_] for k_ in (fwd0, fwd1, bwd0)}
    t_pinned = ks._T_CONFIG
    B, Hq, Hkv, D, T, M = 1, 32, 8, 128, 4096, 32768
    if SMOKE:
        Hq, Hkv, T, M = 4, 2, 16, 64
    q, k, v, n = _stair_inputs(B, Hq, Hkv, T, M, D, torch.bfloat16, False)
    with torch.no_grad():
        def two_sdpa():
            return (F.scaled_dot_product_attention(_reflect(q, n), k, v, enable_gqa=True)
                    - F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        ref = two_sdpa().float()
        sec = "stair_fwd_eps0"
        measure(sec, "peer_sdpa_gqa", two_sdpa, lambda: {"max_abs_out": float(ref.abs().max())})
        # the pinned config, the warp-specialised one (wrong rows on the first H200 run) and clean others
        for cfg in (pinned[fwd0], C(128, 64, 4, 2, True, True), C(128, 64, 8, 2, True), C(64, 32, 4, 3, True)):
            ks._CONFIGS[fwd0] = cfg
            measure(sec, cfg.label, lambda: stair_readout(q, k, v, n, eps=0.0),
                    lambda: {"max_abs_diff_vs_sdpa": _diff(stair_readout(q, k, v, n, eps=0.0), ref)})
        ks._CONFIGS[fwd0] = pinned[fwd0]
        sec = "stair_fwd_eps0.1"
        measure(sec, "peer_sdpa_gqa", two_sdpa)
        ks._CONFIGS[fwd1] = C(64, 32, 8, 3, True)  # the fused three-state loop: the eps > 0 yardstick
        ref1 = stair_readout(q, k, v, n, eps=0.1).float()
        cands = [(pinned[fwd1], t_pinned), (pinned[fwd1], C(128, 32, 8, 2, True)),
                 (pinned[fwd1], C(128, 128, 8, 2, True)), (C(128, 64, 8, 2, True, t_pre=True), t_pinned),
                 (C(64, 32, 8, 3, True), None), (C(64, 32, 4, 3, True), None)]
        for cfg, tcfg in cands:
            ks._CONFIGS[fwd1] = cfg
            ks._T_CONFIG = tcfg or t_pinned
            label = cfg.label + (f" + t {tcfg.label}" if cfg.t_pre else "")
            measure(sec, label, lambda: stair_readout(q, k, v, n, eps=0.1),
                    lambda: {"max_abs_diff_vs_fused": _diff(stair_readout(q, k, v, n, eps=0.1), ref1)})
        ks._CONFIGS[fwd1], ks._T_CONFIG = pinned[fwd1], t_pinned
    q, k, v, n = _stair_inputs(B, Hq, Hkv, T, M, D, torch.bfloat16, True)
    dout = torch.randn(B, Hq, T, D, device=DEV, dtype=torch.bfloat16)
    sec = "stair_fwd+bwd_eps0"
    with torch.no_grad():  # the forward alone, at the pinned config: subtract it to get the backward
        measure(sec, "fwd_only_pinned", lambda: stair_readout(q, k, v, n, eps=0.0))

    def sdpa_both():
        o = (F.scaled_dot_product_attention(_reflect(q, n), k, v, enable_gqa=True)
             - F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        o.backward(dout)
    q.grad = n.grad = None
    sdpa_both()
    gq, gn = q.grad.float().clone(), n.grad.float().clone()
    measure(sec, "peer_sdpa_gqa", sdpa_both, lambda: {"max_abs_dq": float(gq.abs().max()),
                                                     "max_abs_dn": float(gn.abs().max())})

    def grads_diff():
        q.grad = n.grad = None
        stair_readout(q, k, v, n, eps=0.0).backward(dout)
        return {"max_abs_diff_dq_vs_sdpa": _diff(q.grad, gq), "max_abs_diff_dn_vs_sdpa": _diff(n.grad, gn)}
    for cfg in (pinned[bwd0], C(128, 16, 8, 3, True)):
        ks._CONFIGS[bwd0] = cfg
        measure(sec, cfg.label, lambda: stair_readout(q, k, v, n, eps=0.0).backward(dout), grads_diff)
    ks._CONFIGS[bwd0] = pinned[bwd0]


def scale() -> None:
    from treadle.triton_kernels import scale_fused as sf

    d, r, ntok = (4096, 16, 16384) if not SMOKE else (64, 16, 32)
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(ntok, d, device=DEV, dtype=dt, generator=g)
    W = torch.randn(d, d, device=DEV, dtype=dt, generator=g) / 64
    A = torch.randn(r, d, device=DEV, dtype=dt, generator=g) / 64
    Bm = torch.randn(d, r, device=DEV, dtype=dt, generator=g) / 4
    w = 0.01 * torch.randn(d, device=DEV, generator=g)
    b = torch.zeros(1, device=DEV)
    measure("scale_fwd", "cublas_F.linear", lambda: F.linear(x, W))
    cfgs = (sf.FWD_CONFIG,) + tuple(sf.ALT_CONFIGS) if not SMOKE else (sf.INTERP_CONFIG,)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if not SMOKE else 2
    for cfg in cfgs:
        measure("scale_fwd", f"triton_gemm_lora_off {cfg.label}", lambda: sf.base_linear(x, W, config=cfg))
        measure("scale_fwd", f"fused_lora_on {cfg.label}",
                lambda: sf.linear_fwd(x, W, None, A, Bm, w, b, 2.0, -0.5, 2.0, 1.0, config=cfg))
    y, z, v_ = sf.linear_fwd(x, W, None, A, Bm, w, b, 2.0, -0.5, 2.0, 1.0)
    dy = torch.randn_like(y)
    for cfg in ((sf.DX_CONFIG, dataclasses.replace(sf.DX_CONFIG, NT=8)) if not SMOKE else (sf.INTERP_CONFIG,)):
        measure("scale_dx", f"fused_dx {cfg.label}",
                lambda: sf.linear_dx(dy, x, W, A, Bm, z, v_, 2.0, -0.5, 2.0, 1.0, True, config=cfg))
        measure("scale_dx", f"triton_gemm_lora_off {cfg.label}", lambda: sf.base_dx(dy, W, config=cfg))
    measure("scale_dx", "cublas_dy_W", lambda: dy @ W)
    for progs in (sms, 2 * sms, None):  # None: the op's default grid
        measure("scale_fwd", f"fused_lora_on programs={progs}",
                lambda: sf.linear_fwd(x, W, None, A, Bm, w, b, 2.0, -0.5, 2.0, 1.0, programs=progs))


def grpo() -> None:
    """Where the Triton route's time goes: the public op, one CUDA-graph replay of it (no CPU launch
    cost), and the sorted route's rows per program (CHUNK) and the general route's BLOCK."""
    from treadle.ops import grpo_advantages
    from treadle.triton_kernels import grpo as kg

    N, G = (16 * 2 ** 20, 16) if not SMOKE else (4096, 16)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rewards = torch.rand(N, device=DEV, generator=gen)
    contiguous = torch.arange(N, device=DEV) // G
    shuffled = contiguous[torch.randperm(N, device=DEV, generator=gen)]
    chunk0, block0 = kg.CHUNK, kg.BLOCK
    for layout, ids in (("contiguous", contiguous), ("shuffled", shuffled)):
        sec = f"grpo_{layout}"
        measure(sec, "op", lambda: grpo_advantages(rewards, ids, backend="triton"))
        if not SMOKE:
            grpo_advantages(rewards, ids, backend="triton")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                grpo_advantages(rewards, ids, backend="triton")
            measure(sec, "op_cuda_graph_replay", graph.replay)
            del graph
        measure(sec, "torch_copy_same_bytes", lambda: rewards.clone())
        for chunk in ((256, 1024, 2048) if layout == "contiguous" else ()):
            kg.CHUNK = chunk
            measure(sec, f"op CHUNK={chunk}", lambda: grpo_advantages(rewards, ids, backend="triton"))
        kg.CHUNK = chunk0
        for block in ((512, 2048, 4096) if layout == "shuffled" else ()):
            kg.BLOCK = block
            measure(sec, f"op BLOCK={block}", lambda: grpo_advantages(rewards, ids, backend="triton"))
        kg.BLOCK = block0


def topk() -> None:
    from treadle.ops import topk_entropy_from_hidden

    V, d, ntok = (151936, 4096, 4096) if not SMOKE else (1000, 32, 16)
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(ntok, d, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    W = torch.randn(V, d, device=DEV, dtype=torch.bfloat16, generator=g) / 64
    for chunk in ((None, 1024, 2048, 4096) if not SMOKE else (None, 8)):
        measure("topk_from_hidden", f"chunk={chunk}",
                lambda: topk_entropy_from_hidden(h, W, k=100, chunk_size=chunk).backward())


def main() -> None:
    os.environ.setdefault("TREADLE_TRITON_AUTOTUNE", "0")
    torch.backends.cuda.matmul.allow_tf32 = True
    only = os.environ.get("GPU_SWEEP_SECTIONS", "").split()
    for f in (stair, grpo, scale, topk):
        if only and f.__name__ not in only:
            continue
        try:
            f()
        except Exception as exc:  # recorded; the next section still runs
            OUT[f.__name__ + "_error"] = f"{type(exc).__name__}: {exc}"[:600]
            print(OUT[f.__name__ + "_error"], flush=True)
        save()
    print(f"wrote {PATH} in {time.time() - START:.0f} s")


if __name__ == "__main__":
    main()

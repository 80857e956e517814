"""Triton kernels of SCALE's gated LoRA (spec: treadle/reference/scale.py; maths and backward
derivation: treadle/ops/gated_lora.py).

Forward, one program per block of ``BLOCK_M`` tokens:
  shrink   ``u = x A^T`` and ``x . w`` in one sweep over ``d_in`` (each x tile is loaded once and
           feeds both the rank-r ``tl.dot`` and the gate's row sum), fp32 accumulators;
  epilogue ``v = tanh((x . w + b) / tau)``, ``lambda``, ``s = scaling * lambda`` in registers;
  expand   sweep over ``d_out``: ``y = base_out + (s * u) B^T``, one read of base_out, one write of y.
Backward, one program per block of tokens: ``p = dy B`` in one sweep over ``d_out``, then the per
token ``dg`` and ``q = s * p`` in registers, then ``dx = q A`` in one sweep over ``d_in``. ``dw = x^T
dg`` and ``db = sum dg`` are left to one GEMV in the launcher (a deterministic reduction over tokens).

The rank dimension is padded to a power of two >= 16 (``tl.dot``'s minimum) with masked loads, so
any ``r``, ``d_in`` and ``d_out`` work. fp32 inputs use IEEE fp32 dots (no TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treadle.triton_kernels.common import _mm


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1; exact 0 at x = 0 (so zero gates give lambda == 1 exactly)
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _gated_lora_fwd_kernel(
    x_ptr, base_ptr, a_ptr, b_ptr, w_ptr, bias_ptr, y_ptr, z_ptr, v_ptr,
    scaling, L, U, inv_tau,
    N, D_IN, D_OUT, R,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rr = tl.arange(0, BLOCK_R)
    rrmask = rr < R
    acc_u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, D_IN, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < D_IN
        xt = tl.load(x_ptr + rows[:, None] * D_IN + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        at = tl.load(a_ptr + rr[None, :] * D_IN + kk[:, None], mask=rrmask[None, :] & kmask[:, None], other=0.0)
        acc_u += _mm(xt, at, IEEE, UPCAST)
        wt = tl.load(w_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        acc_g += tl.sum(xt.to(tl.float32) * wt[None, :], axis=1)
    bias = tl.load(bias_ptr).to(tl.float32)
    v = _tanh((acc_g + bias) * inv_tau)
    lam = 1.0 + (1.0 - L) * tl.minimum(v, 0.0) + (U - 1.0) * tl.maximum(v, 0.0)
    s = scaling * lam
    tl.store(v_ptr + rows, v, mask=rmask)
    zrow = z_ptr + rows[:, None] * (R + 1)
    tl.store(zrow + rr[None, :], acc_u.to(z_ptr.dtype.element_ty), mask=rmask[:, None] & rrmask[None, :])
    tl.store(z_ptr + rows * (R + 1) + R, acc_g.to(z_ptr.dtype.element_ty), mask=rmask)
    su = acc_u * s[:, None]
    if not UPCAST:
        su = su.to(b_ptr.dtype.element_ty)
    for n0 in range(0, D_OUT, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        nmask = nn < D_OUT
        bt = tl.load(b_ptr + nn[None, :] * R + rr[:, None], mask=rrmask[:, None] & nmask[None, :], other=0.0)
        omask = rmask[:, None] & nmask[None, :]
        base = tl.load(base_ptr + rows[:, None] * D_OUT + nn[None, :], mask=omask, other=0.0)
        delta = _mm(su, bt, IEEE, UPCAST)
        tl.store(y_ptr + rows[:, None] * D_OUT + nn[None, :], (base.to(tl.float32) + delta).to(y_ptr.dtype.element_ty),
                 mask=omask)


@triton.jit
def _gated_lora_bwd_kernel(
    dy_ptr, a_ptr, b_ptr, z_ptr, v_ptr, dx_ptr, dg_ptr,
    scaling, L, U, inv_tau,
    N, D_IN, D_OUT, R,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, NEED_DX: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rr = tl.arange(0, BLOCK_R)
    rrmask = rr < R
    p = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for n0 in range(0, D_OUT, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        nmask = nn < D_OUT
        dyt = tl.load(dy_ptr + rows[:, None] * D_OUT + nn[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        bt = tl.load(b_ptr + nn[:, None] * R + rr[None, :], mask=nmask[:, None] & rrmask[None, :], other=0.0)
        p += _mm(dyt, bt, IEEE, UPCAST)
    u = tl.load(z_ptr + rows[:, None] * (R + 1) + rr[None, :], mask=rmask[:, None] & rrmask[None, :],
                other=0.0).to(tl.float32)
    ds = tl.sum(p * u, axis=1)
    v = tl.load(v_ptr + rows, mask=rmask, other=0.0)
    lam = 1.0 + (1.0 - L) * tl.minimum(v, 0.0) + (U - 1.0) * tl.maximum(v, 0.0)
    slope = tl.where(v < 0.0, 1.0 - L, tl.where(v > 0.0, U - 1.0, 0.5 * (U - L)))
    dg = scaling * ds * slope * (1.0 - v * v) * inv_tau
    tl.store(dg_ptr + rows, dg, mask=rmask)
    if NEED_DX:
        q = p * (scaling * lam)[:, None]
        if not UPCAST:
            q = q.to(a_ptr.dtype.element_ty)
        for k0 in range(0, D_IN, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            kmask = kk < D_IN
            at = tl.load(a_ptr + rr[:, None] * D_IN + kk[None, :], mask=rrmask[:, None] & kmask[None, :], other=0.0)
            dxt = _mm(q, at, IEEE, UPCAST)
            tl.store(dx_ptr + rows[:, None] * D_IN + kk[None, :], dxt.to(dx_ptr.dtype.element_ty),
                     mask=rmask[:, None] & kmask[None, :])


def _blocks(r: int) -> tuple[int, int, int, int]:
    block_r = max(16, triton.next_power_of_2(r))
    return 32, 64, 64, block_r


def _buffer_dtype(x: torch.Tensor) -> torch.dtype:
    # The CPU interpreter converts fp32 -> bf16/fp16 by truncation (the GPU rounds to nearest), so on
    # CPU the kernels write fp32 buffers and torch rounds them to the output dtype afterwards.
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return x.dtype


def gated_lora_fwd_triton(x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau):
    """Forward on contiguous ``x (..., d_in)``, ``base_out (..., d_out)``: ``(y, z (N, r + 1), v (N,) fp32)``."""
    d_in = x.shape[-1]
    n = x.numel() // d_in
    d_out, r = lora_B.shape
    buf = _buffer_dtype(x)
    y = torch.empty(base_out.shape, dtype=buf, device=x.device)
    z = torch.empty((n, r + 1), dtype=buf, device=x.device)
    v = torch.empty((n,), dtype=torch.float32, device=x.device)
    bm, bk, bn, br = _blocks(r)
    grid = (triton.cdiv(n, bm),)
    _gated_lora_fwd_kernel[grid](
        x, base_out, lora_A, lora_B, gate_weight, gate_bias, y, z, v,
        float(scaling), float(L), float(U), float(1.0 / tau),
        n, d_in, d_out, r,
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, IEEE=x.dtype == torch.float32,
        UPCAST=x.device.type == "cpu",
    )
    return y.to(x.dtype), z.to(x.dtype), v


def gated_lora_bwd_triton(grad_y, x, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate):
    """Backward: ``(dx (x's shape), dw (d_in,) fp32, db (1,) fp32)``."""
    d_in = x.shape[-1]
    n = x.numel() // d_in
    d_out, r = lora_B.shape
    dx = torch.empty(x.shape, dtype=_buffer_dtype(x), device=x.device) if need_dx else torch.zeros_like(x)
    dg = torch.empty((n,), dtype=torch.float32, device=x.device)
    bm, bk, bn, br = _blocks(r)
    grid = (triton.cdiv(n, bm),)
    _gated_lora_bwd_kernel[grid](
        grad_y, lora_A, lora_B, z, v, dx, dg,
        float(scaling), float(L), float(U), float(1.0 / tau),
        n, d_in, d_out, r,
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, IEEE=x.dtype == torch.float32,
        UPCAST=x.device.type == "cpu", NEED_DX=bool(need_dx),
    )
    dx = dx.to(x.dtype)
    if need_dgate:
        from treadle.triton_kernels.scale_fused import dw_from_dg

        dw, db = dw_from_dg(x.reshape(n, d_in), dg)  # one streaming pass over x, no fp32 copy of it
    else:
        dw, db = x.new_zeros(d_in, dtype=torch.float32), x.new_zeros(1, dtype=torch.float32)
    return dx, dw, db


# ---------------------------------------------------------------- sm_90a structure check
def aot_specs():
    """Every config the gated-LoRA op launches on a GPU, as the JIT would specialise it at the
    benchmark shape (d_in = d_out = 4096, r = 16, 16,384 tokens, bf16; the fused GEMMs' shape
    arguments are not specialised, so one compile serves every shape): the fused GEMMs of
    :mod:`treadle.triton_kernels.scale_fused` (forward with and without the LoRA and the bias,
    backward dx), their operand packing and ``dw`` kernels, and the unfused kernels above (the path
    for ``gated_lora`` on a given ``base_out`` and for shapes TMA cannot take)."""
    from treadle.triton_kernels.aot import AotSpec
    from treadle.triton_kernels import scale_fused as sf
    from treadle.triton_kernels import scale_gemm as sg

    specs = []
    fp, i32 = "fp32", "i32"

    def desc(shape, dt="bf16"):
        return f"tensordesc<{dt}[{shape[0]}, {shape[1]}]>"

    fwd_cases = [(sf.FWD_CONFIG, lora, bias, "bf16", 16) for lora, bias in ((True, False), (True, True), (False, False))]
    fwd_cases += [(sf.FWD_CONFIG, True, False, "fp16", 16)]
    fwd_cases += [(sf.FWD_CONFIG, True, True, "bf16", r) for r in sf.RANK_CHECKS]
    fwd_cases += [(alt, lora, False, "bf16", 16) for alt in sf.ALT_CONFIGS for lora in (True, False)]
    for cfg, lora, bias, dt, rank in fwd_cases:
        rp = sf.rank_pad(rank, gate=True)
        ysplit = cfg.BN // 2 if cfg.epi_split else cfg.BN
        sig = {"x_desc": desc((cfg.BM, cfg.BK), dt), "w_desc": desc((cfg.BN, cfg.BK), dt),
               "a_desc": desc((rp, cfg.BK) if lora else (cfg.BM, cfg.BK), dt),
               "bt_desc": desc((rp, cfg.BN) if lora else (cfg.BM, cfg.BK), dt),
               "y_desc": desc((cfg.BM, ysplit), dt), "bias_ptr": f"*{dt}" if bias else "constexpr",
               "gb_ptr": "*fp32" if lora else f"*{dt}", "z_ptr": f"*{dt}", "v_ptr": "*fp32" if lora else f"*{dt}",
               "scaling": fp, "L": fp, "U": fp, "inv_tau": fp, "gscale": fp, "M": i32, "N": i32, "K": i32,
               "R": i32, "num_progs": i32}
        const = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, RP=rp if lora else 16, NT=cfg.NT,
                     LORA=lora, HAS_BIAS=bias, EPI_SPLIT=cfg.epi_split, PERSISTENT=True, FLAT=cfg.flat,
                     IEEE=False, UPCAST=False)
        if not bias:
            const["bias_ptr"] = None
        sig.update({k: "constexpr" for k in const if k not in sig})
        label = (cfg.label + ("" if lora else "-loraoff") + ("-bias" if bias else "") + ("" if dt == "bf16" else f"-{dt}")
                 + ("" if rp == sf.rank_pad(16, gate=True) else f"-RP{rp}"))
        specs.append(AotSpec(
            kernel="scale_gemm_fwd" if lora else "scale_base_gemm", config=label,
            fn=sg.gated_lora_gemm_fwd_kernel, signature=sig, constexprs=const,
            divisible_by_16=tuple(k for k in ("bias_ptr", "gb_ptr", "z_ptr", "v_ptr") if sig[k] != "constexpr"),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            expect_wgmma=True, expect_tma=True, expect_warp_specialized=False))

    dx_cases = [(sf.DX_CONFIG, "bf16", 16), (sf.DX_CONFIG, "fp16", 16)]
    dx_cases += [(sf.DX_CONFIG, "bf16", r) for r in sf.RANK_CHECKS] + [(c, "bf16", 16) for c in sf.ALT_CONFIGS if c.flat]
    for cfg, dt, rank in dx_cases:
        specs.append(_dx_spec(cfg, dt, rank, AotSpec, sf, sg, desc))
    specs.append(_dx_spec(sf.DX_CONFIG, "bf16", 16, AotSpec, sf, sg, desc, lora=False))  # scale_fused.base_dx
    unique = {}
    for spec in specs:  # ranks that pad alike compile alike: keep one of each
        unique.setdefault((spec.kernel, spec.config), spec)
    specs = list(unique.values())

    specs.append(AotSpec(
        kernel="scale_dw", config=f"BM{sf.DW_BLOCK_M}-BD{sf.DW_BLOCK_D}", fn=sg._dw_partial_kernel,
        signature={"x_ptr": "*bf16", "dg_ptr": "*fp32", "part_ptr": "*fp32", "M": i32, "D": i32,
                   "ROWS_PER_SPLIT": i32, "BLOCK_M": "constexpr", "BLOCK_D": "constexpr"},
        constexprs=dict(BLOCK_M=sf.DW_BLOCK_M, BLOCK_D=sf.DW_BLOCK_D),
        divisible_by_16=("x_ptr", "dg_ptr", "part_ptr", "M", "D", "ROWS_PER_SPLIT")))
    # the three packing launches: A' = [A; w pieces] (row stride d_in, column stride 1: the JIT makes
    # a stride of 1 a constant), B^T from B (row stride 1, column stride r) and A alone (backward)
    for label, gate, strides in (("A-gate", True, {"s_col": 1}), ("Bt", False, {"s_row": 1}),
                                 ("A", False, {"s_col": 1})):
        sig = {"src_ptr": "*bf16", "s_row": i32, "s_col": i32, "w_ptr": "*fp32" if gate else "*bf16",
               "out_ptr": "*bf16", "R": i32, "D": i32, "gscale": fp, "GATE": "constexpr", "BLOCK_D": "constexpr"}
        sig.update({k: "constexpr" for k in strides})
        specs.append(AotSpec(
            kernel="scale_pack", config=label, fn=sg._pack_rows_kernel, signature=sig,
            constexprs=dict(strides, GATE=gate, BLOCK_D=256),
            divisible_by_16=tuple(k for k in ("src_ptr", "s_row", "s_col", "w_ptr", "out_ptr", "R", "D")
                                  if sig[k] != "constexpr")))

    bm, bk, bn, br = _blocks(16)
    common = {"scaling": fp, "L": fp, "U": fp, "inv_tau": fp, "N": i32, "D_IN": i32, "D_OUT": i32, "R": i32,
              "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_R": "constexpr",
              "IEEE": "constexpr", "UPCAST": "constexpr"}
    blocks = dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, IEEE=False, UPCAST=False)
    ptrs = ("x_ptr", "base_ptr", "a_ptr", "b_ptr", "w_ptr", "bias_ptr", "y_ptr", "z_ptr", "v_ptr")
    sig = {p: "*bf16" for p in ptrs}
    sig.update(w_ptr="*fp32", bias_ptr="*fp32", v_ptr="*fp32")
    sig.update(common)
    specs.append(AotSpec(
        kernel="scale_unfused_fwd", config=f"BM{bm}-BK{bk}-BN{bn}-BR{br}-w4-s3", fn=_gated_lora_fwd_kernel,
        signature=sig, constexprs=blocks, divisible_by_16=ptrs + ("N", "D_IN", "D_OUT", "R"),
        num_warps=4, num_stages=3, expect_wgmma=False))
    ptrs = ("dy_ptr", "a_ptr", "b_ptr", "z_ptr", "v_ptr", "dx_ptr", "dg_ptr")
    sig = {p: "*bf16" for p in ptrs}
    sig.update(v_ptr="*fp32", dg_ptr="*fp32")
    sig.update(common)
    sig["NEED_DX"] = "constexpr"
    specs.append(AotSpec(
        kernel="scale_unfused_bwd", config=f"BM{bm}-BK{bk}-BN{bn}-BR{br}-w4-s3", fn=_gated_lora_bwd_kernel,
        signature=sig, constexprs=dict(blocks, NEED_DX=True), divisible_by_16=ptrs + ("N", "D_IN", "D_OUT", "R"),
        num_warps=4, num_stages=3, expect_wgmma=False))
    return specs


def _dx_spec(cfg, dt, rank, AotSpec, sf, sg, desc, lora=True):
    """The backward dx GEMM at ``cfg`` (``dt`` inputs, rank ``rank``; ``lora=False``: the GEMM alone)."""
    fp, i32 = "fp32", "i32"
    rp = sf.rank_pad(rank, gate=False)
    sig = {"dy_desc": desc((cfg.BM, cfg.BK), dt), "w_desc": desc((cfg.BK, cfg.BN), dt),
           "bt_desc": desc((rp, cfg.BK), dt), "ap_desc": desc((rp, cfg.BN), dt),
           "dx_desc": desc((cfg.BM, cfg.BN // 2 if cfg.epi_split else cfg.BN), dt), "z_ptr": f"*{dt}", "v_ptr": "*fp32", "dg_ptr": "*fp32",
           "scaling": fp, "L": fp, "U": fp, "inv_tau": fp, "M": i32, "N": i32, "K": i32, "R": i32,
           "num_progs": i32}
    const = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, RP=rp, NT=cfg.NT, LORA=lora,
                 EPI_SPLIT=cfg.epi_split, PERSISTENT=True, FLAT=cfg.flat, IEEE=False, UPCAST=False)
    sig.update({k: "constexpr" for k in const})
    label = cfg.label + ("" if dt == "bf16" else f"-{dt}") + ("" if rp == sf.rank_pad(16, gate=False) else f"-RP{rp}")
    return AotSpec(
        kernel="scale_gemm_dx" if lora else "scale_base_gemm_dx", config=label, fn=sg.gated_lora_gemm_dx_kernel,
        signature=sig, constexprs=const,
        divisible_by_16=("z_ptr", "v_ptr", "dg_ptr"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, expect_wgmma=True, expect_tma=True)


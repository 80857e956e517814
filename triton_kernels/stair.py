"""Triton kernels of STAIR's reflected bank read-out (spec: treadle/reference/stair.py; maths and the
backward derivation: csrc/cpu/stair_readout.cpp's header and treadle/ops/stair_readout.py).

Forward, one program per (query block of ``BLOCK_M`` rows, batch x query head): one sweep over the
bank in ``BLOCK_N`` tiles. Each tile is loaded once; ``s = scale q k^T`` is one ``tl.dot``; the
reflection logit ``t = alpha beta^T`` (``alpha = u . q``; ``beta = -2 scale u . k``, one small GEMM
in the launcher, so no CUDA-core work of size BLOCK_N x D per tile) is a rank-1 correction of the same tile, so the online-softmax accumulators for ``s`` (pi_ref), ``s + t`` (pi_R)
and, when eps > 0, ``t`` (uniform part of pi_ref reweighted by e^t) are all updated from it: 3 (eps
= 0: 2) ``P V`` dots per tile. The epilogue writes the read-out, the two row vectors ``O_R`` and
``Y`` and the row statistics ``(lse_s, log Z)`` that the backward needs.

Backward, same grid: tiles are recomputed from the row statistics; ``S = q k^T`` and
``G = dO v^T`` are two dots, ``dS`` and ``dT`` elementwise, ``dq += dS k`` the third; the normal's
gradient needs the column sums ``sum_t alpha_t dT_tj`` times ``k`` (a per-program reduction) plus
``sum_t dalpha_t q_t``, written per program and summed by the launcher (deterministic, no atomics).

Head dims: any ``D``, ``Dv`` up to 256, padded to the next power of two (>= 16, ``tl.dot``'s
minimum) with masked loads. fp32 inputs use IEEE fp32 dots (no TF32). On GPUs the block sizes are
autotuned (configs chosen for Hopper); under ``TRITON_INTERPRET=1`` one small fixed config runs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from treadle.triton_kernels.common import _mm

MAX_HEAD_DIM = 256


@triton.jit(do_not_specialize=["T", "M"])  # T = 1 / M = 1 must stay runtime values (L = M below)
def _stair_fwd_kernel(
    Q, K, V, U, BETA, LEN, VBAR, OUT, ROWS, STATS,
    Hq, Hkv, T, M, D, DV, GROUP,
    scale, eps, a, b,
    HAS_LEN: tl.constexpr, USE_T: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bidx = bh // Hq
    h = bh % Hq
    kvh = h // GROUP
    if HAS_LEN:
        L = tl.load(LEN + bidx).to(tl.int32)
    else:
        L = M
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    mmask = offs_m < T
    dmask = offs_d < D
    vmask = offs_v < DV
    rows = bh * T + offs_m
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
    qf = q.to(tl.float32)
    u = tl.load(U + h * D + offs_d, mask=dmask, other=0.0)
    alpha = tl.sum(qf * u[None, :], axis=1)

    m_s = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    m_x = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    m_t = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_s = tl.zeros((BLOCK_M,), tl.float32)
    l_x = tl.zeros((BLOCK_M,), tl.float32)
    l_t = tl.zeros((BLOCK_M,), tl.float32)
    acc_s = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    acc_x = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    acc_t = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    kbase = K + (bidx * Hkv + kvh) * M * D
    vbase = V + (bidx * Hkv + kvh) * M * DV
    for j0 in range(0, L, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < L
        k = tl.load(kbase + offs_n[:, None] * D + offs_d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(vbase + offs_n[:, None] * DV + offs_v[None, :], mask=nmask[:, None] & vmask[None, :], other=0.0)
        beta = tl.load(BETA + bh * M + offs_n, mask=nmask, other=0.0)
        s = _mm(q, tl.trans(k), IEEE, UPCAST) * scale  # scaled after the dot, as S = scale (Q K^T): q is never re-rounded
        t = alpha[:, None] * beta[None, :]
        s = tl.where(nmask[None, :], s, float("-inf"))
        x = s + t
        ms_new = tl.maximum(m_s, tl.max(s, axis=1))
        mx_new = tl.maximum(m_x, tl.max(x, axis=1))
        p_s = tl.exp(s - ms_new[:, None])
        p_x = tl.exp(x - mx_new[:, None])
        c_s = tl.exp(m_s - ms_new)
        c_x = tl.exp(m_x - mx_new)
        l_s = l_s * c_s + tl.sum(p_s, axis=1)
        l_x = l_x * c_x + tl.sum(p_x, axis=1)
        acc_s = acc_s * c_s[:, None] + _mm(p_s.to(v.dtype), v, IEEE, UPCAST)
        acc_x = acc_x * c_x[:, None] + _mm(p_x.to(v.dtype), v, IEEE, UPCAST)
        m_s = ms_new
        m_x = mx_new
        if USE_T:
            tm = tl.where(nmask[None, :], t, float("-inf"))
            mt_new = tl.maximum(m_t, tl.max(tm, axis=1))
            p_t = tl.exp(tm - mt_new[:, None])
            c_t = tl.exp(m_t - mt_new)
            l_t = l_t * c_t + tl.sum(p_t, axis=1)
            acc_t = acc_t * c_t[:, None] + _mm(p_t.to(v.dtype), v, IEEE, UPCAST)
            m_t = mt_new

    has = (tl.zeros((BLOCK_M,), tl.int32) + L) > 0
    l_s = tl.where(has, l_s, 1.0)
    l_x = tl.where(has, l_x, 1.0)
    l_t = tl.where(has, l_t, 1.0)
    m_s = tl.where(has, m_s, 0.0)
    m_x = tl.where(has, m_x, 0.0)
    m_t = tl.where(has, m_t, 0.0)
    lse = m_s + tl.log(l_s)
    o_s = acc_s / l_s[:, None]
    if USE_T:
        Lf = tl.maximum(L, 1).to(tl.float32)
        l1 = tl.log(1.0 - eps) + m_x + tl.log(l_x) - lse
        l2 = tl.log(eps / Lf) + m_t + tl.log(l_t)
        mm = tl.maximum(l1, l2)
        logz = mm + tl.log(tl.exp(l1 - mm) + tl.exp(l2 - mm))
        cx = tl.exp(l1 - logz) / l_x
        ct = tl.exp(l2 - logz) / l_t
        cw = tl.exp(m_x - lse - logz)
        w = cw * l_x
        o_r = acc_x * cx[:, None] + acc_t * ct[:, None]
        vbar = tl.load(VBAR + (bidx * Hkv + kvh) * DV + offs_v, mask=vmask, other=0.0)
        o_ref = (1.0 - eps) * o_s + eps * vbar[None, :]
        big_w = acc_x * cw[:, None]
    else:
        logz = m_x + tl.log(l_x) - lse
        o_r = acc_x / l_x[:, None]
        o_ref = o_s
        big_w = o_r
        w = tl.full((BLOCK_M,), 1.0, tl.float32)
    out = a * o_r + b * o_ref
    y = b * o_s + a * (big_w - w[:, None] * o_r)
    hasf = has.to(tl.float32)
    out = out * hasf[:, None]
    o_r = o_r * hasf[:, None]
    y = y * hasf[:, None]
    omask = mmask[:, None] & vmask[None, :]
    tl.store(OUT + rows[:, None] * DV + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=omask)
    tl.store(ROWS + (rows[:, None] * 2) * DV + offs_v[None, :], o_r, mask=omask)
    tl.store(ROWS + (rows[:, None] * 2 + 1) * DV + offs_v[None, :], y, mask=omask)
    tl.store(STATS + rows * 2, lse * hasf, mask=mmask)
    tl.store(STATS + rows * 2 + 1, logz * hasf, mask=mmask)


@triton.jit(do_not_specialize=["T", "M"])  # T = 1 / M = 1 must stay runtime values (L = M below)
def _stair_bwd_kernel(
    DO, Q, K, V, U, BETA, LEN, ROWS, STATS, DQ, DU,
    Hq, Hkv, T, M, D, DV, GROUP, NQT,
    scale, eps, a, b,
    HAS_LEN: tl.constexpr, USE_R: tl.constexpr, USE_E: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bidx = bh // Hq
    h = bh % Hq
    kvh = h // GROUP
    if HAS_LEN:
        L = tl.load(LEN + bidx).to(tl.int32)
    else:
        L = M
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    mmask = offs_m < T
    dmask = offs_d < D
    vmask = offs_v < DV
    rows = bh * T + offs_m
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
    qf = q.to(tl.float32)
    u = tl.load(U + h * D + offs_d, mask=dmask, other=0.0)
    alpha = tl.sum(qf * u[None, :], axis=1)
    omask = mmask[:, None] & vmask[None, :]
    do = tl.load(DO + rows[:, None] * DV + offs_v[None, :], mask=omask, other=0.0)
    dof = do.to(tl.float32)
    o_r = tl.load(ROWS + (rows[:, None] * 2) * DV + offs_v[None, :], mask=omask, other=0.0)
    y = tl.load(ROWS + (rows[:, None] * 2 + 1) * DV + offs_v[None, :], mask=omask, other=0.0)
    g_or = tl.sum(dof * o_r, axis=1)
    g_y = tl.sum(dof * y, axis=1)
    lse = tl.load(STATS + rows * 2, mask=mmask, other=0.0)
    logz = tl.load(STATS + rows * 2 + 1, mask=mmask, other=0.0)
    ome = 1.0 - eps
    Lf = tl.maximum(L, 1).to(tl.float32)
    eps_l = eps / Lf

    dq = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    dalpha = tl.zeros((BLOCK_M,), tl.float32)
    du = tl.zeros((D_PAD,), tl.float32)
    kbase = K + (bidx * Hkv + kvh) * M * D
    vbase = V + (bidx * Hkv + kvh) * M * DV
    for j0 in range(0, L, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < L
        tmask = mmask[:, None] & nmask[None, :]
        k = tl.load(kbase + offs_n[:, None] * D + offs_d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(vbase + offs_n[:, None] * DV + offs_v[None, :], mask=nmask[:, None] & vmask[None, :], other=0.0)
        beta = tl.load(BETA + bh * M + offs_n, mask=nmask, other=0.0)
        s = _mm(q, tl.trans(k), IEEE, UPCAST) * scale  # scaled after the dot, as S = scale (Q K^T): q is never re-rounded
        g = _mm(do, tl.trans(v), IEEE, UPCAST)
        t = alpha[:, None] * beta[None, :]
        p = tl.where(tmask, tl.exp(s - lse[:, None]), 0.0)
        ds = b * p * g - p * g_y[:, None]
        if USE_R:
            pe = tl.where(tmask, tl.exp((s - lse[:, None]) + (t - logz[:, None])), 0.0)
            gr = g - g_or[:, None]
            ds += a * pe * gr
            pr = ome * pe
            if USE_E:
                pr += eps_l * tl.where(tmask, tl.exp(t - logz[:, None]), 0.0)
            dt = a * pr * gr
            dalpha += tl.sum(dt * beta[None, :], axis=1)
            colsum = tl.sum(alpha[:, None] * dt, axis=0)
            du += tl.sum(colsum[:, None] * k.to(tl.float32), axis=0) * (-2.0 * scale)
        ds = ds * (ome * scale)
        dq += _mm(ds.to(k.dtype), k, IEEE, UPCAST)
    dq += dalpha[:, None] * u[None, :]
    du += tl.sum(dalpha[:, None] * qf, axis=0)
    tl.store(DQ + rows[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
    tl.store(DU + (bh * NQT + pid_m) * D + offs_d, du, mask=dmask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_FIXED = {"BLOCK_M": 16, "BLOCK_N": 16}  # the interpreter: small and fast to emulate
_NO_TUNE = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}  # TREADLE_TRITON_AUTOTUNE=0
_MIN_BLOCK_M = 16  # smallest BLOCK_M of any config (sizes the per-program dn buffer)
_tuned: dict = {}


def _hopper_configs(bwd: bool):
    """A short list for H100/H200 (kept short: each config compiles during the first call).

    Forward: BLOCK_M 128 with 8 warps (two PV accumulators of 128 x 128 fp32 fit in registers at
    eps = 0) or 64 with 4 warps (three accumulators at eps > 0); BLOCK_N 64/128; 2-3 stages of K/V.
    Backward keeps dq (BLOCK_M x D) and the recomputed S, G tiles live, so smaller BLOCK_N.
    """
    if not bwd:
        shapes = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)]
    else:
        shapes = [(64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 8, 2), (32, 64, 4, 3)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in shapes]


def _kernel(which: str):
    """The jitted kernel (interpreter) or its autotuned wrapper (GPU), built once."""
    base = _stair_fwd_kernel if which == "fwd" else _stair_bwd_kernel
    if _interpreting():
        return base, dict(_FIXED)
    if os.environ.get("TREADLE_TRITON_AUTOTUNE", "1") == "0":
        # one safe config, no autotuning: for test runs on a GPU, where compiling every config of
        # every test shape would dominate (fits any head dim <= 256 in fp32 within Hopper's shared memory)
        return base, dict(_NO_TUNE)
    if which not in _tuned:
        keys = ["D_PAD", "DV_PAD", "USE_T"] if which == "fwd" else ["D_PAD", "DV_PAD", "USE_R", "USE_E"]
        extra = {} if which == "fwd" else {"reset_to_zero": ["DU"]}
        _tuned[which] = triton.autotune(configs=_hopper_configs(which == "bwd"), key=keys, **extra)(base)
    return _tuned[which], {}


def _pads(D: int, Dv: int) -> tuple[int, int]:
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        raise ValueError(f"the Triton stair_readout kernel supports head dims D, Dv <= {MAX_HEAD_DIM} (any size up to "
                         f"that, padded to a power of two >= 16); got D={D}, Dv={Dv}")
    return max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))


def _buffer_dtype(x: torch.Tensor) -> torch.dtype:
    # the CPU interpreter converts fp32 -> bf16/fp16 by truncation (GPUs round to nearest), so on CPU
    # the kernels write fp32 and torch rounds afterwards
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return x.dtype


def _common(q, k_bank, v_bank, normals, bank_lengths):
    B, Hq, T, D = q.shape
    Hkv, M = k_bank.shape[1], k_bank.shape[2]
    Dv = v_bank.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    nf = normals.to(acc)
    nrm = nf.norm(dim=-1, keepdim=True)
    u = (nf / nrm).contiguous()
    lens = None if bank_lengths is None else bank_lengths.to(torch.int32).contiguous()
    return B, Hq, T, D, Hkv, M, Dv, acc, u, nrm, lens


def _beta(k_bank, u, scale):
    """``beta[b, h, j] = -2 scale u_h . k_{b, h // g, j}`` as (B, Hq, M) fp32 (one small GEMM)."""
    B, Hkv, M, D = k_bank.shape
    Hq = u.shape[0]
    ug = u.float().view(Hkv, Hq // Hkv, D)
    beta = torch.einsum("bkmd,kgd->bkgm", k_bank.float(), ug).reshape(B, Hq, M)
    return (beta * (-2.0 * scale)).contiguous()


def stair_readout_fwd_triton(q, k_bank, v_bank, normals, bank_lengths, eps, scale, a, b):
    """``(out (B, Hq, T, Dv) q.dtype, rows (B, Hq, T, 2, Dv) fp32, stats (B, Hq, T, 2) fp32)``.

    float64 inputs are computed in float32 (the kernels accumulate in fp32) and returned as float64.
    """
    if q.dtype == torch.float64:
        out, rows, stats = stair_readout_fwd_triton(q.float(), k_bank.float(), v_bank.float(), normals.float(),
                                                    bank_lengths, eps, scale, a, b)
        return out.double(), rows.double(), stats.double()
    B, Hq, T, D, Hkv, M, Dv, acc, u, nrm, lens = _common(q, k_bank, v_bank, normals, bank_lengths)
    d_pad, dv_pad = _pads(D, Dv)
    q_, k_, v_ = q.contiguous(), k_bank.contiguous(), v_bank.contiguous()
    out = torch.empty((B, Hq, T, Dv), dtype=_buffer_dtype(q), device=q.device)
    rows = torch.zeros((B, Hq, T, 2, Dv), dtype=acc, device=q.device)
    stats = torch.zeros((B, Hq, T, 2), dtype=acc, device=q.device)
    if out.numel() == 0:
        return out.to(q.dtype), rows, stats
    use_t = eps > 0.0
    if use_t:  # mean of the valid bank values, per (batch, kv head)
        if lens is None:
            vbar = v_.to(acc).mean(dim=2)
        else:
            valid = torch.arange(M, device=q.device)[None, :] < lens[:, None].long()  # (B, M)
            # where, not a 0/1 product: padded slots may hold NaN/inf (0 * NaN = NaN)
            vsum = torch.where(valid[:, None, :, None], v_.to(acc), 0.0).sum(dim=2)
            vbar = vsum / lens.clamp(min=1).to(acc)[:, None, None]
        vbar = vbar.contiguous()
    else:
        vbar = rows  # unused
    kernel, fixed = _kernel("fwd")
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    kernel[grid](
        q_, k_, v_, u, _beta(k_, u, scale), lens if lens is not None else u, vbar, out, rows, stats,
        Hq, Hkv, T, M, D, Dv, Hq // Hkv,
        float(scale), float(eps), float(a), float(b),
        HAS_LEN=lens is not None, USE_T=use_t, IEEE=q.dtype == torch.float32,
        UPCAST=q.device.type == "cpu" and q.dtype != torch.float32, D_PAD=d_pad, DV_PAD=dv_pad, **fixed,
    )
    return out.to(q.dtype), rows, stats


def stair_readout_bwd_triton(dout, q, k_bank, v_bank, normals, bank_lengths, rows, stats, eps, scale, a, b):
    """``(dq (B, Hq, T, D) q.dtype, dn (Hq, D) normals.dtype)``."""
    if q.dtype == torch.float64:
        dq, dn = stair_readout_bwd_triton(dout.float(), q.float(), k_bank.float(), v_bank.float(), normals.float(),
                                          bank_lengths, rows.float(), stats.float(), eps, scale, a, b)
        return dq.double(), dn.to(normals.dtype)
    B, Hq, T, D, Hkv, M, Dv, acc, u, nrm, lens = _common(q, k_bank, v_bank, normals, bank_lengths)
    d_pad, dv_pad = _pads(D, Dv)
    dq = torch.empty((B, Hq, T, D), dtype=_buffer_dtype(q), device=q.device)
    nqt = triton.cdiv(max(T, 1), _MIN_BLOCK_M)
    du = torch.zeros((B * Hq * nqt, D), dtype=acc, device=q.device)
    if dq.numel() > 0:
        kernel, fixed = _kernel("bwd")
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * Hq)  # noqa: E731
        kernel[grid](
            dout.contiguous(), q.contiguous(), k_bank.contiguous(), v_bank.contiguous(), u, _beta(k_bank, u, scale),
            lens if lens is not None else u, rows.contiguous(), stats.contiguous(), dq, du,
            Hq, Hkv, T, M, D, Dv, Hq // Hkv, nqt,
            float(scale), float(eps), float(a), float(b),
            HAS_LEN=lens is not None, USE_R=a != 0.0, USE_E=a != 0.0 and eps > 0.0,
            IEEE=q.dtype == torch.float32, UPCAST=q.device.type == "cpu" and q.dtype != torch.float32,
            D_PAD=d_pad, DV_PAD=dv_pad, **fixed,
        )
    dusum = du.view(B, Hq, nqt, D).sum(dim=(0, 2))
    dn = (dusum - u * (u * dusum).sum(-1, keepdim=True)) / nrm
    return dq.to(q.dtype), dn.to(normals.dtype)

"""Backward Triton kernel of STAIR's reflected bank read-out (the launcher: triton_kernels/stair.py;
the derivation: csrc/cpu/stair_readout.cpp's header and treadle/ops/stair_readout.py).

Same grid as the forward: one program per query block streams the bank (no dK/dV: the bank is
detached, so no atomics). Each tile is recomputed from the row statistics ``(lse_s, log Z)``:
``S = Q K^T`` with the reflection logit chained on as one ``XW``-wide k-step (``X = S + QX KX^T``,
as in the forward), ``G = dO V^T``, then ``dS`` and ``dT`` elementwise and two products on the same
K tile, ``A1 += dS K`` and ``A2 += dT K``: four GEMMs and no per-tile reduction over the query rows
(a column sum inside the loop defines a wgmma accumulator by non-wgmma code, which makes ptxas
serialise every wgmma of the kernel).

The reflection enters only through ``A2`` (the reflected-query view ``t = scale (q_R - q) . k``,
``q_R = q - 2 u (u . q)``). With ``beta_j = -2 scale u . k_j`` and ``alpha_t = u . q_t``:
``dalpha_t = sum_j dT_tj beta_j = -2 scale u . A2_t`` and ``sum_j (sum_t alpha_t dT_tj) k_j =
sum_t alpha_t A2_t``, so the epilogue gives ``dq = (1 - eps) scale A1 + dalpha u`` and the
normal's per-program gradient ``du = sum_t [dalpha_t q_t - 2 scale alpha_t A2_t]`` (summed over
programs by the launcher, then through ``(I - u u^T) / ||n||``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from treadle.triton_kernels.stair_fwd import _dot


@triton.jit
def _row_stat(RS, c, bh, pid_m, T, T4, BHQ, BLOCK_M: tl.constexpr):
    """Row statistic ``c`` of RS (5, B*Hq, T4) fp32 for this query block (0 past T).

    Pointer loads: with 8 warps and no warp specialisation they cost fewer registers than 1-D TMA
    boxes (which a warp-specialised loop would need: T4 keeps each row 16-byte aligned for them)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.load(RS + (c * BHQ + bh) * T4 + offs_m, mask=offs_m < T, other=0.0)


@triton.jit(do_not_specialize=["T", "M"])  # T = 1 / M = 1 must stay runtime values (L = M below)
def _stair_bwd_kernel(
    DO, Q, K, V, QX, KX, U, LEN, RS, DQ, DU,
    Hq, Hkv, HX, T, T4, M, D, DV, GROUP, GX, NQT, BHQ,
    scale, qk_scale, eps, a, b,
    HAS_LEN: tl.constexpr, USE_R: tl.constexpr, USE_E: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, XW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    offs_x = tl.arange(0, XW)
    mmask = offs_m < T
    dmask = offs_d < D
    vmask = offs_v < DV
    q_base = Q + bh * T * D  # per-program bases: in-tile offsets stay 32-bit (fewer registers)
    do_base = DO + bh * T * DV
    if TMA:
        q = tl.make_tensor_descriptor(q_base, shape=[T, D], strides=[D, 1],
                                      block_shape=[BLOCK_M, D_PAD]).load([pid_m * BLOCK_M, 0])
        qx = tl.make_tensor_descriptor(QX + bh * T * XW, shape=[T, XW], strides=[XW, 1],
                                       block_shape=[BLOCK_M, XW]).load([pid_m * BLOCK_M, 0])
    if not TMA:
        q = tl.load(q_base + offs_m[:, None] * D + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
        qx = tl.load(QX + bh * T * XW + offs_m[:, None] * XW + offs_x[None, :], mask=mmask[:, None], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * DV + offs_v[None, :], mask=mmask[:, None] & vmask[None, :], other=0.0)
    # exp2-domain lse_s, lse_s + log Z, log Z; dO . O_R; dO . Y (the launcher forms them; rows past T
    # read 0 there, and with q = dO = 0 every term of such a row is 0)
    lse = _row_stat(RS, 0, bh, pid_m, T, T4, BHQ, BLOCK_M)
    lsz = _row_stat(RS, 1, bh, pid_m, T, T4, BHQ, BLOCK_M)
    g_or = _row_stat(RS, 3, bh, pid_m, T, T4, BHQ, BLOCK_M)
    g_y = _row_stat(RS, 4, bh, pid_m, T, T4, BHQ, BLOCK_M)
    if USE_E:
        logz = _row_stat(RS, 2, bh, pid_m, T, T4, BHQ, BLOCK_M)
    ome = 1.0 - eps
    Lf = tl.maximum(L, 1).to(tl.float32)
    eps_l = eps / Lf

    kbase = K + (bidx * Hkv + kvh) * M * D
    vbase = V + (bidx * Hkv + kvh) * M * DV
    xbase = KX + (bidx * HX + h // GX) * M * XW
    if TMA:
        Lr = tl.maximum(L, 1)
        k_desc = tl.make_tensor_descriptor(kbase, shape=[Lr, D], strides=[D, 1], block_shape=[BLOCK_N, D_PAD])
        v_desc = tl.make_tensor_descriptor(vbase, shape=[Lr, DV], strides=[DV, 1], block_shape=[BLOCK_N, DV_PAD])
        x_desc = tl.make_tensor_descriptor(xbase, shape=[Lr, XW], strides=[XW, 1], block_shape=[BLOCK_N, XW])

    a1 = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    a2 = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    for j0 in tl.range(0, L, BLOCK_N, warp_specialize=WS):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < L
        if TMA:
            k = k_desc.load([j0, 0])
            v = v_desc.load([j0, 0])
        if not TMA:
            k = tl.load(kbase + offs_n[:, None] * D + offs_d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
            v = tl.load(vbase + offs_n[:, None] * DV + offs_v[None, :], mask=nmask[:, None] & vmask[None, :],
                        other=0.0)
        s_raw = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE, UPCAST)
        g = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE, UPCAST)
        s = tl.where(nmask[None, :], s_raw * qk_scale, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        ds = p * (b * g - g_y[:, None])
        if USE_R:
            if TMA:
                kx = x_desc.load([j0, 0])
            if not TMA:
                kx = tl.load(xbase + offs_n[:, None] * XW + offs_x[None, :], mask=nmask[:, None], other=0.0)
            x_raw = _dot(qx, tl.trans(kx), s_raw, IEEE, UPCAST)
            x = tl.where(nmask[None, :], x_raw * qk_scale, float("-inf"))
            pe = tl.math.exp2(x - lsz[:, None])
            gr = a * (g - g_or[:, None])
            pg = pe * gr
            ds += pg
            dt = ome * pg
            if USE_E:
                tt = tl.where(nmask[None, :], (x_raw - s_raw) * qk_scale, float("-inf"))
                dt += eps_l * tl.math.exp2(tt - logz[:, None]) * gr
            a2 = _dot(dt.to(k.dtype), k, a2, IEEE, UPCAST)
        a1 = _dot(ds.to(k.dtype), k, a1, IEEE, UPCAST)

    u = tl.load(U + h * D + offs_d, mask=dmask, other=0.0)
    qf = q.to(tl.float32)
    dq = a1 * (ome * scale)
    if USE_R:
        dalpha = tl.sum(a2 * u[None, :], axis=1) * (-2.0 * scale)
        alpha = tl.sum(qf * u[None, :], axis=1)
        dq += dalpha[:, None] * u[None, :]
        du = tl.sum(dalpha[:, None] * qf - (2.0 * scale) * alpha[:, None] * a2, axis=0)
        tl.store(DU + (bh * NQT + pid_m) * D + offs_d, du, mask=dmask)
    tl.store(DQ + bh * T * D + offs_m[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])

"""Forward Triton kernel of STAIR's reflected bank read-out (spec: treadle/reference/stair.py; the
launcher, the backward and the launch configs: triton_kernels/stair.py).

One program per (query block of ``BLOCK_M`` rows, batch x query head), query blocks fastest, so the
query heads of one kv head stream the same bank at about the same time (its K/V are read from HBM
about once). Per bank tile of ``BLOCK_N`` keys the K and V tiles are loaded once (by TMA through
device-side tensor descriptors on Hopper, by masked pointer loads elsewhere) and feed:

* one ``S = Q K^T`` (the raw logits, scaled after the dot so q is never re-rounded);
* one extra k-step of 16 (``XW``) columns chained on the same accumulator, ``X = S + QX KX^T``:
  ``QX[t] . KX[j] = alpha_t (-2 u . k_j)`` (``alpha_t = u . q_t``), built by the launcher with
  hi/lo splits of alpha and of ``u . k`` in q's dtype (about 16 significant bits in bf16), so the
  reflection logit ``t = scale (X - S)`` needs no per-tile vector load and no CUDA-core work of size
  ``BLOCK_N x D`` (the reflected-query identity ``q_R . k = q . k - 2 (u . q)(u . k)``, STAIR sec. 4.4);
* two online-softmax states (``s`` for pi_ref, ``s + t`` for pi_R) and two ``P V`` products on the
  same V tile; with eps > 0 a third state and product for ``t`` alone (the uniform part of pi_ref
  reweighted by ``e^t``), either in the same loop or, where the config says ``t_pre``, by
  ``_stair_t_kernel`` after this kernel ran its eps = 0 variant (its logits are the rank-one
  ``QX KX^T`` alone, so it needs no ``Q K^T``, and this kernel keeps two accumulators and its
  warp-specialised config).

Logits live in the exp2 domain (``scale * log2 e`` folded into one multiply). The epilogue writes
the read-out ``a O_R + b O_ref``, the fp32 row vectors ``O_R`` and ``Y`` and the natural-log row
statistics ``(lse_s, log Z)`` that the backward recomputes tiles from.

``WS`` asks Triton's Hopper warp specialisation for the bank loop (one TMA producer warp group and
two consumer warp groups of 64 rows; Triton 3.6's pass needs ``num_warps=4``, no ``else`` blocks or
non-dot loads in the loop, and no pointer loads before it: the query tile comes by TMA too). ``TMA`` and ``WS`` are constexprs: the interpreter and non-Hopper GPUs run the same maths
with pointer loads.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # the launcher folds it into the logit scale
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with the accumulator passed in (so wgmma accumulates in place on Hopper).

    UPCAST: the CPU interpreter's ``tl.dot`` mishandles 16-bit operands, so there they go in as fp32.
    IEEE: fp32 inputs use IEEE fp32 products (no TF32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["T", "M"])  # T = 1 / M = 1 must stay runtime values (L = M below)
def _stair_fwd_kernel(
    Q, K, V, QX, KX, LEN, VBAR, OUT, ROWS, STATS,
    Hq, Hkv, HX, T, M, D, DV, GROUP, GX,
    qk_scale, eps, a, b,
    HAS_LEN: tl.constexpr, USE_T: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
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
    if TMA:  # warp specialisation needs the query tile by TMA too (a pointer load here fails the pass)
        q_desc = tl.make_tensor_descriptor(q_base, shape=[T, D], strides=[D, 1], block_shape=[BLOCK_M, D_PAD])
        qx_desc = tl.make_tensor_descriptor(QX + bh * T * XW, shape=[T, XW], strides=[XW, 1],
                                            block_shape=[BLOCK_M, XW])
        q = q_desc.load([pid_m * BLOCK_M, 0])
        qx = qx_desc.load([pid_m * BLOCK_M, 0])
    if not TMA:
        q = tl.load(q_base + offs_m[:, None] * D + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
        qx = tl.load(QX + bh * T * XW + offs_m[:, None] * XW + offs_x[None, :], mask=mmask[:, None], other=0.0)

    kbase = K + (bidx * Hkv + kvh) * M * D
    vbase = V + (bidx * Hkv + kvh) * M * DV
    xbase = KX + (bidx * HX + h // GX) * M * XW
    if TMA:
        # shape [L, .]: TMA zero-fills slots past the row's bank length (which may hold NaN/inf)
        Lr = tl.maximum(L, 1)
        k_desc = tl.make_tensor_descriptor(kbase, shape=[Lr, D], strides=[D, 1], block_shape=[BLOCK_N, D_PAD])
        v_desc = tl.make_tensor_descriptor(vbase, shape=[Lr, DV], strides=[DV, 1], block_shape=[BLOCK_N, DV_PAD])
        x_desc = tl.make_tensor_descriptor(xbase, shape=[Lr, XW], strides=[XW, 1], block_shape=[BLOCK_N, XW])

    m_s = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    m_x = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    m_t = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_s = tl.zeros((BLOCK_M,), tl.float32)
    l_x = tl.zeros((BLOCK_M,), tl.float32)
    l_t = tl.zeros((BLOCK_M,), tl.float32)
    acc_s = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    acc_x = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    acc_t = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    for j0 in tl.range(0, L, BLOCK_N, warp_specialize=WS):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < L
        if TMA:
            k = k_desc.load([j0, 0])
            v = v_desc.load([j0, 0])
            kx = x_desc.load([j0, 0])
        if not TMA:
            k = tl.load(kbase + offs_n[:, None] * D + offs_d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
            v = tl.load(vbase + offs_n[:, None] * DV + offs_v[None, :], mask=nmask[:, None] & vmask[None, :],
                        other=0.0)
            kx = tl.load(xbase + offs_n[:, None] * XW + offs_x[None, :], mask=nmask[:, None], other=0.0)
        s_raw = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE, UPCAST)
        x_raw = _dot(qx, tl.trans(kx), s_raw, IEEE, UPCAST)  # + alpha (-2 u.k): one k-step of XW
        s = tl.where(nmask[None, :], s_raw * qk_scale, float("-inf"))
        x = tl.where(nmask[None, :], x_raw * qk_scale, float("-inf"))
        ms_new = tl.maximum(m_s, tl.max(s, axis=1))
        mx_new = tl.maximum(m_x, tl.max(x, axis=1))
        p_s = tl.math.exp2(s - ms_new[:, None])
        p_x = tl.math.exp2(x - mx_new[:, None])
        c_s = tl.math.exp2(m_s - ms_new)
        c_x = tl.math.exp2(m_x - mx_new)
        l_s = l_s * c_s + tl.sum(p_s, axis=1)
        l_x = l_x * c_x + tl.sum(p_x, axis=1)
        acc_s = _dot(p_s.to(v.dtype), v, acc_s * c_s[:, None], IEEE, UPCAST)
        acc_x = _dot(p_x.to(v.dtype), v, acc_x * c_x[:, None], IEEE, UPCAST)
        m_s = ms_new
        m_x = mx_new
        if USE_T:
            tm = tl.where(nmask[None, :], (x_raw - s_raw) * qk_scale, float("-inf"))
            mt_new = tl.maximum(m_t, tl.max(tm, axis=1))
            p_t = tl.math.exp2(tm - mt_new[:, None])
            c_t = tl.math.exp2(m_t - mt_new)
            l_t = l_t * c_t + tl.sum(p_t, axis=1)
            acc_t = _dot(p_t.to(v.dtype), v, acc_t * c_t[:, None], IEEE, UPCAST)
            m_t = mt_new

    has = (tl.zeros((BLOCK_M,), tl.int32) + L) > 0
    l_s = tl.where(has, l_s, 1.0)
    l_x = tl.where(has, l_x, 1.0)
    l_t = tl.where(has, l_t, 1.0)
    m_s = tl.where(has, m_s, 0.0) * _LN2  # natural-log units from here on
    m_x = tl.where(has, m_x, 0.0) * _LN2
    m_t = tl.where(has, m_t, 0.0) * _LN2
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
    o_base = OUT + bh * T * DV
    r_base = ROWS + bh * T * 2 * DV
    s_base = STATS + bh * T * 2
    tl.store(o_base + offs_m[:, None] * DV + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=omask)
    tl.store(r_base + offs_m[:, None] * (2 * DV) + offs_v[None, :], o_r, mask=omask)
    tl.store(r_base + offs_m[:, None] * (2 * DV) + DV + offs_v[None, :], y, mask=omask)
    tl.store(s_base + offs_m * 2, lse * hasf, mask=mmask)
    tl.store(s_base + offs_m * 2 + 1, logz * hasf, mask=mmask)


@triton.jit(do_not_specialize=["T", "M"])
def _stair_t_kernel(
    QX, KX, V, LEN, VBAR, OUT, ROWS, STATS,
    Hq, Hkv, HX, T, M, DV, GROUP, GX,
    qk_scale, eps, a, b,
    HAS_LEN: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
    DV_PAD: tl.constexpr, XW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """eps > 0, second half: ``_stair_fwd_kernel`` ran at eps = 0 and wrote ``OUT = a O'_R + b O_s``,
    ``ROWS = (O'_R, Y' = b O_s)`` and ``STATS = (lse_s, l'_1 = log Z'_R - lse_s)``. This kernel runs
    the third softmax (logits ``t = scale alpha (-2 u . k)``, the rank-one reflection logit read as
    ``QX KX^T``, one k-step of ``XW``; its online softmax and ``P_t V``), then mixes it in:
    ``l_1 = log(1 - eps) + l'_1``, ``l_2 = log(eps / L) + lse_t``, ``log Z = logaddexp(l_1, l_2)``,
    ``O_R = e^(l_1 - log Z) O'_R + e^(l_2 - log Z) O_t``, ``w = e^(l'_1 - log Z)``,
    ``OUT = a O_R + (1 - eps) Y' + b eps vbar`` and ``Y = Y' + a w (O'_R - O_R)``: the values the
    fused eps > 0 loop writes."""
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
    offs_v = tl.arange(0, DV_PAD)
    offs_x = tl.arange(0, XW)
    mmask = offs_m < T
    vmask = offs_v < DV
    vbase = V + (bidx * Hkv + kvh) * M * DV
    xbase = KX + (bidx * HX + h // GX) * M * XW
    if TMA:
        qx_desc = tl.make_tensor_descriptor(QX + bh * T * XW, shape=[T, XW], strides=[XW, 1],
                                            block_shape=[BLOCK_M, XW])
        qx = qx_desc.load([pid_m * BLOCK_M, 0])
        Lr = tl.maximum(L, 1)
        v_desc = tl.make_tensor_descriptor(vbase, shape=[Lr, DV], strides=[DV, 1], block_shape=[BLOCK_N, DV_PAD])
        x_desc = tl.make_tensor_descriptor(xbase, shape=[Lr, XW], strides=[XW, 1], block_shape=[BLOCK_N, XW])
    if not TMA:
        qx = tl.load(QX + bh * T * XW + offs_m[:, None] * XW + offs_x[None, :], mask=mmask[:, None], other=0.0)
    m_t = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_t = tl.zeros((BLOCK_M,), tl.float32)
    acc_t = tl.zeros((BLOCK_M, DV_PAD), tl.float32)
    for j0 in tl.range(0, L, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < L
        if TMA:
            v = v_desc.load([j0, 0])
            kx = x_desc.load([j0, 0])
        if not TMA:
            v = tl.load(vbase + offs_n[:, None] * DV + offs_v[None, :], mask=nmask[:, None] & vmask[None, :],
                        other=0.0)
            kx = tl.load(xbase + offs_n[:, None] * XW + offs_x[None, :], mask=nmask[:, None], other=0.0)
        t_raw = _dot(qx, tl.trans(kx), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE, UPCAST)
        tm = tl.where(nmask[None, :], t_raw * qk_scale, float("-inf"))
        mt_new = tl.maximum(m_t, tl.max(tm, axis=1))
        p_t = tl.math.exp2(tm - mt_new[:, None])
        c_t = tl.math.exp2(m_t - mt_new)
        l_t = l_t * c_t + tl.sum(p_t, axis=1)
        acc_t = _dot(p_t.to(v.dtype), v, acc_t * c_t[:, None], IEEE, UPCAST)
        m_t = mt_new

    has = (tl.zeros((BLOCK_M,), tl.int32) + L) > 0
    hasf = has.to(tl.float32)
    l_t = tl.where(has, l_t, 1.0)
    m_t = tl.where(has, m_t, 0.0) * _LN2
    s_base = STATS + bh * T * 2
    l1p = tl.load(s_base + offs_m * 2 + 1, mask=mmask, other=0.0)
    Lf = tl.maximum(L, 1).to(tl.float32)
    l1 = tl.log(1.0 - eps) + l1p
    l2 = tl.log(eps / Lf) + m_t + tl.log(l_t)
    mm = tl.maximum(l1, l2)
    logz = mm + tl.log(tl.exp(l1 - mm) + tl.exp(l2 - mm))
    c1 = tl.exp(l1 - logz)
    w = tl.exp(l1p - logz)
    omask = mmask[:, None] & vmask[None, :]
    r_base = ROWS + bh * T * 2 * DV
    # linear in (O'_R, O_t, Y'), ordered so that at most three tiles are live (d = O'_R - O_R); with TMA
    # the tiles move by descriptors (a pointer tensor kept from a load to its store costs 2 registers
    # per element and spills)
    if TMA:
        rows_desc = tl.make_tensor_descriptor(r_base, shape=[T, 2, DV], strides=[2 * DV, DV, 1],
                                              block_shape=[BLOCK_M, 1, DV_PAD])
        o_rp = rows_desc.load([pid_m * BLOCK_M, 0, 0]).reshape(BLOCK_M, DV_PAD)
    if not TMA:
        o_rp = tl.load(r_base + offs_m[:, None] * (2 * DV) + offs_v[None, :], mask=omask, other=0.0)
    d = (1.0 - c1)[:, None] * o_rp - acc_t * (tl.exp(l2 - logz) / l_t)[:, None]
    o_r = (o_rp - d) * hasf[:, None]
    if TMA:
        rows_desc.store([pid_m * BLOCK_M, 0, 0], o_r.reshape(BLOCK_M, 1, DV_PAD))
    if not TMA:
        tl.store(r_base + offs_m[:, None] * (2 * DV) + offs_v[None, :], o_r, mask=omask)
    out = a * o_r
    if TMA:
        y0 = rows_desc.load([pid_m * BLOCK_M, 1, 0]).reshape(BLOCK_M, DV_PAD)
    if not TMA:
        y0 = tl.load(r_base + offs_m[:, None] * (2 * DV) + DV + offs_v[None, :], mask=omask, other=0.0)
    y = (y0 + (a * w)[:, None] * d) * hasf[:, None]
    vbar = tl.load(VBAR + (bidx * Hkv + kvh) * DV + offs_v, mask=vmask, other=0.0)
    out = (out + (1.0 - eps) * y0 + (b * eps) * vbar[None, :]) * hasf[:, None]
    if TMA:
        rows_desc.store([pid_m * BLOCK_M, 1, 0], y.reshape(BLOCK_M, 1, DV_PAD))
        out_desc = tl.make_tensor_descriptor(OUT + bh * T * DV, shape=[T, DV], strides=[DV, 1],
                                             block_shape=[BLOCK_M, DV_PAD])
        out_desc.store([pid_m * BLOCK_M, 0], out.to(OUT.dtype.element_ty))
    if not TMA:
        tl.store(r_base + offs_m[:, None] * (2 * DV) + DV + offs_v[None, :], y, mask=omask)
        tl.store(OUT + bh * T * DV + offs_m[:, None] * DV + offs_v[None, :], out.to(OUT.dtype.element_ty),
                 mask=omask)
    tl.store(s_base + offs_m * 2 + 1, logz * hasf, mask=mmask)

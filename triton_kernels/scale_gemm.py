"""SCALE's gated LoRA inside the base GEMM: one persistent Triton TMA GEMM per direction.

Forward, ``y = x W^T (+ bias) + (s * u) B^T`` with ``u = x A^T``, ``s = scaling * lambda(x . w + b)``
(maths: treadle/ops/gated_lora.py, spec: treadle/reference/scale.py). A work item is a row block of
``BM`` tokens and a run of ``NT`` output tiles of ``BN`` columns; the program loops over items
(persistent, ``num_progs`` programs). In the item's first output tile the K loop issues two dots on
the same x tile in shared memory: ``acc += x_t W_t^T`` and ``xa += x_t A'_t^T`` where
``A' = [A; w_hi; w_mid; w_lo; 0]`` (``RP`` rows, a power of two): the LoRA shrink and the gate
logit ``x . w`` (``w`` split into three scaled pieces of x's dtype whose products with x are exact in
the fp32 accumulator, so a float32 gate keeps float32 precision on a 16-bit tensor core; see
:func:`_pack_rows_kernel`) come out of one pass over x, adding
``RP / BN`` of one tile's MMA work per item. ``v = tanh((x . w + b) / tau)``, ``lambda`` and
``us = s * u`` are then formed in registers and kept for the whole item; every tile's epilogue
issues one more MMA, ``acc += us Bt_tile`` (``Bt = B^T`` padded to ``RP`` rows, K = ``RP``), adds the
bias and stores ``y`` by TMA. No buffer of ``(N, d_out)`` besides ``y`` is read or written, and x is
read by the shrink only where the base GEMM reads it anyway. With ``LORA`` off the same kernel is
the plain base GEMM (the yardstick against cuBLAS).

Backward, ``dx = dy W + (s * p) A`` with ``p = dy B``: the same structure over ``dy`` (K = d_out):
the first tile of an item also accumulates ``p = dy Bt^T`` on the same dy tile;
``dg = scaling (p . u) lambda'(v) (1 - v^2) / tau`` and ``q = s * p`` come from the saved ``u`` and
``v`` in registers; every epilogue adds ``q Ap_tile`` (``Ap = A`` padded to ``RP`` rows).
``dw = x^T dg`` is one streaming reduction over x (:func:`_dw_partial_kernel`), summed over a few
row splits in a fixed order (deterministic).

The first item of each row block (``run == 0``) also writes ``z = [u | x . w]`` and ``v`` (forward)
or ``dg`` (backward) for its tokens.

Launch modes of the same maths: ``PERSISTENT`` (the GPU: ``num_progs`` programs loop over the
items; with ``FLAT`` an item's later tiles run as one flattened (tile, k) loop with the epilogue
under ``k == last``, so their loads overlap the previous epilogue) and one program per item (Triton's
CPU interpreter, where persistence buys nothing; the n-tile loop runs ``NT`` times with a guard).
The sm_90a structure of each pinned config (registers, spills, shared memory, wgmma, TMA) is checked
on a CPU by ``aot_specs`` in triton_kernels/scale.py.
"""
from __future__ import annotations

import triton
import triton.language as tl


# shape arguments stay plain ints in the JIT's signature (no divisibility or ``== 1`` specialisation):
# TMA handles the bounds, and one compiled kernel serves every shape of a dtype and config
SHAPE_ARGS = ["M", "N", "K", "R", "num_progs"]


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` as one MMA with the accumulator in place (Hopper: one async wgmma chain).
    UPCAST: the CPU interpreter's ``tl.dot`` mishandles 16-bit operands, so there they go in as fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow; exact 0 at x = 0 (zero
    # gates give lambda == 1 exactly)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _lam(v, L, U):
    return 1.0 + (1.0 - L) * tl.minimum(v, 0.0) + (U - 1.0) * tl.maximum(v, 0.0)


@triton.jit
def _store_tile(desc, acc, off_m, off_n, BN: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """TMA store of one ``(BM, BN)`` fp32 tile in ``desc``'s dtype; in two ``BN / 2`` halves with
    ``EPI_SPLIT`` (half the staging shared memory)."""
    if EPI_SPLIT:
        BM: tl.constexpr = acc.shape[0]
        a = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
        a0, a1 = tl.split(a)
        desc.store([off_m, off_n], a0.to(desc.dtype))
        desc.store([off_m, off_n + BN // 2], a1.to(desc.dtype))
    else:
        desc.store([off_m, off_n], acc.to(desc.dtype))


# ---------------------------------------------------------------- forward
@triton.jit
def _fwd_tile(x_desc, w_desc, y_desc, bt_desc, bias_ptr, us, off_m, off_n, N, K,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
              EPI_SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One output tile after the first of an item: the base K loop, then the epilogue."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        xt = x_desc.load([off_m, k])
        wt = w_desc.load([off_n, k])
        acc = _mma(xt, wt.T, acc, IEEE, UPCAST)
    _fwd_epilogue(y_desc, bt_desc, bias_ptr, acc, us, off_m, off_n, N, BN, LORA, HAS_BIAS, EPI_SPLIT, IEEE, UPCAST)


@triton.jit
def _fwd_epilogue(y_desc, bt_desc, bias_ptr, acc, us, off_m, off_n, N,
                  BN: tl.constexpr, LORA: tl.constexpr, HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr,
                  IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if LORA:
        bt = bt_desc.load([0, off_n])                   # (RP, BN): rows >= r are zero
        acc = _mma(us, bt, acc, IEEE, UPCAST)                # the gated expand, K = RP
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BN)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    _store_tile(y_desc, acc, off_m, off_n, BN, EPI_SPLIT)


@triton.jit
def _fwd_item(x_desc, w_desc, a_desc, bt_desc, y_desc, bias_ptr, gb_ptr, z_ptr, v_ptr,
              scaling, L, U, inv_tau, gscale, M, N, K, R, pid_m, run, num_n,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, NT: tl.constexpr,
              LORA: tl.constexpr, HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr,
              FLAT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    off_m = pid_m * BM
    n_begin = run * NT
    # first tile: the base K loop and (with the LoRA) the shrink on the same x tile
    off_n = n_begin * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    xa = tl.zeros((BM, RP), dtype=tl.float32)
    for k in range(0, K, BK):
        xt = x_desc.load([off_m, k])
        wt = w_desc.load([off_n, k])
        acc = _mma(xt, wt.T, acc, IEEE, UPCAST)
        if LORA:
            at = a_desc.load([0, k])
            xa = _mma(xt, at.T, xa, IEEE, UPCAST)
    us = tl.zeros((BM, RP), dtype=x_desc.dtype)
    if LORA:
        cols = tl.arange(0, RP)
        # x . w = x . hi + (x . mid) / S + (x . lo) / S^2 (the pieces of w in rows R..R+2 of A')
        gw = tl.where(cols == R, 1.0, tl.where(cols == R + 1, 1.0 / gscale, tl.where(cols == R + 2, 1.0 / (gscale * gscale), 0.0)))
        g = tl.sum(xa * gw[None, :], axis=1)
        v = _tanh((g + tl.load(gb_ptr).to(tl.float32)) * inv_tau)
        s = scaling * _lam(v, L, U)
        usf = tl.where(cols[None, :] < R, xa * s[:, None], 0.0)
        if UPCAST:
            us = usf
        else:
            us = usf.to(x_desc.dtype)
        if run == 0:
            rows = off_m + tl.arange(0, BM)
            rmask = rows < M
            zval = tl.where(cols[None, :] == R, g[:, None], xa)
            tl.store(z_ptr + rows.to(tl.int64)[:, None] * (R + 1) + cols[None, :], zval.to(z_ptr.dtype.element_ty),
                     mask=rmask[:, None] & (cols[None, :] <= R))
            tl.store(v_ptr + rows, v, mask=rmask)
    _fwd_epilogue(y_desc, bt_desc, bias_ptr, acc, us, off_m, off_n, N, BN, LORA, HAS_BIAS, EPI_SPLIT, IEEE, UPCAST)
    # the rest of the run: base K loop + epilogue with the same us
    if PERSISTENT and FLAT:
        # one flattened loop over (tile, k) of the later tiles, the epilogue under ``k == last``: the
        # software pipeline keeps loading the next tile's operands while this tile's epilogue runs
        k_tiles = tl.cdiv(K, BK)
        n_rest = tl.minimum(n_begin + NT, num_n) - n_begin - 1
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for it in range(0, n_rest * k_tiles):
            kt = it % k_tiles
            off_n = (n_begin + 1 + it // k_tiles) * BN
            xt = x_desc.load([off_m, kt * BK])
            wt = w_desc.load([off_n, kt * BK])
            acc = _mma(xt, wt.T, acc, IEEE, UPCAST)
            if kt == k_tiles - 1:
                _fwd_epilogue(y_desc, bt_desc, bias_ptr, acc, us, off_m, off_n, N, BN, LORA, HAS_BIAS, EPI_SPLIT,
                              IEEE, UPCAST)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
    elif PERSISTENT:
        n_end = tl.minimum(n_begin + NT, num_n)
        for nt in range(n_begin + 1, n_end):
            _fwd_tile(x_desc, w_desc, y_desc, bt_desc, bias_ptr, us, off_m, nt * BN, N, K,
                      BM, BN, BK, LORA, HAS_BIAS, EPI_SPLIT, IEEE, UPCAST)
    else:
        for j in tl.static_range(1, NT):
            if n_begin + j < num_n:
                _fwd_tile(x_desc, w_desc, y_desc, bt_desc, bias_ptr, us, off_m, (n_begin + j) * BN, N, K,
                          BM, BN, BK, LORA, HAS_BIAS, EPI_SPLIT, IEEE, UPCAST)


@triton.jit(do_not_specialize=SHAPE_ARGS)
def gated_lora_gemm_fwd_kernel(
    x_desc, w_desc, a_desc, bt_desc, y_desc, bias_ptr, gb_ptr, z_ptr, v_ptr,
    scaling, L, U, inv_tau, gscale,
    M, N, K, R, num_progs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, NT: tl.constexpr,
    LORA: tl.constexpr, HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr,
    PERSISTENT: tl.constexpr, FLAT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """``y = x W^T (+ bias) (+ (s u) B^T)``; see the module docstring. Items are numbered row block
    major (``item = pid_m * runs + run``), so programs running at once share x row blocks in L2."""
    num_n = tl.cdiv(N, BN)
    runs = tl.cdiv(num_n, NT)
    if PERSISTENT:
        n_items = tl.cdiv(M, BM) * runs
        for item in tl.range(tl.program_id(0), n_items, num_progs):
            _fwd_item(x_desc, w_desc, a_desc, bt_desc, y_desc, bias_ptr, gb_ptr, z_ptr, v_ptr,
                      scaling, L, U, inv_tau, gscale, M, N, K, R, item // runs, item % runs, num_n,
                      BM, BN, BK, RP, NT, LORA, HAS_BIAS, EPI_SPLIT, PERSISTENT, FLAT, IEEE, UPCAST)
    else:
        item = tl.program_id(0)
        _fwd_item(x_desc, w_desc, a_desc, bt_desc, y_desc, bias_ptr, gb_ptr, z_ptr, v_ptr,
                  scaling, L, U, inv_tau, gscale, M, N, K, R, item // runs, item % runs, num_n,
                  BM, BN, BK, RP, NT, LORA, HAS_BIAS, EPI_SPLIT, PERSISTENT, FLAT, IEEE, UPCAST)


# ---------------------------------------------------------------- backward (dx)
@triton.jit
def _dx_tile(dy_desc, w_desc, dx_desc, ap_desc, q, off_m, off_n, K,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LORA: tl.constexpr, EPI_SPLIT: tl.constexpr,
             IEEE: tl.constexpr, UPCAST: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        dyt = dy_desc.load([off_m, k])
        wt = w_desc.load([k, off_n])
        acc = _mma(dyt, wt, acc, IEEE, UPCAST)
    _dx_epilogue(dx_desc, ap_desc, acc, q, off_m, off_n, BN, LORA, EPI_SPLIT, IEEE, UPCAST)


@triton.jit
def _dx_epilogue(dx_desc, ap_desc, acc, q, off_m, off_n, BN: tl.constexpr, LORA: tl.constexpr,
                 EPI_SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if LORA:
        ap = ap_desc.load([0, off_n])                   # (RP, BN): rows >= r are zero
        acc = _mma(q, ap, acc, IEEE, UPCAST)
    _store_tile(dx_desc, acc, off_m, off_n, BN, EPI_SPLIT)


@triton.jit
def _dx_item(dy_desc, w_desc, bt_desc, ap_desc, dx_desc, z_ptr, v_ptr, dg_ptr,
             scaling, L, U, inv_tau, M, N, K, R, pid_m, run, num_n,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, NT: tl.constexpr,
             LORA: tl.constexpr, EPI_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr, FLAT: tl.constexpr,
             IEEE: tl.constexpr, UPCAST: tl.constexpr):
    off_m = pid_m * BM
    n_begin = run * NT
    off_n = n_begin * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    p = tl.zeros((BM, RP), dtype=tl.float32)
    for k in range(0, K, BK):
        dyt = dy_desc.load([off_m, k])
        wt = w_desc.load([k, off_n])
        acc = _mma(dyt, wt, acc, IEEE, UPCAST)
        if LORA:
            bt = bt_desc.load([0, k])
            p = _mma(dyt, bt.T, p, IEEE, UPCAST)
    q = tl.zeros((BM, RP), dtype=dy_desc.dtype)
    if LORA:
        rows = off_m + tl.arange(0, BM)
        rmask = rows < M
        cols = tl.arange(0, RP)
        u = tl.load(z_ptr + rows.to(tl.int64)[:, None] * (R + 1) + cols[None, :],
                    mask=rmask[:, None] & (cols[None, :] < R), other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows, mask=rmask, other=0.0)
        qf = p * (scaling * _lam(v, L, U))[:, None]
        if UPCAST:
            q = qf
        else:
            q = qf.to(dy_desc.dtype)
        if run == 0:
            slope = tl.where(v < 0.0, 1.0 - L, tl.where(v > 0.0, U - 1.0, 0.5 * (U - L)))
            dg = scaling * tl.sum(p * u, axis=1) * slope * (1.0 - v * v) * inv_tau
            tl.store(dg_ptr + rows, dg, mask=rmask)
    _dx_epilogue(dx_desc, ap_desc, acc, q, off_m, off_n, BN, LORA, EPI_SPLIT, IEEE, UPCAST)
    if PERSISTENT and FLAT:
        # flattened as in the forward (the next tile's loads overlap this tile's epilogue)
        k_tiles = tl.cdiv(K, BK)
        n_rest = tl.minimum(n_begin + NT, num_n) - n_begin - 1
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for it in range(0, n_rest * k_tiles):
            kt = it % k_tiles
            off_n = (n_begin + 1 + it // k_tiles) * BN
            dyt = dy_desc.load([off_m, kt * BK])
            wt = w_desc.load([kt * BK, off_n])
            acc = _mma(dyt, wt, acc, IEEE, UPCAST)
            if kt == k_tiles - 1:
                _dx_epilogue(dx_desc, ap_desc, acc, q, off_m, off_n, BN, LORA, EPI_SPLIT, IEEE, UPCAST)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
    elif PERSISTENT:
        n_end = tl.minimum(n_begin + NT, num_n)
        for nt in range(n_begin + 1, n_end):
            _dx_tile(dy_desc, w_desc, dx_desc, ap_desc, q, off_m, nt * BN, K, BM, BN, BK, LORA, EPI_SPLIT,
                     IEEE, UPCAST)
    else:
        for j in tl.static_range(1, NT):
            if n_begin + j < num_n:
                _dx_tile(dy_desc, w_desc, dx_desc, ap_desc, q, off_m, (n_begin + j) * BN, K, BM, BN, BK, LORA,
                         EPI_SPLIT, IEEE, UPCAST)


@triton.jit(do_not_specialize=SHAPE_ARGS)
def gated_lora_gemm_dx_kernel(
    dy_desc, w_desc, bt_desc, ap_desc, dx_desc, z_ptr, v_ptr, dg_ptr,
    scaling, L, U, inv_tau,
    M, N, K, R, num_progs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, NT: tl.constexpr,
    LORA: tl.constexpr, EPI_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr,
    FLAT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """``dx = dy W (+ (s p) A)`` and ``dg``; ``N`` = d_in (dx's columns), ``K`` = d_out."""
    num_n = tl.cdiv(N, BN)
    runs = tl.cdiv(num_n, NT)
    if PERSISTENT:
        n_items = tl.cdiv(M, BM) * runs
        for item in tl.range(tl.program_id(0), n_items, num_progs):
            _dx_item(dy_desc, w_desc, bt_desc, ap_desc, dx_desc, z_ptr, v_ptr, dg_ptr,
                     scaling, L, U, inv_tau, M, N, K, R, item // runs, item % runs, num_n,
                     BM, BN, BK, RP, NT, LORA, EPI_SPLIT, PERSISTENT, FLAT, IEEE, UPCAST)
    else:
        item = tl.program_id(0)
        _dx_item(dy_desc, w_desc, bt_desc, ap_desc, dx_desc, z_ptr, v_ptr, dg_ptr,
                 scaling, L, U, inv_tau, M, N, K, R, item // runs, item % runs, num_n,
                 BM, BN, BK, RP, NT, LORA, EPI_SPLIT, PERSISTENT, FLAT, IEEE, UPCAST)


# ---------------------------------------------------------------- dw = x^T dg
@triton.jit
def _dw_partial_kernel(x_ptr, dg_ptr, part_ptr, M, D, ROWS_PER_SPLIT,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``part[split, d] = sum over the split's rows of x[row, d] * dg[row]`` in fp32: one read of x."""
    pid_d = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row0 = split * ROWS_PER_SPLIT
    for m0 in range(0, ROWS_PER_SPLIT, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        rmask = (rows < M) & (m0 + tl.arange(0, BLOCK_M) < ROWS_PER_SPLIT)
        xt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        dg = tl.load(dg_ptr + rows, mask=rmask, other=0.0)
        acc += tl.sum(xt * dg[:, None], axis=0)
    tl.store(part_ptr + split * D + cols, acc, mask=cmask)


# ---------------------------------------------------------------- operand packing
@triton.jit
def _pack_rows_kernel(src_ptr, s_row, s_col, w_ptr, out_ptr, R, D, gscale,
                      GATE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row ``i`` of ``out (RP, D)``: ``src[i, :]`` for ``i < R``; with ``GATE`` the gate vector in three
    pieces of ``out``'s dtype at rows ``R, R + 1, R + 2``: ``hi = w`` rounded, ``mid = (w - hi) S``
    rounded, ``lo = ((w - hi) S - mid) S`` rounded, ``S = gscale`` (2^8 for bf16, 2^11 for fp16: the
    pieces stay normal numbers), so ``w = hi + mid / S + lo / S^2`` to about float32 precision; zero
    below. One launch builds ``A' = [A; w pieces; 0]`` or ``Bt = B^T`` padded (``src`` strided)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    odt = out_ptr.dtype.element_ty
    row = tl.zeros((BLOCK_D,), dtype=tl.int32) + i     # the row index as a vector (masks stay vectors)
    src = tl.load(src_ptr + i * s_row + cols.to(tl.int64) * s_col, mask=cmask & (row < R), other=0.0)
    val = src.to(tl.float32).to(odt)
    if GATE:
        w = tl.load(w_ptr + cols, mask=cmask & (row >= R) & (row <= R + 2), other=0.0).to(tl.float32)
        hi = w.to(odt)
        r1 = (w - hi.to(tl.float32)) * gscale
        mid = r1.to(odt)
        lo = ((r1 - mid.to(tl.float32)) * gscale).to(odt)
        val = tl.where(row == R, hi, tl.where(row == R + 1, mid, tl.where(row == R + 2, lo, val)))
    tl.store(out_ptr + i * D + cols, val, mask=cmask)

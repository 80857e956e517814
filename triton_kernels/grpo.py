"""Triton kernels of ``treadle.ops.grpo_advantages`` (spec: treadle/reference/grpo.py).

Group ids are made dense without a host sync: ``torch.sort`` then a cumulative sum over "id changes"
gives every row a group index in [0, N). Four launches follow, each one pass over the rows:

1. ``_stats_kernel``: per group count and sum (float64 atomics), plus a representative reward for the
   "all equal" test; per-block partial batch sums.
2. ``_dev_kernel``: per group sum of squared deviations and "differs from the representative" flag
   (int32 atomic max); batch sum of squared deviations (for ``scale="batch"``).
3. ``_advantage_kernel``: the per-row advantage (same maths as csrc/grpo_common.h), flags clamp, and
   for ``reinforce_baseline`` partial sums of the pre-whitening advantages and a representative one.
4. ``reinforce_baseline`` only: ``_whiten_dev_kernel`` (sum of squared deviations from the batch mean
   of the pre-whitening advantages, i.e. two-pass statistics as everywhere else, and whether any
   differs from the representative) and ``_whiten_kernel``; all equal gives exactly 0 (no 0/0 at eps=0).

Shapes of every buffer are static (N groups at most), so the op never waits on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _stats_kernel(r_ptr, g_ptr, ok_ptr, cnt_ptr, sum_ptr, rep_ptr, bsum_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    ok = tl.load(ok_ptr + offs, mask=inb, other=0) != 0
    r = tl.where(ok, tl.load(r_ptr + offs, mask=inb, other=0.0).to(tl.float64), 0.0)  # invalid rows: never read
    g = tl.load(g_ptr + offs, mask=inb, other=0)
    tl.atomic_add(cnt_ptr + g, tl.where(ok, 1.0, 0.0).to(tl.float64), mask=ok)
    tl.atomic_add(sum_ptr + g, r, mask=ok)
    tl.store(rep_ptr + g, r, mask=ok)  # any member will do: a benign race
    tl.atomic_add(bsum_ptr + 0, tl.sum(tl.where(ok, r, 0.0), axis=0))
    tl.atomic_add(bsum_ptr + 1, tl.sum(tl.where(ok, 1.0, 0.0).to(tl.float64), axis=0))


@triton.jit
def _dev_kernel(r_ptr, g_ptr, ok_ptr, cnt_ptr, sum_ptr, rep_ptr, m2_ptr, diff_ptr, bsum_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    ok = tl.load(ok_ptr + offs, mask=inb, other=0) != 0
    r = tl.where(ok, tl.load(r_ptr + offs, mask=inb, other=0.0).to(tl.float64), 0.0)  # invalid rows: never read
    g = tl.load(g_ptr + offs, mask=inb, other=0)
    c = tl.load(cnt_ptr + g, mask=ok, other=1.0)
    mean = tl.load(sum_ptr + g, mask=ok, other=0.0) / c
    d = r - mean
    tl.atomic_add(m2_ptr + g, d * d, mask=ok)
    rep = tl.load(rep_ptr + g, mask=ok, other=0.0)
    tl.atomic_max(diff_ptr + g, (r != rep).to(tl.int32), mask=ok)
    bcnt = tl.load(bsum_ptr + 1)
    bmean = tl.load(bsum_ptr + 0) / tl.maximum(bcnt, 1.0)
    bd = tl.where(ok, r - bmean, 0.0)
    tl.atomic_add(bsum_ptr + 2, tl.sum(bd * bd, axis=0))


@triton.jit
def _advantage_kernel(r_ptr, g_ptr, ok_ptr, flag_ptr, cnt_ptr, sum_ptr, m2_ptr, diff_ptr, bsum_ptr, out_ptr, a_ptr, n,
                      eps, ESTIMATOR: tl.constexpr, UNBIASED: tl.constexpr, EPS_IN_SQRT: tl.constexpr,
                      SINGLETON_RAW: tl.constexpr, SCALE: tl.constexpr, HAS_FLAGS: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    ok = tl.load(ok_ptr + offs, mask=inb, other=0) != 0
    r = tl.where(ok, tl.load(r_ptr + offs, mask=inb, other=0.0).to(tl.float64), 0.0)  # invalid rows: never read
    g = tl.load(g_ptr + offs, mask=inb, other=0)
    c = tl.load(cnt_ptr + g, mask=ok, other=1.0)
    mean = tl.load(sum_ptr + g, mask=ok, other=0.0) / c
    m2 = tl.load(m2_ptr + g, mask=ok, other=0.0)
    differs = tl.load(diff_ptr + g, mask=ok, other=0) != 0
    d = r - mean
    if ESTIMATOR == 0:  # grpo
        if SCALE == 0:
            if UNBIASED:
                var = m2 / tl.maximum(c - 1.0, 1.0)
            else:
                var = m2 / c
            if EPS_IN_SQRT:
                adv = d / tl.sqrt(var + eps)
            else:
                adv = d / (tl.sqrt(var) + eps)
        elif SCALE == 1:
            bcnt = tl.load(bsum_ptr + 1)
            if UNBIASED:
                bvar = tl.load(bsum_ptr + 2) / tl.maximum(bcnt - 1.0, 1.0)
            else:
                bvar = tl.load(bsum_ptr + 2) / tl.maximum(bcnt, 1.0)
            bstd = tl.where(bcnt > 1.5, tl.sqrt(bvar), 0.0)
            adv = d / (bstd + eps)
        else:
            adv = d
    elif ESTIMATOR == 2:  # rloo
        adv = d * c / tl.maximum(c - 1.0, 1.0)
    else:  # dr_grpo, reinforce_baseline
        adv = d
    adv = tl.where(differs, adv, 0.0)
    if SINGLETON_RAW:
        if ESTIMATOR == 0 and SCALE != 2:
            raw = r / (1.0 + eps)
        else:
            raw = r
        adv = tl.where(c < 1.5, raw, adv)
    else:
        adv = tl.where(c < 1.5, 0.0, adv)
    adv = tl.where(ok, adv, 0.0)
    if ESTIMATOR == 3:
        tl.store(a_ptr + offs, adv, mask=inb)
        tl.atomic_add(bsum_ptr + 3, tl.sum(adv, axis=0))
        tl.store(bsum_ptr + 5 + offs * 0, adv, mask=ok)  # representative pre-whitening advantage: a benign race
    else:
        if HAS_FLAGS:
            f = tl.load(flag_ptr + offs, mask=inb, other=0) != 0
            adv = tl.where(f, tl.minimum(adv, 0.0), adv)
        tl.store(out_ptr + offs, adv.to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _whiten_dev_kernel(a_ptr, ok_ptr, bsum_ptr, adiff_ptr, n, BLOCK: tl.constexpr):
    # second pass over the pre-whitening advantages: sum (a - mean(a))^2 (no E[a^2] - E[a]^2
    # cancellation) and "some a differs from the representative"
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    ok = tl.load(ok_ptr + offs, mask=inb, other=0) != 0
    a = tl.load(a_ptr + offs, mask=inb, other=0.0)
    bcnt = tl.load(bsum_ptr + 1)
    amean = tl.load(bsum_ptr + 3) / tl.maximum(bcnt, 1.0)
    d = tl.where(ok, a - amean, 0.0)
    tl.atomic_add(bsum_ptr + 4, tl.sum(d * d, axis=0))
    rep = tl.load(bsum_ptr + 5)
    tl.atomic_max(adiff_ptr + 0, tl.max(tl.where(ok & (a != rep), 1, 0).to(tl.int32), axis=0))


@triton.jit
def _whiten_kernel(a_ptr, ok_ptr, flag_ptr, bsum_ptr, adiff_ptr, out_ptr, n, eps, UNBIASED: tl.constexpr,
                   HAS_FLAGS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    ok = tl.load(ok_ptr + offs, mask=inb, other=0) != 0
    a = tl.load(a_ptr + offs, mask=inb, other=0.0)
    bcnt = tl.load(bsum_ptr + 1)
    amean = tl.load(bsum_ptr + 3) / tl.maximum(bcnt, 1.0)
    am2 = tl.load(bsum_ptr + 4)
    differs = tl.load(adiff_ptr) != 0
    if UNBIASED:
        avar = am2 / tl.maximum(bcnt - 1.0, 1.0)
    else:
        avar = am2 / tl.maximum(bcnt, 1.0)
    astd = tl.where(bcnt > 1.5, tl.sqrt(avar), 0.0)
    adv = tl.where(ok & differs, (a - amean) / (astd + eps), 0.0)
    if HAS_FLAGS:
        f = tl.load(flag_ptr + offs, mask=inb, other=0) != 0
        adv = tl.where(f, tl.minimum(adv, 0.0), adv)
    tl.store(out_ptr + offs, adv.to(out_ptr.dtype.element_ty), mask=inb)


def dense_group_index(group_ids: torch.Tensor) -> torch.Tensor:
    """``(N,)`` int64 ids -> ``(N,)`` int64 dense group index in [0, N), without a host sync."""
    sorted_ids, perm = torch.sort(group_ids)
    starts = torch.ones_like(sorted_ids, dtype=torch.int64)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).to(torch.int64)
    seg = torch.cumsum(starts, 0) - 1
    dense = torch.empty_like(seg)
    dense[perm] = seg
    return dense


def grpo_advantages_triton(rewards, group_ids, valid, flags, estimator, unbiased, eps, eps_in_sqrt, singleton_raw,
                           scale, skip_nonfinite):
    """Triton backend; arguments as the ``treadle::grpo_advantages`` custom op (contiguous inputs)."""
    n = rewards.numel()
    dev = rewards.device
    ok = torch.ones(n, dtype=torch.bool, device=dev) if valid is None else valid.clone()
    if skip_nonfinite:
        ok &= torch.isfinite(rewards)
    ok8 = ok.to(torch.int8)
    g = dense_group_index(group_ids)
    f64 = dict(dtype=torch.float64, device=dev)
    cnt = torch.zeros(n, **f64)
    total = torch.zeros(n, **f64)
    rep = torch.zeros(n, **f64)
    m2 = torch.zeros(n, **f64)
    diff = torch.zeros(n, dtype=torch.int32, device=dev)
    bsum = torch.zeros(8, **f64)  # [sum r, count, sum (r - mean)^2, sum a, sum (a - mean a)^2, representative a]
    out = torch.empty_like(rewards)
    a = torch.empty(n if estimator == 3 else 1, **f64)
    fl = flags.to(torch.int8) if flags is not None else ok8
    grid = (triton.cdiv(n, BLOCK),)
    _stats_kernel[grid](rewards, g, ok8, cnt, total, rep, bsum, n, BLOCK=BLOCK)
    _dev_kernel[grid](rewards, g, ok8, cnt, total, rep, m2, diff, bsum, n, BLOCK=BLOCK)
    _advantage_kernel[grid](rewards, g, ok8, fl, cnt, total, m2, diff, bsum, out, a, n, float(eps),
                            ESTIMATOR=estimator, UNBIASED=unbiased, EPS_IN_SQRT=eps_in_sqrt,
                            SINGLETON_RAW=singleton_raw, SCALE=scale, HAS_FLAGS=flags is not None, BLOCK=BLOCK)
    if estimator == 3:
        adiff = torch.zeros(1, dtype=torch.int32, device=dev)
        _whiten_dev_kernel[grid](a, ok8, bsum, adiff, n, BLOCK=BLOCK)
        _whiten_kernel[grid](a, ok8, fl, bsum, adiff, out, n, float(eps), UNBIASED=unbiased,
                             HAS_FLAGS=flags is not None, BLOCK=BLOCK)
    return out

"""Triton kernels of ``treadle.ops.grpo_advantages`` (spec: treadle/reference/grpo.py).

Two routes, chosen on the device (no host sync, no sort; every launch has a fixed grid, so a CUDA
graph can capture the op):

* **Sorted ids** (rows of a group adjacent and ids non-decreasing: ``arange(N) // G``, verl's and
  TRL's layouts), group-local estimators (``grpo`` with group or no scaling, ``dr_grpo``, ``rloo``):
  one pass over the rows. ``_runs_kernel`` reads ``CHUNK`` rows (reward, id, masks) per program and
  finds its runs of equal ids in registers. One segmented ``tl.associative_scan`` carries (count,
  sum, min, max) with the run-start mark packed into the count word; min and max propagate NaN, so
  ``max != min`` is the reference's exact "some considered reward differs" test. Each row finds its
  run's last position by an int32 reverse min-scan and reads the run's totals there with
  ``tl.gather`` (shared memory), where reverse broadcast scans of every operand would cost several
  warp shuffles per word; a second segmented scan sums ``(r - mean)^2`` (two-pass statistics with
  no second read). Sums and means are float64; the variance, square root and division run in the
  output's precision when it is narrower (float64 division is a software sequence on the GPU).
  Runs that start and end inside the chunk get their advantages at once; the lanes holding the
  chunk's first and last runs write their (count, mean, M2, min, max) partials with masked stores
  (O(N / CHUNK) words, not zero-filled, no reductions). A chunk checks ``id[i] < id[i-1]`` and
  raises the device route flag only when it finds one; it keeps its id range in its own words (the
  first and last ids when sorted), so the sorted path issues no atomics. ``_stitch_kernel`` (one
  program per chunk) merges the partials of a run that crosses chunks (Chan et al.'s pairwise
  update) and rewrites only its rows (about 2 runs per chunk); a run longer than ``WALK_LIMIT``
  chunks raises the flag instead. The bytes are the minimum: read 4 + 8 (+ masks) and write 4 per row.

* **General** (the flag raised: unsorted ids, batch-level statistics, very long runs):
  ``_idrange_kernel`` reduces the chunks' id ranges, then a group table indexed by
  ``id - min(id)`` when the id range is smaller than the table, else an open-addressing hash table
  of the ids (linear probing with ``atomic_cas``); tables are ``torch.empty`` and the kernels zero
  only the part they use (for dense ids: about the number of groups, which stays in L2). Indexed
  directly, each pass computes a row's slot from its id (no slot pass: 16 bytes a row less);
  hashed, ``_slot_kernel`` stores the probed slots. A group's record is 32 bytes, one memory
  sector (float64 sum, M2 and a representative reward, int32 count and "differs"), so each pass
  reads what it needs of a row's group in one transaction. Three passes: count, sum and the
  representative reward ("all equal" test); the squared deviations from the group mean; the
  per-row advantage; ``reinforce_baseline`` whitens over the batch in
  two more passes (two-pass statistics everywhere). Every general-route kernel returns at once when
  the flag is down, so both routes are always launched; they loop grid-stride over at most
  ``MAX_PROGRAMS`` programs, so the skipped route costs a few thousand empty programs, not one per
  block of rows.

``aot_specs()`` lists each kernel at its launch config for the sm_90a structure check
(bench/gpu_aot.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import AotSpec

BLOCK = 1024  # rows per program of the general route's passes
CHUNK = 512  # rows per program of the sorted route: 4 rows a thread at 4 warps, 120-125 registers on sm_90a
# (1024 rows take 196: half the blocks per SM for the same bytes in flight; 2048 spills)
MAX_PROGRAMS = 2048  # grid cap of the general route's grid-stride kernels: when the sorted route has done the
# work they return at once, and 2,048 programs cost a few microseconds where one per block cost tens
WALK_LIMIT = 64  # chunks one run may span on the sorted route before the general route takes over
_I64_MAX = 2 ** 63 - 1
_I64_MIN = -2 ** 63
_MAX_ID: tl.constexpr = tl.constexpr(_I64_MAX)  # the kernels' neutral elements of min / max id
_MIN_ID: tl.constexpr = tl.constexpr(_I64_MIN)


# ------------------------------------------------------------------ the advantage formula (both routes)
@triton.jit
def _adv_math(r, d, c, m2, differs, ok, bcnt, bm2, eps, ESTIMATOR: tl.constexpr, UNBIASED: tl.constexpr,
              EPS_IN_SQRT: tl.constexpr, SINGLETON_RAW: tl.constexpr, SCALE: tl.constexpr, OUT_TY: tl.constexpr):
    """Per-row advantage from the row's reward, ``d = r - mean`` and its group's count, M2 and "some
    considered reward differs" (ESTIMATOR 3 returns the pre-whitening ``d``).

    The sums and the mean are float64 (``d`` keeps its digits under a large reward offset); the last
    step (variance, square root, division) runs in float64 for a float64 output and in float32 for a
    narrower one, whose rounding it then dominates (float64 division and square root are software
    sequences on the GPU, a large part of the kernel's instructions)."""
    if OUT_TY != tl.float64:
        r = r.to(tl.float32)
        d = d.to(tl.float32)
        c = c.to(tl.float32)
        m2 = m2.to(tl.float32)
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
        elif SCALE == 1:  # batch statistics (the general route only: bcnt, bm2 are loaded scalars)
            if OUT_TY != tl.float64:
                bcnt = bcnt.to(tl.float32)
                bm2 = bm2.to(tl.float32)
            if UNBIASED:
                bvar = bm2 / tl.maximum(bcnt - 1.0, 1.0)
            else:
                bvar = bm2 / tl.maximum(bcnt, 1.0)
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
    return tl.where(ok, adv, 0.0)


@triton.jit
def _load_native(r_ptr, ok_ptr, offs, inb, HAS_OK: tl.constexpr, SKIP_NONFINITE: tl.constexpr):
    """Considered-row mask and rewards in their own dtype (0 at rows not considered, which are never read)."""
    if HAS_OK:
        ok = (tl.load(ok_ptr + offs, mask=inb, other=0) != 0) & inb
    else:
        ok = inb
    r = tl.load(r_ptr + offs, mask=ok, other=0.0)
    if SKIP_NONFINITE:
        ok = ok & (tl.abs(r) < float("inf"))  # NaN compares false too
        r = tl.where(ok, r, 0.0)
    return ok, r


@triton.jit
def _load_rows(r_ptr, ok_ptr, offs, inb, HAS_OK: tl.constexpr, SKIP_NONFINITE: tl.constexpr):
    """Considered-row mask and float64 rewards (0 at rows not considered, which are never read)."""
    ok, r = _load_native(r_ptr, ok_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
    return ok, r.to(tl.float64)


# ------------------------------------------------------------------ sorted route
_FLAG: tl.constexpr = tl.constexpr(1 << 30)  # run-start mark carried in the count word of the segmented scan
NPART: tl.constexpr = tl.constexpr(10)  # words per chunk in ``part``: (count, mean, M2, min, max), first and last run
NBND: tl.constexpr = tl.constexpr(6)  # words per chunk in ``bnd``: first run's end, last run's start, one run?, open
# edges, min id, max id


@triton.jit
def _seg_stats(ca, sa, lo_a, hi_a, cb, sb, lo_b, hi_b):
    """Segmented (count, sum, min, max): a run start in the right operand (its count word >= _FLAG)
    resets; the mark itself rides in the count word, so the scan carries no separate flag.
    Min and max propagate NaN, so a NaN makes ``max != min`` (the reference's "differs")."""
    fb = cb >= _FLAG
    lo = tl.minimum(lo_a, lo_b, propagate_nan=tl.PropagateNan.ALL)
    hi = tl.maximum(hi_a, hi_b, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(fb, cb, ca + cb), tl.where(fb, sb, sa + sb), tl.where(fb, lo_b, lo), tl.where(fb, hi_b, hi)


@triton.jit
def _seg_add1(fa, sa, fb, sb):
    return fa | fb, tl.where(fb, sb, sa + sb)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _exact32(x):
    """``x`` in a type that holds it exactly for min / max: float64 stays, narrower floats go to float32."""
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _store_id_range(bbase, g, inb, one):
    tl.store(bbase + 4 + g * 0, tl.min(tl.where(inb, g, _MAX_ID), axis=0), mask=one)
    tl.store(bbase + 5 + g * 0, tl.max(tl.where(inb, g, _MIN_ID), axis=0), mask=one)


@triton.jit
def _runs_kernel(r_ptr, g_ptr, ok_ptr, flag_ptr, out_ptr, part_ptr, bnd_ptr, state_ptr, n, eps,
                 ESTIMATOR: tl.constexpr, UNBIASED: tl.constexpr, EPS_IN_SQRT: tl.constexpr,
                 SINGLETON_RAW: tl.constexpr, SCALE: tl.constexpr, HAS_OK: tl.constexpr, HAS_FLAGS: tl.constexpr,
                 SKIP_NONFINITE: tl.constexpr, LOCAL: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    c0 = pid.to(tl.int64) * CHUNK
    pos = tl.arange(0, CHUNK)
    offs = c0 + pos
    inb = offs < n
    last_pos = tl.minimum(n - c0, CHUNK).to(tl.int32) - 1
    g = tl.load(g_ptr + offs, mask=inb, other=0)
    gp = tl.load(g_ptr + offs - 1, mask=inb & (offs > 0), other=0)
    # sortedness (an id below its predecessor raises the route flag) and the chunk's id range, kept per
    # chunk (no atomics on the sorted path): _idrange_kernel reduces them when the general route runs
    unsorted = tl.max((inb & (offs > 0) & (g < gp)).to(tl.int32), axis=0)
    bbase = bnd_ptr + pid.to(tl.int64) * NBND
    one = pos == 0
    if LOCAL:
        if unsorted != 0:
            tl.atomic_max(state_ptr + 0, 1)
            _store_id_range(bbase, g, inb, one)
        else:  # sorted: the first and last ids are the range
            tl.store(bbase + 4 + pos * 0, g, mask=one)
            tl.store(bbase + 5 + pos * 0, g, mask=pos == last_pos)
    else:
        _store_id_range(bbase, g, inb, one)
    if LOCAL:
        ok, rn = _load_native(r_ptr, ok_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
        r = rn.to(tl.float64)
        rx = _exact32(rn)
        start = (pos == 0) | (g != gp)
        gn = tl.load(g_ptr + offs + 1, mask=offs + 1 < n, other=0)
        end = (pos >= last_pos) | (g != gn)
        # run of each row: its last position e (and first position s), and the run's totals, read at e
        # from inclusive segmented scans (a gather through shared memory instead of reverse scans)
        e = tl.associative_scan(tl.where(end, pos, CHUNK), 0, _min2, reverse=True)
        s = tl.associative_scan(tl.where(start, pos, 0), 0, _max2)
        cnt0 = ok.to(tl.int32) + tl.where(start, _FLAG, 0)
        lo0 = tl.where(ok, rx, float("inf"))
        hi0 = tl.where(ok, rx, -float("inf"))
        cnt, tot, lo, hi = tl.associative_scan((cnt0, r, lo0, hi0), 0, _seg_stats)
        cnt = (tl.gather(cnt, e, 0) & (_FLAG - 1)).to(tl.float64)
        mean = tl.gather(tot, e, 0) / tl.maximum(cnt, 1.0)
        lo = tl.gather(lo, e, 0)
        hi = tl.gather(hi, e, 0)
        d = r - mean
        _, m2 = tl.associative_scan((start, tl.where(ok, d * d, 0.0)), 0, _seg_add1)
        m2 = tl.gather(m2, e, 0)
        differs = hi != lo
        adv = _adv_math(r, d, cnt, m2, differs, ok, 0.0, 0.0, eps, ESTIMATOR, UNBIASED, EPS_IN_SQRT, SINGLETON_RAW,
                        SCALE, out_ptr.dtype.element_ty)
        if HAS_FLAGS:
            f = tl.load(flag_ptr + offs, mask=inb, other=0) != 0
            adv = tl.where(f, tl.minimum(adv, 0.0), adv)
        # runs cut by the chunk's edges wait for _stitch_kernel
        g_first = tl.load(g_ptr + c0)
        open_left = (c0 > 0) & (g_first == tl.load(g_ptr + c0 - 1, mask=c0 > 0, other=0))
        g_last = tl.load(g_ptr + c0 + last_pos)
        has_next = c0 + last_pos + 1 < n
        open_right = has_next & (g_last == tl.load(g_ptr + c0 + last_pos + 1, mask=has_next, other=0))
        # (tl.where: the interpreter turns a block & scalar of booleans into integers)
        cut = tl.where(s == 0, open_left, False) | tl.where(e == last_pos, open_right, False)
        tl.store(out_ptr + offs, adv.to(out_ptr.dtype.element_ty), mask=inb & (cut == False))  # noqa: E712
        # the first and last runs' partials, each written by the one lane that holds it
        last = pos == last_pos
        pbase = part_ptr + pid.to(tl.int64) * NPART + pos * 0
        for k in tl.static_range(2):
            lane = one if k == 0 else last
            tl.store(pbase + 5 * k + 0, cnt, mask=lane)
            tl.store(pbase + 5 * k + 1, mean, mask=lane)
            tl.store(pbase + 5 * k + 2, m2, mask=lane)
            tl.store(pbase + 5 * k + 3, lo.to(tl.float64), mask=lane)
            tl.store(pbase + 5 * k + 4, hi.to(tl.float64), mask=lane)
        tl.store(bbase + 0 + pos * 0, c0 + e + 1, mask=one)  # end (exclusive) of the first run
        tl.store(bbase + 1 + pos * 0, c0 + s, mask=last)  # start of the last run
        tl.store(bbase + 2 + pos * 0, tl.where(s == 0, 1, 2).to(tl.int64), mask=last)  # 1: one run only
        tl.store(bbase + 3, (open_left.to(tl.int64)) + 2 * (open_right.to(tl.int64)))


@triton.jit
def _merge(na, ma, qa, nb, mb, qb):
    """Chan et al.'s pairwise update of (count, mean, M2); empty sides are neutral."""
    n = na + nb
    delta = mb - ma
    w = nb / tl.maximum(n, 1.0)
    m = tl.where(na == 0.0, mb, tl.where(nb == 0.0, ma, ma + delta * w))
    q = tl.where(na == 0.0, qb, tl.where(nb == 0.0, qa, qa + qb + delta * delta * na * w))
    return n, m, q


@triton.jit
def _stitch_kernel(r_ptr, g_ptr, ok_ptr, flag_ptr, out_ptr, part_ptr, bnd_ptr, state_ptr, n, nchunks, eps,
                   ESTIMATOR: tl.constexpr, UNBIASED: tl.constexpr, EPS_IN_SQRT: tl.constexpr,
                   SINGLETON_RAW: tl.constexpr, SCALE: tl.constexpr, HAS_OK: tl.constexpr, HAS_FLAGS: tl.constexpr,
                   SKIP_NONFINITE: tl.constexpr, WALK_LIMIT: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if tl.load(state_ptr + 0) == 0:
        edges = tl.load(bnd_ptr + pid * NBND + 3)
        nseg = tl.load(bnd_ptr + pid * NBND + 2)
        # this program owns the run that starts in its chunk and goes on into the next one
        if ((edges & 2) != 0) & (((nseg == 1) & ((edges & 1) != 0)) == 0):
            p = part_ptr + pid * NPART
            cn = tl.load(p + 5)
            mn = tl.load(p + 6)
            q = tl.load(p + 7)
            lo = tl.load(p + 8)
            hi = tl.load(p + 9)
            j = pid + 1
            going = j > pid
            while going:
                pj = part_ptr + j * NPART
                cn, mn, q = _merge(cn, mn, q, tl.load(pj + 0), tl.load(pj + 1), tl.load(pj + 2))
                lo = tl.minimum(lo, tl.load(pj + 3), propagate_nan=tl.PropagateNan.ALL)
                hi = tl.maximum(hi, tl.load(pj + 4), propagate_nan=tl.PropagateNan.ALL)
                ej = tl.load(bnd_ptr + j * NBND + 3)
                sj = tl.load(bnd_ptr + j * NBND + 2)
                going = (sj == 1) & ((ej & 2) != 0) & (j - pid < WALK_LIMIT)
                j += 1
            j -= 1
            if j - pid >= WALK_LIMIT:
                tl.atomic_max(state_ptr + 0, 2)  # a very long run: the general route redoes the batch
            else:
                lo_row = tl.load(bnd_ptr + pid * NBND + 1)
                hi_row = tl.load(bnd_ptr + j * NBND + 0)
                differs = hi != lo
                for s in range(lo_row, hi_row, CHUNK):
                    offs = s + tl.arange(0, CHUNK)
                    inb = offs < hi_row
                    ok, r = _load_rows(r_ptr, ok_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
                    adv = _adv_math(r, r - mn, cn, q, differs, ok, 0.0, 0.0, eps, ESTIMATOR, UNBIASED, EPS_IN_SQRT,
                                    SINGLETON_RAW, SCALE, out_ptr.dtype.element_ty)
                    if HAS_FLAGS:
                        f = tl.load(flag_ptr + offs, mask=inb, other=0) != 0
                        adv = tl.where(f, tl.minimum(adv, 0.0), adv)
                    tl.store(out_ptr + offs, adv.to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _idrange_kernel(bnd_ptr, state_ptr, nchunks, BLOCK: tl.constexpr):
    """One program: the batch's min and max id (state[1], state[2]) from the chunks' ranges, only when
    the general route runs (it indexes its table by ``id - min``)."""
    if tl.load(state_ptr + 0) != 0:
        lo = tl.full([BLOCK], _MAX_ID, tl.int64)
        hi = tl.full([BLOCK], _MIN_ID, tl.int64)
        for c in range(0, nchunks, BLOCK):
            offs = c + tl.arange(0, BLOCK).to(tl.int64)
            m = offs < nchunks
            lo = tl.minimum(lo, tl.load(bnd_ptr + offs * NBND + 4, mask=m, other=_MAX_ID))
            hi = tl.maximum(hi, tl.load(bnd_ptr + offs * NBND + 5, mask=m, other=_MIN_ID))
        tl.store(state_ptr + 1, tl.min(lo, axis=0))
        tl.store(state_ptr + 2, tl.max(hi, axis=0))


# ------------------------------------------------------------------ general route
@triton.jit
def _hash(key):
    # splitmix64's finaliser on the 64-bit key (uint64 arithmetic wraps)
    x = key.to(tl.uint64, bitcast=True)
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _table_size(state_ptr, CAP):
    """(direct, hashed, size): direct indexing by ``id - min`` when the id range fits the table, else hashing."""
    lo = tl.load(state_ptr + 1)
    hi = tl.load(state_ptr + 2)
    span = (hi - lo).to(tl.uint64, bitcast=True)  # wraps into [0, 2^64) for any int64 range
    direct = span < CAP.to(tl.uint64)
    hashed = span >= CAP.to(tl.uint64)
    size = tl.where(direct, span.to(tl.int64) + 1, CAP)
    return direct, hashed, size


# A group's record in the table: 32 bytes, one memory sector, so the fields a row reads in one pass
# come in one transaction: float64 words [sum, M2, representative reward, (count int32, differs int32)]
_REC: tl.constexpr = tl.constexpr(4)  # float64 words a record
_SUM: tl.constexpr = tl.constexpr(0)
_M2: tl.constexpr = tl.constexpr(1)
_REP: tl.constexpr = tl.constexpr(2)
_CNT32: tl.constexpr = tl.constexpr(6)  # int32 words from the record's start (the view tab32 of the same buffer)
_DIFF32: tl.constexpr = tl.constexpr(7)


@triton.jit
def _table_init_kernel(state_ptr, tab_ptr, key_ptr, CAP, BLOCK: tl.constexpr):
    """Zero the part of the group table the general route uses (keys to the empty mark -1)."""
    if tl.load(state_ptr + 0) != 0:
        direct, hashed, size = _table_size(state_ptr, CAP)
        words = (size + 2) * _REC  # two spare slots: the key -1 and the masked lanes of the probe
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(words, BLOCK), tl.num_programs(0)):  # grid-stride
            offs = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            tl.store(tab_ptr + offs, tl.zeros([BLOCK], tl.float64), mask=offs < words)
            tl.store(key_ptr + offs, tl.full([BLOCK], -1, tl.int64), mask=tl.where(offs < size + 2, hashed, False))


@triton.jit
def _slot_kernel(g_ptr, slot_ptr, key_ptr, state_ptr, n, CAP, BLOCK: tl.constexpr):
    """Row -> hash-table slot, the key's place in the table (the key ``id - min = -1``, only possible
    for ids spanning all of int64, has the spare slot ``CAP``). Direct indexing needs no slot array:
    the passes read ``id - min`` from the ids themselves (see :func:`_row_slot`)."""
    direct, hashed, size = _table_size(state_ptr, CAP)
    if (tl.load(state_ptr + 0) != 0) & hashed:
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(n, BLOCK), tl.num_programs(0)):  # grid-stride
            offs = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            inb = offs < n
            key = tl.load(g_ptr + offs, mask=inb, other=0) - tl.load(state_ptr + 1)  # wraps like the span
            mask = (CAP - 1).to(tl.int64)
            slot = (_hash(key) & mask.to(tl.uint64)).to(tl.int64)
            pending = inb & (key != -1)
            while tl.max(pending.to(tl.int32), axis=0) > 0:
                addr = tl.where(pending, slot, CAP + 1)  # settled lanes hit the unused spare slot
                old = tl.atomic_cas(key_ptr + addr, tl.full([BLOCK], -1, tl.int64), tl.where(pending, key, -2))
                found = pending & ((old == -1) | (old == key))
                slot = tl.where(pending & (found == 0), (slot + 1) & mask, slot)
                pending = pending & (found == 0)
            slot = tl.where(key == -1, CAP, slot)
            tl.store(slot_ptr + offs, slot, mask=inb)


@triton.jit
def _row_slot(g_ptr, s_ptr, state_ptr, offs, inb, CAP):
    """The rows' table slots: ``id - min`` read from the ids when the table is indexed directly (no
    slot array written or read), else the hash slots ``_slot_kernel`` stored."""
    direct, hashed, size = _table_size(state_ptr, CAP)
    if direct:
        g = tl.load(g_ptr + offs, mask=inb, other=0) - tl.load(state_ptr + 1)
    else:
        g = tl.load(s_ptr + offs, mask=inb, other=0)
    return g


@triton.jit
def _stats_kernel(r_ptr, g_ptr, s_ptr, ok_ptr, state_ptr, tab_ptr, tab32_ptr, bsum_ptr, n, CAP,
                  HAS_OK: tl.constexpr, SKIP_NONFINITE: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(state_ptr + 0) != 0:
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(n, BLOCK), tl.num_programs(0)):  # grid-stride
            offs = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            inb = offs < n
            ok, r = _load_rows(r_ptr, ok_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
            g = _row_slot(g_ptr, s_ptr, state_ptr, offs, inb, CAP)
            tl.atomic_add(tab32_ptr + g * (2 * _REC) + _CNT32, tl.full([BLOCK], 1, tl.int32), mask=ok)
            tl.atomic_add(tab_ptr + g * _REC + _SUM, r, mask=ok)
            tl.store(tab_ptr + g * _REC + _REP, r, mask=ok)  # any member will do: a benign race
            tl.atomic_add(bsum_ptr + 0, tl.sum(tl.where(ok, r, 0.0), axis=0))
            tl.atomic_add(bsum_ptr + 1, tl.sum(tl.where(ok, 1.0, 0.0).to(tl.float64), axis=0))


@triton.jit
def _row_group(r_ptr, g_ptr, s_ptr, ok_ptr, state_ptr, tab_ptr, tab32_ptr, offs, inb, CAP, HAS_OK: tl.constexpr,
               SKIP_NONFINITE: tl.constexpr):
    """A block of rows with their group's count and mean: (ok, reward, slot, count, mean)."""
    ok, r = _load_rows(r_ptr, ok_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
    g = _row_slot(g_ptr, s_ptr, state_ptr, offs, inb, CAP)
    c = tl.load(tab32_ptr + g * (2 * _REC) + _CNT32, mask=ok, other=1).to(tl.float64)
    return ok, r, g, c, tl.load(tab_ptr + g * _REC + _SUM, mask=ok, other=0.0) / c


@triton.jit
def _dev_kernel(r_ptr, g_ptr, s_ptr, ok_ptr, state_ptr, tab_ptr, tab32_ptr, bsum_ptr, n, CAP, HAS_OK: tl.constexpr,
                SKIP_NONFINITE: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(state_ptr + 0) != 0:
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(n, BLOCK), tl.num_programs(0)):  # grid-stride
            offs = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            inb = offs < n
            ok, r, g, c, mean = _row_group(r_ptr, g_ptr, s_ptr, ok_ptr, state_ptr, tab_ptr, tab32_ptr, offs, inb, CAP,
                                           HAS_OK, SKIP_NONFINITE)
            d = r - mean
            rep = tl.load(tab_ptr + g * _REC + _REP, mask=ok, other=0.0)
            tl.atomic_add(tab_ptr + g * _REC + _M2, d * d, mask=ok)
            tl.atomic_max(tab32_ptr + g * (2 * _REC) + _DIFF32, (r != rep).to(tl.int32), mask=ok)
            bcnt = tl.load(bsum_ptr + 1)
            bmean = tl.load(bsum_ptr + 0) / tl.maximum(bcnt, 1.0)
            bd = tl.where(ok, r - bmean, 0.0)
            tl.atomic_add(bsum_ptr + 2, tl.sum(bd * bd, axis=0))


@triton.jit
def _advantage_kernel(r_ptr, g_ptr, s_ptr, ok_ptr, flag_ptr, state_ptr, tab_ptr, tab32_ptr, bsum_ptr, out_ptr, a_ptr,
                      n, CAP, eps, ESTIMATOR: tl.constexpr, UNBIASED: tl.constexpr, EPS_IN_SQRT: tl.constexpr,
                      SINGLETON_RAW: tl.constexpr, SCALE: tl.constexpr, HAS_OK: tl.constexpr, HAS_FLAGS: tl.constexpr,
                      SKIP_NONFINITE: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(state_ptr + 0) != 0:
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(n, BLOCK), tl.num_programs(0)):  # grid-stride
            offs = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            inb = offs < n
            ok, r, g, c, mean = _row_group(r_ptr, g_ptr, s_ptr, ok_ptr, state_ptr, tab_ptr, tab32_ptr, offs, inb, CAP,
                                           HAS_OK, SKIP_NONFINITE)
            m2 = tl.load(tab_ptr + g * _REC + _M2, mask=ok, other=0.0)
            differs = tl.load(tab32_ptr + g * (2 * _REC) + _DIFF32, mask=ok, other=0) != 0
            adv = _adv_math(r, r - mean, c, m2, differs, ok, tl.load(bsum_ptr + 1), tl.load(bsum_ptr + 2), eps,
                            ESTIMATOR, UNBIASED, EPS_IN_SQRT, SINGLETON_RAW, SCALE,
                            tl.float64 if ESTIMATOR == 3 else out_ptr.dtype.element_ty)
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
def _row_whiten(a_ptr, r_ptr, ok_ptr, bsum_ptr, offs, inb, HAS_OK: tl.constexpr, SKIP_NONFINITE: tl.constexpr):
    """A block of rows' pre-whitening advantages with the batch count and their mean: (ok, a, count, mean)."""
    ok, _ = _load_rows(r_ptr, ok_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
    bcnt = tl.load(bsum_ptr + 1)
    return ok, tl.load(a_ptr + offs, mask=inb, other=0.0), bcnt, tl.load(bsum_ptr + 3) / tl.maximum(bcnt, 1.0)


@triton.jit
def _whiten_dev_kernel(a_ptr, r_ptr, ok_ptr, state_ptr, bsum_ptr, adiff_ptr, n, HAS_OK: tl.constexpr,
                       SKIP_NONFINITE: tl.constexpr, BLOCK: tl.constexpr):
    # second pass over the pre-whitening advantages: sum (a - mean(a))^2 (no E[a^2] - E[a]^2
    # cancellation) and "some a differs from the representative"
    if tl.load(state_ptr + 0) != 0:
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(n, BLOCK), tl.num_programs(0)):  # grid-stride
            offs = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            inb = offs < n
            ok, a, bcnt, amean = _row_whiten(a_ptr, r_ptr, ok_ptr, bsum_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
            d = tl.where(ok, a - amean, 0.0)
            tl.atomic_add(bsum_ptr + 4, tl.sum(d * d, axis=0))
            rep = tl.load(bsum_ptr + 5)
            tl.atomic_max(adiff_ptr + 0, tl.max(tl.where(ok & (a != rep), 1, 0).to(tl.int32), axis=0))


@triton.jit
def _whiten_kernel(a_ptr, r_ptr, ok_ptr, flag_ptr, state_ptr, bsum_ptr, adiff_ptr, out_ptr, n, eps,
                   UNBIASED: tl.constexpr, HAS_OK: tl.constexpr, HAS_FLAGS: tl.constexpr,
                   SKIP_NONFINITE: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(state_ptr + 0) != 0:
        for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(n, BLOCK), tl.num_programs(0)):  # grid-stride
            offs = tl.arange(0, BLOCK).to(tl.int64) + b * BLOCK
            inb = offs < n
            ok, a, bcnt, amean = _row_whiten(a_ptr, r_ptr, ok_ptr, bsum_ptr, offs, inb, HAS_OK, SKIP_NONFINITE)
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


# ------------------------------------------------------------------ launcher
def _local(estimator: int, scale: int) -> bool:
    """Estimators whose statistics are per group only (the sorted route handles them)."""
    return estimator in (1, 2) or (estimator == 0 and scale != 1)


def table_capacity(n: int) -> int:
    """Slots of the general route's group table: a power of two >= 2 n (hash load <= 1/2)."""
    return max(16, 1 << (2 * n - 1).bit_length())


def grpo_advantages_triton(rewards, group_ids, valid, flags, estimator, unbiased, eps, eps_in_sqrt, singleton_raw,
                           scale, skip_nonfinite):
    """Triton backend; arguments as the ``treadle::grpo_advantages`` custom op (contiguous inputs)."""
    n = rewards.numel()
    dev = rewards.device
    local = _local(estimator, scale)
    has_ok = valid is not None
    ok8 = valid.view(torch.int8) if has_ok else rewards  # never read without HAS_OK
    fl = flags.view(torch.int8) if flags is not None else ok8
    out = torch.empty_like(rewards)
    # [route flag (0: sorted route done; 1: not a group-local estimator; 1/2: unsorted / long run), min id,
    # max id (written by _idrange_kernel when the flag is up)]
    state = torch.zeros(4, dtype=torch.int64, device=dev)
    if not local:
        state[0].fill_(1)
    nchunks = triton.cdiv(n, CHUNK)
    part = torch.empty(nchunks * NPART if local else 1, dtype=torch.float64, device=dev)
    bnd = torch.empty(nchunks * NBND, dtype=torch.int64, device=dev)
    opts = dict(ESTIMATOR=estimator, UNBIASED=unbiased, EPS_IN_SQRT=eps_in_sqrt, SINGLETON_RAW=singleton_raw,
                SCALE=scale, HAS_OK=has_ok, HAS_FLAGS=flags is not None, SKIP_NONFINITE=skip_nonfinite)
    _runs_kernel[(nchunks,)](rewards, group_ids, ok8, fl, out, part, bnd, state, n, float(eps), LOCAL=local,
                             CHUNK=CHUNK, **opts)
    if local:
        _stitch_kernel[(nchunks,)](rewards, group_ids, ok8, fl, out, part, bnd, state, n, nchunks, float(eps),
                                   WALK_LIMIT=WALK_LIMIT, CHUNK=CHUNK, **opts)
    _idrange_kernel[(1,)](bnd, state, nchunks, BLOCK=BLOCK)
    # general route: always launched, returns at once unless the flag is up
    cap = table_capacity(n)
    f64 = dict(dtype=torch.float64, device=dev)
    tab = torch.empty((cap + 2) * 4, **f64)  # 32-byte group records (see _REC)
    tab32 = tab.view(torch.int32)
    keys = torch.empty(cap + 2, dtype=torch.int64, device=dev)
    slot = torch.empty(n, dtype=torch.int64, device=dev)
    bsum = torch.zeros(8, **f64)  # [sum r, count, sum (r - mean)^2, sum a, sum (a - mean a)^2, representative a]
    a = torch.empty(n if estimator == 3 else 1, **f64)
    grid = (min(triton.cdiv(n, BLOCK), MAX_PROGRAMS),)
    _table_init_kernel[grid](state, tab, keys, cap, BLOCK=BLOCK)
    _slot_kernel[grid](group_ids, slot, keys, state, n, cap, BLOCK=BLOCK)
    sk = dict(HAS_OK=has_ok, SKIP_NONFINITE=skip_nonfinite, BLOCK=BLOCK)
    _stats_kernel[grid](rewards, group_ids, slot, ok8, state, tab, tab32, bsum, n, cap, **sk)
    _dev_kernel[grid](rewards, group_ids, slot, ok8, state, tab, tab32, bsum, n, cap, **sk)
    _advantage_kernel[grid](rewards, group_ids, slot, ok8, fl, state, tab, tab32, bsum, out, a, n, cap,
                            float(eps),
                            ESTIMATOR=estimator, UNBIASED=unbiased, EPS_IN_SQRT=eps_in_sqrt,
                            SINGLETON_RAW=singleton_raw, SCALE=scale, HAS_OK=has_ok, HAS_FLAGS=flags is not None,
                            SKIP_NONFINITE=skip_nonfinite, BLOCK=BLOCK)
    if estimator == 3:
        adiff = torch.zeros(1, dtype=torch.int32, device=dev)
        _whiten_dev_kernel[grid](a, rewards, ok8, state, bsum, adiff, n, **sk)
        _whiten_kernel[grid](a, rewards, ok8, fl, state, bsum, adiff, out, n, float(eps), UNBIASED=unbiased,
                             HAS_OK=has_ok, HAS_FLAGS=flags is not None, SKIP_NONFINITE=skip_nonfinite, BLOCK=BLOCK)
    return out


# ------------------------------------------------------------------ sm_90a structure check
def aot_specs() -> list[AotSpec]:
    """Every kernel at its launch config (fp32 rewards, int64 ids, bool masks and flags: the GPU
    figures' case; the estimator constexprs at the sorted route's default and ``reinforce_baseline``).
    None of these kernels uses tensor cores or TMA: the check guards registers and spills."""
    specs = []
    est = dict(ESTIMATOR=0, UNBIASED=True, EPS_IN_SQRT=False, SINGLETON_RAW=False, SCALE=0)
    for has_ok in (False, True):
        for fl in (False, True):
            ptrs = ("r_ptr", "g_ptr", "ok_ptr", "flag_ptr", "out_ptr", "part_ptr", "bnd_ptr", "state_ptr")
            sig = {"r_ptr": "*fp32", "g_ptr": "*i64", "ok_ptr": "*i8", "flag_ptr": "*i8", "out_ptr": "*fp32",
                   "part_ptr": "*fp64", "bnd_ptr": "*i64", "state_ptr": "*i64", "n": "i32", "eps": "fp32"}
            c = dict(est, HAS_OK=has_ok, HAS_FLAGS=fl, SKIP_NONFINITE=False, CHUNK=CHUNK)
            tag = f"CHUNK{CHUNK}-w4{'-valid' if has_ok else ''}{'-flags' if fl else ''}"
            specs.append(AotSpec("grpo_runs", tag, _runs_kernel, {**sig, **{k: "constexpr" for k in [*c, "LOCAL"]}},
                                 dict(c, LOCAL=True), divisible_by_16=ptrs + ("n",), num_warps=4, num_stages=1))
            sig2 = dict(sig, nchunks="i32")
            c2 = dict(c, WALK_LIMIT=WALK_LIMIT)
            specs.append(AotSpec("grpo_stitch", tag, _stitch_kernel, {**sig2, **{k: "constexpr" for k in c2}}, c2,
                                 divisible_by_16=ptrs + ("n",), num_warps=4, num_stages=1))
    b = dict(BLOCK=BLOCK)
    specs.append(AotSpec("grpo_idrange", f"BLOCK{BLOCK}-w4", _idrange_kernel,
                         {"bnd_ptr": "*i64", "state_ptr": "*i64", "nchunks": "i32", "BLOCK": "constexpr"}, b,
                         divisible_by_16=("bnd_ptr", "state_ptr"), num_warps=4))
    specs.append(AotSpec("grpo_table_init", f"BLOCK{BLOCK}-w4", _table_init_kernel,
                         {"state_ptr": "*i64", "tab_ptr": "*fp64", "key_ptr": "*i64", "CAP": "i32",
                          "BLOCK": "constexpr"}, b, divisible_by_16=("state_ptr", "tab_ptr", "key_ptr", "CAP"),
                         num_warps=4))
    specs.append(AotSpec("grpo_slot", f"BLOCK{BLOCK}-w4", _slot_kernel,
                         {"g_ptr": "*i64", "slot_ptr": "*i64", "key_ptr": "*i64", "state_ptr": "*i64", "n": "i32",
                          "CAP": "i32", "BLOCK": "constexpr"}, b,
                         divisible_by_16=("g_ptr", "slot_ptr", "key_ptr", "state_ptr", "n", "CAP"), num_warps=4))
    sk = dict(HAS_OK=True, SKIP_NONFINITE=True, BLOCK=BLOCK)
    row = {"r_ptr": "*fp32", "g_ptr": "*i64", "s_ptr": "*i64", "ok_ptr": "*i8", "state_ptr": "*i64"}
    table = {"tab_ptr": "*fp64", "tab32_ptr": "*i32"}
    const = {k: "constexpr" for k in sk}
    for name, fn in (("grpo_stats", _stats_kernel), ("grpo_dev", _dev_kernel)):
        specs.append(AotSpec(name, f"BLOCK{BLOCK}-w4", fn,
                             {**row, **table, "bsum_ptr": "*fp64", "n": "i32", "CAP": "i32", **const}, sk,
                             divisible_by_16=tuple(row) + tuple(table) + ("bsum_ptr", "n", "CAP"), num_warps=4))
    for e in (0, 3):
        ca = dict(est, ESTIMATOR=e, HAS_OK=True, HAS_FLAGS=True, SKIP_NONFINITE=True, BLOCK=BLOCK)
        specs.append(AotSpec("grpo_advantage", f"est{e}-BLOCK{BLOCK}-w4", _advantage_kernel,
                             {**row, "flag_ptr": "*i8", **table, "bsum_ptr": "*fp64", "out_ptr": "*fp32",
                              "a_ptr": "*fp64", "n": "i32", "CAP": "i32", "eps": "fp32",
                              **{k: "constexpr" for k in ca}}, ca,
                             divisible_by_16=tuple(row) + ("flag_ptr",) + tuple(table) + ("bsum_ptr", "out_ptr",
                                                                                           "a_ptr", "n", "CAP"),
                             num_warps=4))
    wsig = {"a_ptr": "*fp64", "r_ptr": "*fp32", "ok_ptr": "*i8", "state_ptr": "*i64", "bsum_ptr": "*fp64",
            "adiff_ptr": "*i32", "n": "i32"}
    specs.append(AotSpec("grpo_whiten_dev", f"BLOCK{BLOCK}-w4", _whiten_dev_kernel, {**wsig, **const}, sk,
                         divisible_by_16=tuple(wsig), num_warps=4))
    cw = dict(UNBIASED=True, HAS_OK=True, HAS_FLAGS=True, SKIP_NONFINITE=True, BLOCK=BLOCK)
    specs.append(AotSpec("grpo_whiten", f"BLOCK{BLOCK}-w4", _whiten_kernel,
                         {**wsig, "flag_ptr": "*i8", "out_ptr": "*fp32", "eps": "fp32",
                          **{k: "constexpr" for k in cw}}, cw,
                         divisible_by_16=tuple(wsig) + ("flag_ptr", "out_ptr"), num_warps=4))
    return specs

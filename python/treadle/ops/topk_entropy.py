"""``treadle.ops.topk_entropy``: SCALE's Stage-II objective (SCALE sec. 4.3), from logits or chunked from hidden states.

Per position with logits ``z (V,)``: take the ``k`` largest logits ``z_(1..k)``, renormalise
``p_i = exp(z_i - lse_k)`` with ``lse_k = logsumexp(z_(1..k))``, entropy ``H = -sum_i p_i log p_i``
in nats, normalised ``H / log k`` in ``[0, 1]``. The objective is the mean over response positions.

Gradient (``H = lse_k - sum_i p_i z_i``): ``dH/dz_i = -p_i (log p_i + H) = -p_i (z_i - lse_k + H)`` for
the k selected entries, 0 elsewhere. It depends on the logit's value only, so entries that tie
*inside* the top-k get the same gradient whichever index ``torch.topk`` reports.

Ties at the k-th value (deterministic rule): with threshold ``t`` (the k-th largest value), every
entry ``> t`` is selected, and of the entries ``== t`` the ``k - #(> t)`` with the lowest vocabulary
indices are. The value does not depend on the rule (tied entries have equal probability); the
gradient lands on those lowest-index entries, whatever order ``torch.topk`` uses on the device.

``k > V`` raises (no silent clamp: a clamped k would change the ``log k`` normaliser and the
meaning of the objective); ``k < 2`` raises (``log 1 = 0``).

Non-finite logits at a considered position: ``-inf`` entries have probability 0 and ``0 log 0 = 0``
(fewer than k finite logits is fine: ``[0, 0, -inf x 7]`` with k = 4 gives ``log 2 / log 4``), with
zero gradient on them; a row of all ``-inf`` gives 0 with zero gradient; a row with ``+inf`` entries
gives the limit distribution, uniform over its ``+inf`` entries, with zero gradient (finite
changes do not move it); NaN gives NaN (value and the selected entries' gradient). Positions outside
``mask`` are never read, whatever they hold.

Implementation: plain PyTorch ops (``torch.topk`` + elementwise), in float32 (float64 for float64
inputs), wrapped as ``torch.library`` custom ops with fake implementations and registered
autograd. There is no C++ or Triton kernel for these two ops (``treadle backends`` says so): the
same code runs on every device. The backward is one elementwise pass over the logits using per-row statistics saved by
the forward (``lse_k``, ``H``, ``t``: O(N) memory). The chunked form
:func:`topk_entropy_from_hidden` computes ``logits = hidden @ lm_head_weight^T`` ``chunk_size`` rows at
a time (16-bit logits stay 16-bit: the top-k order and values are the same in float32) and keeps the
gradient of each row as it is, sparse: k indices and k weights. The backward is then a gather of k
head rows a token (``d hidden``) and, only when the head is trained, one GEMM per chunk (``d weight``):
no second logits GEMM, and neither the ``(N, V)`` logits nor their fp32 softmax or gradient exist.
"""
from __future__ import annotations

import math

import torch

from treadle.ops.dtensor import refuse_dtensor as _refuse_dtensor
from treadle import dispatch
from treadle.ops import _amp
from treadle.ops._values import values_readable

OP = "topk_entropy"
OP_HIDDEN = "topk_entropy_from_hidden"
# Listed in treadle.backends() as running the PyTorch path on every device: there is no C++ or
# Triton kernel for top-k entropy yet, so TREADLE_BACKEND does not apply to these two ops.
dispatch.register(OP, cpu=(), gpu=(), note="PyTorch ops (torch.topk); no C++/Triton kernel")
dispatch.register(OP_HIDDEN, cpu=(), gpu=(), note="PyTorch ops (chunked matmul + torch.topk); no C++/Triton kernel")

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHUNK_ELEMENTS = 1 << 26  # default chunk: about 2^26 logits (256 MiB in fp32) at a time


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_stats(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``z (M, V)`` in the accumulation dtype -> ``(lse_k, H, t)`` each ``(M,)``; H in nats.

    ``lse_k`` and ``H`` are computed and returned in float64 from the k selected logits (k values a
    row: negligible next to the top-k over V). In float32 the backward's factor ``z - lse_k + H``
    cancels two numbers of size ~log k; rounding each once from float64 keeps the op's error within
    the project's rule (seen on an H200: the float32 statistics gave up to ~5x plain PyTorch's error).

    Non-finite logits (module docstring): ``-inf`` entries have probability 0 and ``0 log 0 = 0``;
    a row of all ``-inf`` gets H = 0; a row with ``+inf`` entries gets the limit distribution,
    uniform over its ``+inf`` entries (``lse_k`` is then ``+inf``, which the backward reads as "no
    gradient"); NaN logits give NaN.
    """
    vals = torch.topk(z, k, dim=-1, sorted=False).values
    thr = vals.amin(-1)
    vals = vals.to(torch.float64)
    lse = torch.logsumexp(vals, dim=-1)
    inf = float("inf")
    pinf = (lse == inf).unsqueeze(-1)
    if bool(pinf.any()):  # the limit as the +inf entries grow: uniform over them
        vals = torch.where(pinf, torch.where(vals == inf, 0.0, -inf), vals)
        lse_h = torch.logsumexp(vals, dim=-1)
    else:
        lse_h = lse
    logp = vals - torch.where(lse_h == -inf, 0.0, lse_h).unsqueeze(-1)  # all -inf: logp = -inf, p = 0
    p = logp.exp()
    h = 0.0 - torch.where(p == 0, 0.0, p * logp).sum(-1)  # 0 log 0 = 0; an all -inf row gives +0
    return lse, h, thr


def _row_grad(z: torch.Tensor, k: int, lse: torch.Tensor, h: torch.Tensor, thr: torch.Tensor,
              coef: torch.Tensor) -> torch.Tensor:
    """``coef_m * dH_m/dz`` for ``z (M, V)`` (accumulation dtype): ``-p (z - lse + H)`` on the selected
    entries (ties at the threshold: lowest indices first), 0 elsewhere, 0 on entries of probability 0
    (``-inf`` logits) and on rows whose ``lse`` is infinite (all ``-inf``, or ``+inf`` entries: the
    value does not move under finite changes); NaN on the selected entries of a NaN row."""
    sel = z > thr.unsqueeze(-1)
    need = k - sel.sum(-1)
    eq = z == thr.unsqueeze(-1)
    n_eq = eq.sum(-1)
    tied = (n_eq > need).nonzero().flatten()
    if tied.numel():  # more entries equal the k-th value than slots left: keep the lowest indices
        eq_t = eq[tied]
        eq[tied] = eq_t & (eq_t.cumsum(-1) <= need[tied].unsqueeze(-1))
    sel |= eq
    # lse and H arrive in float64 (_row_stats): round lse once for p, and lse - H once for the factor
    g = (z - lse.to(z.dtype).unsqueeze(-1)).exp_()
    keep = sel & ((g > 0) | torch.isnan(h).unsqueeze(-1)) & ~torch.isinf(lse).unsqueeze(-1)
    t = z - (lse - h).to(z.dtype).unsqueeze(-1)
    t.mul_(g).mul_((-coef).unsqueeze(-1))
    return t.masked_fill_(~keep, 0.0)


def _select(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x[mask]


def _scatter(vals: torch.Tensor, mask: torch.Tensor | None, m: int) -> torch.Tensor:
    """Per selected row ``vals`` -> ``(m, ...)`` with zeros at rows outside ``mask``."""
    if mask is None:
        return vals
    out = vals.new_zeros((m, *vals.shape[1:]))
    out[mask] = vals
    return out


# ---------------------------------------------------------------- from logits
@torch.library.custom_op("treadle::topk_entropy_rows", mutates_args=())
@_amp.no_autocast
def _topk_entropy_rows(logits: torch.Tensor, k: int, mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits (M, V)`` -> ``(H / log k (M,), [lse_k, H] (M, 2) float64, t (M,))``; ``H / log k`` and ``t``
    in fp32 (fp64 for fp64 logits).

    Rows outside ``mask`` (``(M,)`` bool) are never read: their outputs are 0."""
    m = logits.shape[0]
    acc = _acc(logits.dtype)
    lse, h, thr = _row_stats(_select(logits, mask).to(acc), k)
    return (_scatter((h / math.log(k)).to(acc), mask, m), _scatter(torch.stack([lse, h], -1), mask, m),
            _scatter(thr, mask, m))


@_topk_entropy_rows.register_fake
def _(logits, k, mask):
    m = logits.shape[0]
    acc = _acc(logits.dtype)
    return (logits.new_empty((m,), dtype=acc), logits.new_empty((m, 2), dtype=torch.float64),
            logits.new_empty((m,), dtype=acc))


@torch.library.custom_op("treadle::topk_entropy_rows_backward", mutates_args=())
@_amp.no_autocast
def _topk_entropy_rows_backward(grad: torch.Tensor, logits: torch.Tensor, stats: torch.Tensor, thr: torch.Tensor,
                                k: int, mask: torch.Tensor | None) -> torch.Tensor:
    """``grad (M,)`` on ``H / log k`` -> ``grad_logits (M, V)`` in the logits' dtype (0 outside ``mask``);
    ``stats (M, 2)`` float64 ``[lse_k, H]`` from the forward."""
    logk = math.log(k)
    acc = _acc(logits.dtype)
    st = _select(stats, mask)
    g = _row_grad(_select(logits, mask).to(acc), k, st[:, 0], st[:, 1], _select(thr, mask),
                  _select(grad, mask).to(acc) / logk)
    return _scatter(g.to(logits.dtype), mask, logits.shape[0])


@_topk_entropy_rows_backward.register_fake
def _(grad, logits, stats, thr, k, mask):
    return torch.empty_like(logits)


def _rows_setup(ctx, inputs, output):
    logits, k, mask = inputs
    hn, stats, thr = output
    ctx.save_for_backward(logits, stats, thr, mask)
    ctx.k = k
    ctx.mark_non_differentiable(stats, thr)


@_amp.no_autocast
def _rows_backward(ctx, grad_hn, grad_stats, grad_thr):
    logits, stats, thr, mask = ctx.saved_tensors
    return _topk_entropy_rows_backward(grad_hn, logits, stats, thr, ctx.k, mask), None, None


_topk_entropy_rows.register_autograd(_rows_backward, setup_context=_rows_setup)


# ---------------------------------------------------------------- chunked from hidden states
def _chunks(m: int, chunk: int):
    for s in range(0, m, chunk):
        yield s, min(s + chunk, m)


def _sparse_grad(z: torch.Tensor, k: int, lse: torch.Tensor, h: torch.Tensor, thr: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``H`` for one chunk of logits ``z (M, V)`` as ``(idx, w)``, each ``(M, k)``:
    ``dH/dz[m, idx[m, i]] = -w[m, i]`` (the factor ``(z - (lse - H)) exp(z - lse)`` of
    :func:`_row_grad`, same rounding), 0 on every other entry. The selected entries are the
    ``torch.topk`` ones except where more entries tie at the k-th value than slots are left: there the
    lowest indices (module docstring), recomputed from the row."""
    vals, idx = torch.topk(z, k, dim=-1, sorted=False)
    t = thr.unsqueeze(-1)
    need = k - (vals > t).sum(-1)
    tied = ((z == t).sum(-1) > need).nonzero().flatten()
    if tied.numel():  # rare: pick the lowest-index tied entries, as the dense backward does
        zt = z[tied]
        eq = zt == t[tied]
        sel = (zt > t[tied]) | (eq & (eq.cumsum(-1) <= need[tied].unsqueeze(-1)))
        idx[tied] = sel.nonzero()[:, 1].view(-1, k)
        vals[tied] = zt.gather(1, idx[tied])
    sel = (vals > t) | (vals == t)  # NaN rows select nothing, like the dense rule
    g = (vals - lse.to(z.dtype).unsqueeze(-1)).exp_()
    keep = sel & ((g > 0) | torch.isnan(h).unsqueeze(-1)) & ~torch.isinf(lse).unsqueeze(-1)
    w = (vals - (lse - h).to(z.dtype).unsqueeze(-1)).mul_(g)
    return idx, w.masked_fill_(~keep, 0.0)


@torch.library.custom_op("treadle::topk_entropy_hidden", mutates_args=())
@_amp.no_autocast
def _topk_entropy_hidden(hidden: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None, k: int,
                         chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden (M, d)``, ``weight (V, d)`` -> ``(H / log k (M,), idx (M, k), w (M, k))`` (0 at rows
    outside ``mask``, never read); logits ``chunk_size`` rows at a time, top-k taken on the logits in
    their own dtype (the order is the same in float32). ``idx, w`` are the sparse gradient of H
    (:func:`_sparse_grad`): the backward needs no second pass over the logits."""
    acc = _acc(hidden.dtype)
    rows = _select(hidden, mask)
    m = rows.shape[0]
    out = hidden.new_empty((m,), dtype=acc)
    idx = torch.empty((m, k), dtype=torch.int64, device=hidden.device)
    w = hidden.new_empty((m, k), dtype=acc)
    for s, e in _chunks(m, chunk_size):
        z = rows[s:e] @ weight.t()
        if z.dtype != acc and hidden.dtype != torch.bfloat16 and hidden.dtype != torch.float16:
            z = z.to(acc)
        lse, h, thr = _row_stats_lowp(z, k, acc)
        out[s:e] = h
        idx[s:e], w[s:e] = _sparse_grad_lowp(z, k, lse, h, thr, acc)
        del z
    return _scatter(out / math.log(k), mask, hidden.shape[0]), _scatter(idx, mask, hidden.shape[0]), \
        _scatter(w, mask, hidden.shape[0])


def _row_stats_lowp(z: torch.Tensor, k: int, acc: torch.dtype):
    """:func:`_row_stats` of logits kept in a 16-bit dtype: the top-k and its threshold are found on
    them (exact: converting to float32 keeps the order and the values), the rest in ``acc``."""
    if z.dtype == acc:
        return _row_stats(z, k)
    vals = torch.topk(z, k, dim=-1, sorted=False).values.to(acc)
    return _row_stats(vals, k)


def _sparse_grad_lowp(z: torch.Tensor, k: int, lse, h, thr, acc):
    if z.dtype == acc:
        return _sparse_grad(z, k, lse, h, thr)
    idx, _ = _sparse_grad(z, k, lse, h, thr.to(z.dtype))  # selection on the 16-bit logits (thr is exact)
    vals = z.gather(1, idx).to(acc)
    g = (vals - lse.to(acc).unsqueeze(-1)).exp_()
    t = thr.to(acc).unsqueeze(-1)
    sel = (vals > t) | (vals == t)
    keep = sel & ((g > 0) | torch.isnan(h).unsqueeze(-1)) & ~torch.isinf(lse).unsqueeze(-1)
    w = (vals - (lse - h).to(acc).unsqueeze(-1)).mul_(g)
    return idx, w.masked_fill_(~keep, 0.0)


@_topk_entropy_hidden.register_fake
def _(hidden, weight, mask, k, chunk_size):
    m = hidden.shape[0]
    acc = _acc(hidden.dtype)
    return (hidden.new_empty((m,), dtype=acc), hidden.new_empty((m, k), dtype=torch.int64),
            hidden.new_empty((m, k), dtype=acc))


@torch.library.custom_op("treadle::topk_entropy_hidden_backward", mutates_args=())
@_amp.no_autocast
def _topk_entropy_hidden_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor,
                                  w: torch.Tensor, mask: torch.Tensor | None, k: int, chunk_size: int,
                                  need_hidden: bool, need_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """From the forward's sparse gradient (k entries a row): ``d hidden[m] = sum_i G[m, i]
    weight[idx[m, i]]`` (a gather of k rows of the head and a batched GEMV, no logits GEMM) and
    ``d weight = G^T hidden`` per chunk, with ``G = -(grad / log k) w`` rounded to the hidden dtype
    (what the dense backward's GEMMs read)."""
    acc = _acc(hidden.dtype)
    logk = math.log(k)
    rows, grad, idx, w = _select(hidden, mask), _select(grad, mask), _select(idx, mask), _select(w, mask)
    dh = torch.zeros_like(rows)
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    # rows per step of the gather: about 2^26 gathered head elements at a time
    step = max(1, min(chunk_size, (1 << 26) // max(1, k * weight.shape[1])))
    for s, e in _chunks(rows.shape[0], step):
        g = w[s:e].mul((-(grad[s:e].to(acc) / logk)).unsqueeze(-1)).to(hidden.dtype)
        if need_hidden:
            dh[s:e] = torch.bmm(g.unsqueeze(1), weight[idx[s:e]]).squeeze(1)
        if need_weight:
            gd = torch.zeros((e - s, weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
            gd.scatter_(1, idx[s:e], g)
            dw.addmm_(gd.t().to(acc), rows[s:e].to(acc))
    return _scatter(dh, mask, hidden.shape[0]), (dw.to(weight.dtype) if need_weight else torch.zeros_like(weight))


@_topk_entropy_hidden_backward.register_fake
def _(grad, hidden, weight, idx, w, mask, k, chunk_size, need_hidden, need_weight):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _hidden_setup(ctx, inputs, output):
    hidden, weight, mask, k, chunk_size = inputs
    _, idx, w = output
    ctx.save_for_backward(hidden, weight, mask, idx, w)
    ctx.mark_non_differentiable(idx, w)
    ctx.args = (k, chunk_size)


@_amp.no_autocast
def _hidden_backward(ctx, grad, grad_idx, grad_w):
    hidden, weight, mask, idx, w = ctx.saved_tensors
    k, chunk_size = ctx.args
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_h or need_w):
        return None, None, None, None, None
    dh, dw = _topk_entropy_hidden_backward(grad, hidden, weight, idx, w, mask, k, chunk_size, need_h, need_w)
    return (dh if need_h else None), (dw if need_w else None), None, None, None


_topk_entropy_hidden.register_autograd(_hidden_backward, setup_context=_hidden_setup)


def peak_extra_bytes(tokens: int, vocab: int, d: int, k: int, chunk_size: int, itemsize: int = 2,
                     full_logits: bool = False) -> int:
    """Arithmetic peak of the extra memory (beyond inputs) of the forward + backward, in bytes.

    ``full_logits``: ``topk_entropy(hidden @ W^T)``: the logits, their float32 copy, the float32 and
    16-bit gradients of the logits. Else this op: one chunk's logits (16-bit) and the top-k temporaries,
    the saved sparse gradient (``tokens x k`` int64 + float32) and, in the backward, one step's gather
    of ``k`` head rows a token (about 2^26 elements)."""
    if full_logits:
        return tokens * vocab * (itemsize + 4 + 4 + itemsize) + tokens * d * itemsize
    chunk = min(chunk_size, tokens) * vocab * (itemsize + 1)  # logits + comparison masks of one chunk
    saved = tokens * k * (8 + 4)
    step = max(1, min(chunk_size, (1 << 26) // max(1, k * d)))
    gather = step * k * d * itemsize
    return max(chunk, gather) + saved + tokens * d * itemsize


# ---------------------------------------------------------------- public API
def _check_k(k, vocab: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be a Python int, got {type(k).__name__}")
    if k < 2:
        raise ValueError(f"k must be >= 2 (the entropy is divided by log k, and log 1 = 0), got {k}")
    if k > vocab:
        raise ValueError(f"k={k} is larger than the vocabulary size {vocab}; pass k <= {vocab} "
                         f"(treadle does not clamp k: that would change the log k normaliser)")
    return k


def _check_mask(mask, lead: torch.Size, device: torch.device) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor of dtype bool, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool (True at response positions), got {mask.dtype}")
    if mask.shape != lead:
        raise ValueError(f"mask must have shape {tuple(lead)} (the positions), got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but the logits/hidden states are on {device}")
    if values_readable(mask) and not bool(mask.any()):  # a value check: skipped while tracing and on meta
        raise ValueError("mask has no True (response) positions: the mean top-k entropy over them is undefined")


def topk_entropy(logits: torch.Tensor, k: int = 100, mask: torch.Tensor | None = None, *,
                 reduction: str = "mean") -> torch.Tensor:
    """Normalised top-k entropy of next-token distributions (SCALE sec. 4.3, the Stage-II objective).

    Args:
        logits: ``(..., V)`` float16/bfloat16/float32/float64 next-token logits (computed in float32,
            float64 for float64 input).
        k: number of largest logits kept per position, ``2 <= k <= V`` (SCALE: 100).
        mask: optional ``(...)`` bool, True at response positions; the mean runs over them. Must
            have at least one True. Positions outside the mask get zero gradient.
        reduction: ``"mean"`` (scalar) or ``"none"`` (``(...)`` per-position values; ``mask``
            must then be None).

    Returns:
        Scalar (or ``(...)``) in float32 (float64 for float64 logits), in ``[0, 1]``.

    Gradient with respect to ``logits`` is non-zero only on the k selected entries of each position;
    ties at the k-th value go to the lowest vocabulary indices (module docstring).

    Contract (tests/contracts):
        dtypes: logits of any float dtype are read as given and computed in float32 (float64 for
            float64); the gradient comes back in the logits' dtype.
        autocast: no effect (like ``log_softmax``, autocast's float32 list): logits used as given.
        masking: positions outside ``mask`` are never read (NaN/inf there change nothing) and get
            exactly zero gradient; non-finite logits at considered positions: module docstring.
        zero sizes: ``reduction="none"`` on zero positions gives an empty result connected to the
            graph; ``"mean"`` over zero positions raises ValueError (undefined). Under
            ``torch.compile`` the all-False mask check (a data check) is skipped and such a mean is
            0 / 0 = NaN.

    Raises:
        treadle.distributed.DTensorInputError (a TypeError): a DTensor input (convert it first).
        TypeError: non-tensor logits, a non-float dtype, non-int k, non-bool mask.
        ValueError: ``k < 2``, ``k > V``, a mask of the wrong shape/device or with no True position,
            an unknown reduction, a mask with ``reduction="none"``, logits with no vocabulary dim.
    """
    _refuse_dtensor("topk_entropy", logits=logits, mask=mask)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _FLOAT:
        raise TypeError(f"logits must have a floating dtype (one of {_FLOAT}), got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError("logits must have shape (..., V), got a scalar")
    k = _check_k(k, logits.shape[-1])
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if reduction == "none" and mask is not None:
        raise ValueError("mask applies to reduction='mean' only; with reduction='none' index the result instead")
    lead = logits.shape[:-1]
    _check_mask(mask, lead, logits.device)
    m = math.prod(lead)
    if m == 0 and reduction == "mean":
        raise ValueError(f"logits has no positions (shape {tuple(logits.shape)}): the mean is undefined")
    flat_mask = None if mask is None else mask.reshape(m)
    hn = _topk_entropy_rows(logits.reshape(m, logits.shape[-1]), k, flat_mask)[0].reshape(lead)
    if reduction == "none":
        return hn
    if mask is None:
        return hn.mean()
    return hn.sum() / mask.sum()  # rows outside the mask are exactly 0 (never read)


def topk_entropy_from_hidden(hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int = 100,
                             mask: torch.Tensor | None = None, *, chunk_size: int | None = None) -> torch.Tensor:
    """:func:`topk_entropy` of ``hidden @ lm_head_weight^T`` without materialising the ``(N, V)`` logits.

    Args:
        hidden: ``(..., d)`` final hidden states (after the final norm), float dtype.
        lm_head_weight: ``(V, d)`` the output head's weight (no bias), same dtype and device.
        k: as in :func:`topk_entropy`, ``2 <= k <= V``.
        mask: optional ``(...)`` bool, True at response positions (at least one). Only these rows
            are computed.
        chunk_size: rows of logits computed at a time (default: about 2^26 logits, e.g. 441 rows at
            V = 151,936). Peak extra memory is a few ``(chunk_size, V)`` fp32 buffers.

    Returns:
        Scalar mean over the selected positions, float32 (float64 for float64 input). Equal to
        ``topk_entropy(hidden @ lm_head_weight.T, k, mask)`` (same logits chunk by chunk), with the
        same gradients for ``hidden`` and ``lm_head_weight``; the forward keeps the sparse gradient
        (``tokens x k``), so the backward computes no logits.

    Contract: as :func:`topk_entropy`, except autocast: under ``torch.autocast`` hidden and the
    head's weight (float16/bfloat16/float32) are cast to the autocast dtype, so the chunked GEMM runs
    as ``lm_head`` would, and the entropy in float32 (the same as ``topk_entropy(lm_head(hidden))``
    under autocast). Rows outside ``mask`` are never read or computed. ``d = 0`` is allowed (all
    logits 0); zero positions raise (the mean is undefined).

    Raises:
        treadle.distributed.DTensorInputError (a TypeError): a DTensor input (convert it first).
        TypeError / ValueError: as :func:`topk_entropy`, plus shape/dtype/device mismatch between
            ``hidden`` and ``lm_head_weight``, and ``chunk_size < 1``.
    """
    _refuse_dtensor("topk_entropy_from_hidden", hidden=hidden, lm_head_weight=lm_head_weight, mask=mask)
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if not isinstance(lm_head_weight, torch.Tensor):
        raise TypeError(f"lm_head_weight must be a torch.Tensor, got {type(lm_head_weight).__name__}")
    if hidden.dtype not in _FLOAT:
        raise TypeError(f"hidden must have a floating dtype (one of {_FLOAT}), got {hidden.dtype}")
    amp = _amp.autocast_dtype(hidden.device.type)
    if amp is not None and hidden.dtype != torch.float64:  # the GEMM runs like lm_head would under autocast
        hidden, lm_head_weight = _amp.cast(hidden, amp), _amp.cast(lm_head_weight, amp)
    if lm_head_weight.dtype != hidden.dtype:
        raise TypeError(f"lm_head_weight must have hidden's dtype {hidden.dtype}, got {lm_head_weight.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape (..., d), got a scalar")
    d = hidden.shape[-1]
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != d:
        raise ValueError(f"lm_head_weight must have shape (V, d={d}), got {tuple(lm_head_weight.shape)}")
    if lm_head_weight.device != hidden.device:
        raise ValueError(f"lm_head_weight is on {lm_head_weight.device} but hidden is on {hidden.device}")
    vocab = lm_head_weight.shape[0]
    k = _check_k(k, vocab)
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    lead = hidden.shape[:-1]
    _check_mask(mask, lead, hidden.device)
    m = math.prod(lead)
    if m == 0:
        raise ValueError(f"hidden has no positions (shape {tuple(hidden.shape)}): the mean is undefined")
    flat_mask = None if mask is None else mask.reshape(m)
    hn = _topk_entropy_hidden(hidden.reshape(m, d).contiguous(), lm_head_weight.contiguous(), flat_mask, k, chunk_size)[0]
    return hn.mean() if mask is None else hn.sum() / mask.sum()

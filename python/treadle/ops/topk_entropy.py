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

Implementation: plain PyTorch ops (``torch.topk`` + elementwise), in float32 (float64 for float64
inputs), wrapped as ``torch.library`` custom ops with fake implementations and registered
autograd. The backward is one elementwise pass over the logits using per-row statistics saved by
the forward (``lse_k``, ``H``, ``t``: O(N) memory). The chunked form
:func:`topk_entropy_from_hidden` computes ``logits = hidden @ lm_head_weight^T`` ``chunk_size`` rows at
a time and recomputes each chunk in the backward (the approach of fused linear cross-entropy), so
neither the ``(N, V)`` logits nor their fp32 softmax or gradient exist at once.
"""
from __future__ import annotations

import math

import torch

from treadle import dispatch

OP = "topk_entropy"
# Listed in treadle.backends() as running the PyTorch path on every device; there is no other
# backend to choose, so TREADLE_BACKEND does not apply to it.
dispatch.register(OP, cpu=(), gpu=())

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHUNK_ELEMENTS = 1 << 26  # default chunk: about 2^26 logits (256 MiB in fp32) at a time


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_stats(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``z (M, V)`` in the accumulation dtype -> ``(lse_k, H, t)`` each ``(M,)``; H in nats."""
    vals = torch.topk(z, k, dim=-1, sorted=False).values
    lse = torch.logsumexp(vals, dim=-1)
    logp = vals - lse.unsqueeze(-1)
    h = -(logp.exp() * logp).sum(-1)
    return lse, h, vals.amin(-1)


def _row_grad(z: torch.Tensor, k: int, lse: torch.Tensor, h: torch.Tensor, thr: torch.Tensor,
              coef: torch.Tensor) -> torch.Tensor:
    """``coef_m * dH_m/dz`` for ``z (M, V)`` (accumulation dtype): ``-p (z - lse + H)`` on the selected
    entries (ties at the threshold: lowest indices first), 0 elsewhere."""
    sel = z > thr.unsqueeze(-1)
    need = k - sel.sum(-1)
    eq = z == thr.unsqueeze(-1)
    n_eq = eq.sum(-1)
    tied = (n_eq > need).nonzero().flatten()
    if tied.numel():  # more entries equal the k-th value than slots left: keep the lowest indices
        eq_t = eq[tied]
        eq[tied] = eq_t & (eq_t.cumsum(-1) <= need[tied].unsqueeze(-1))
    sel |= eq
    t = z - lse.unsqueeze(-1)
    g = t.exp()
    t.add_(h.unsqueeze(-1)).mul_(g).mul_((-coef).unsqueeze(-1))
    return t.masked_fill_(~sel, 0.0)


# ---------------------------------------------------------------- from logits
@torch.library.custom_op("treadle::topk_entropy_rows", mutates_args=())
def _topk_entropy_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits (M, V)`` -> ``(H / log k, lse_k, t)`` each ``(M,)`` in fp32 (fp64 for fp64 logits)."""
    lse, h, thr = _row_stats(logits.to(_acc(logits.dtype)), k)
    return h / math.log(k), lse, thr


@_topk_entropy_rows.register_fake
def _(logits, k):
    m = logits.shape[0]
    acc = _acc(logits.dtype)
    return tuple(logits.new_empty((m,), dtype=acc) for _ in range(3))


@torch.library.custom_op("treadle::topk_entropy_rows_backward", mutates_args=())
def _topk_entropy_rows_backward(grad: torch.Tensor, logits: torch.Tensor, hn: torch.Tensor, lse: torch.Tensor,
                                thr: torch.Tensor, k: int) -> torch.Tensor:
    """``grad (M,)`` on ``H / log k`` -> ``grad_logits (M, V)`` in the logits' dtype."""
    logk = math.log(k)
    acc = _acc(logits.dtype)
    g = _row_grad(logits.to(acc), k, lse, hn * logk, thr, grad.to(acc) / logk)
    return g.to(logits.dtype)


@_topk_entropy_rows_backward.register_fake
def _(grad, logits, hn, lse, thr, k):
    return torch.empty_like(logits)


def _rows_setup(ctx, inputs, output):
    logits, k = inputs
    hn, lse, thr = output
    ctx.save_for_backward(logits, hn, lse, thr)
    ctx.k = k
    ctx.mark_non_differentiable(lse, thr)


def _rows_backward(ctx, grad_hn, grad_lse, grad_thr):
    logits, hn, lse, thr = ctx.saved_tensors
    return _topk_entropy_rows_backward(grad_hn, logits, hn, lse, thr, ctx.k), None


_topk_entropy_rows.register_autograd(_rows_backward, setup_context=_rows_setup)


# ---------------------------------------------------------------- chunked from hidden states
def _chunks(m: int, chunk: int):
    for s in range(0, m, chunk):
        yield s, min(s + chunk, m)


@torch.library.custom_op("treadle::topk_entropy_hidden", mutates_args=())
def _topk_entropy_hidden(hidden: torch.Tensor, weight: torch.Tensor, k: int, chunk_size: int) -> torch.Tensor:
    """``hidden (M, d)``, ``weight (V, d)`` -> ``H / log k (M,)``; logits ``chunk_size`` rows at a time."""
    acc = _acc(hidden.dtype)
    out = hidden.new_empty((hidden.shape[0],), dtype=acc)
    for s, e in _chunks(hidden.shape[0], chunk_size):
        z = (hidden[s:e] @ weight.t()).to(acc)
        out[s:e] = _row_stats(z, k)[1]
    return out / math.log(k)


@_topk_entropy_hidden.register_fake
def _(hidden, weight, k, chunk_size):
    return hidden.new_empty((hidden.shape[0],), dtype=_acc(hidden.dtype))


@torch.library.custom_op("treadle::topk_entropy_hidden_backward", mutates_args=())
def _topk_entropy_hidden_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int,
                                  chunk_size: int, need_hidden: bool, need_weight: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Recomputes each chunk's logits: ``d hidden = G W``, ``d weight = sum_chunks G^T hidden``."""
    acc = _acc(hidden.dtype)
    logk = math.log(k)
    dh = torch.zeros_like(hidden)
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    for s, e in _chunks(hidden.shape[0], chunk_size):
        hc = hidden[s:e]
        z = (hc @ weight.t()).to(acc)
        lse, h, thr = _row_stats(z, k)
        g = _row_grad(z, k, lse, h, thr, grad[s:e].to(acc) / logk).to(hidden.dtype)
        del z
        if need_hidden:
            dh[s:e] = g @ weight
        if need_weight:
            dw.addmm_(g.t().to(acc), hc.to(acc))
    return dh, (dw.to(weight.dtype) if need_weight else torch.zeros_like(weight))


@_topk_entropy_hidden_backward.register_fake
def _(grad, hidden, weight, k, chunk_size, need_hidden, need_weight):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _hidden_setup(ctx, inputs, output):
    hidden, weight, k, chunk_size = inputs
    ctx.save_for_backward(hidden, weight)
    ctx.args = (k, chunk_size)


def _hidden_backward(ctx, grad):
    hidden, weight = ctx.saved_tensors
    k, chunk_size = ctx.args
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_h or need_w):
        return None, None, None, None
    dh, dw = _topk_entropy_hidden_backward(grad, hidden, weight, k, chunk_size, need_h, need_w)
    return (dh if need_h else None), (dw if need_w else None), None, None


_topk_entropy_hidden.register_autograd(_hidden_backward, setup_context=_hidden_setup)


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
    if not bool(mask.any()):
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

    Raises:
        TypeError: non-tensor logits, a non-float dtype, non-int k, non-bool mask.
        ValueError: ``k < 2``, ``k > V``, a mask of the wrong shape/device or with no True position,
            an unknown reduction, a mask with ``reduction="none"``, logits with no vocabulary dim.
    """
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
    if math.prod(lead) == 0:
        if reduction == "none":
            return logits.new_empty(lead, dtype=_acc(logits.dtype))
        raise ValueError(f"logits has no positions (shape {tuple(logits.shape)}): the mean is undefined")
    hn = _topk_entropy_rows(logits.reshape(-1, logits.shape[-1]), k)[0].reshape(lead)
    if reduction == "none":
        return hn
    if mask is None:
        return hn.mean()
    return torch.where(mask, hn, torch.zeros((), dtype=hn.dtype, device=hn.device)).sum() / mask.sum()


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
        same gradients for ``hidden`` and ``lm_head_weight``; the backward recomputes each chunk.

    Raises:
        TypeError / ValueError: as :func:`topk_entropy`, plus shape/dtype/device mismatch between
            ``hidden`` and ``lm_head_weight``, and ``chunk_size < 1``.
    """
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if not isinstance(lm_head_weight, torch.Tensor):
        raise TypeError(f"lm_head_weight must be a torch.Tensor, got {type(lm_head_weight).__name__}")
    if hidden.dtype not in _FLOAT:
        raise TypeError(f"hidden must have a floating dtype (one of {_FLOAT}), got {hidden.dtype}")
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
    rows = hidden[mask] if mask is not None else hidden.reshape(-1, d)
    if rows.shape[0] == 0:
        raise ValueError(f"hidden has no positions (shape {tuple(hidden.shape)}): the mean is undefined")
    return _topk_entropy_hidden(rows.contiguous(), lm_head_weight.contiguous(), k, chunk_size).mean()

"""STAIR's training objective (STAIR sec. 4.4): ``CE + lambda_kl * KL(native || stair)`` over labelled
positions, with the global denominator data-parallel training needs. Used by the trainer
(:mod:`treadle.stair.trainer`) and by :func:`treadle.stair.training.train_step`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["stair_loss"]


def stair_loss(logits: torch.Tensor, native_logits: torch.Tensor | None, labels: torch.Tensor,
               lambda_kl: float = 1.0, *, tokens: float | None = None) -> tuple[torch.Tensor, dict]:
    """``CE + lambda_kl * KL(native || stair)`` averaged over labelled positions (STAIR sec. 4.4).

    Args:
        logits: ``(B, S, V)`` STAIR logits; native_logits: same shape (no grad) or None (no KL).
        labels: ``(B, S)`` int64 next-token targets, -100 where unlabelled.
        tokens: the denominator of the average; None: this batch's labelled positions. Data-parallel
            training passes the count of the whole global batch (all-reduced over ranks), so that the
            ranks' losses add up to the global batch's mean (:mod:`treadle.stair.trainer`).

    Returns:
        (loss scalar, {"ce": float, "kl": float, "tokens": int}); ``tokens`` is this batch's count.
    """
    sel = labels != -100
    n = int(sel.sum())
    if n == 0:
        z = logits.sum() * 0.0
        return z, {"ce": 0.0, "kl": 0.0, "tokens": 0}
    if tokens is not None:
        return _stair_loss_sum(logits[sel], None if native_logits is None else native_logits[sel], labels[sel],
                               lambda_kl, tokens, n)
    lp = F.log_softmax(logits[sel].float(), -1)
    ce = F.nll_loss(lp, labels[sel])
    kl = lp.new_zeros(())
    if native_logits is not None and lambda_kl > 0:
        lq = F.log_softmax(native_logits[sel].float(), -1)
        kl = (lq.exp() * (lq - lp)).sum(-1).mean()
    loss = ce + lambda_kl * kl
    return loss, {"ce": float(ce.detach()), "kl": float(kl.detach()), "tokens": n}


def _stair_loss_sum(logits, native_logits, labels, lambda_kl: float, tokens: float, n: int):
    """stair_loss over selected ``(n, V)`` rows, summed and divided by ``tokens`` (a global count)."""
    if not tokens > 0:
        raise ValueError(f"tokens must be > 0, got {tokens!r}")
    lp = F.log_softmax(logits.float(), -1)
    ce = F.nll_loss(lp, labels, reduction="sum") / tokens
    kl = lp.new_zeros(())
    if native_logits is not None and lambda_kl > 0:
        lq = F.log_softmax(native_logits.float(), -1)
        kl = (lq.exp() * (lq - lp)).sum() / tokens
    return ce + lambda_kl * kl, {"ce": float(ce.detach()), "kl": float(kl.detach()), "tokens": n}

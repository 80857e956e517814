"""Policy-gradient loss and its aggregation, named as TRL/verl name them.

Aggregation modes (verl ``agg_loss``; Dr.GRPO: Liu et al. 2025 sec. 3.1), with ``m`` the loss mask:

* ``token-mean``:              sum(l * m) / global_tokens
* ``seq-mean-token-sum``:      sum_b sum_t(l * m) / global_seqs
* ``seq-mean-token-mean``:     sum_b [sum_t(l * m) / sum_t m] / global_seqs
* ``seq-mean-token-sum-norm``: sum_b sum_t(l * m) / (global_seqs * norm_constant)  (Dr.GRPO: a
  constant such as the maximum response length; never the padded width of this micro-batch)

``global_tokens`` / ``global_seqs`` default to this micro-batch's counts (sequences with at least one
token). Pass the counts of the whole optimizer step (all micro-batches, all data-parallel ranks) to make
gradient accumulation and data parallelism give the loss of one big batch; with ``dp_size > 1`` the
result is multiplied by ``dp_size`` because DDP/FSDP average gradients over ranks (verl's convention).
"""
from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                   global_tokens: float | torch.Tensor | None = None, global_seqs: float | torch.Tensor | None = None,
                   norm_constant: float | None = None, dp_size: int = 1) -> torch.Tensor:
    """Aggregate a ``(B, T)`` per-token loss into a scalar (modes above).

    Args:
        per_token_loss: ``(B, T)`` float.
        mask: ``(B, T)`` bool or 0/1; tokens that count.
        mode: one of :data:`LOSS_AGG_MODES`.
        global_tokens, global_seqs: global denominators (see module doc); required when ``dp_size > 1``.
        norm_constant: required for ``seq-mean-token-sum-norm``.
        dp_size: data-parallel world size.

    Raises:
        ValueError: unknown mode, shape mismatch, missing ``norm_constant`` or global denominator.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if per_token_loss.dim() != 2 or mask.shape != per_token_loss.shape:
        raise ValueError(f"per_token_loss and mask must both be (B, T); got {tuple(per_token_loss.shape)} and "
                         f"{tuple(mask.shape)}")
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    m = mask.to(per_token_loss.dtype)
    masked = per_token_loss * m
    if mode == "token-mean":
        if global_tokens is None:
            if dp_size > 1:
                raise ValueError("global_tokens is required when dp_size > 1")
            global_tokens = m.sum()
        return masked.sum() / global_tokens * dp_size
    tokens_per_seq = m.sum(dim=-1)
    if global_seqs is None:
        if dp_size > 1:
            raise ValueError("global_seqs is required when dp_size > 1")
        global_seqs = (tokens_per_seq > 0).to(per_token_loss.dtype).sum()
    if mode == "seq-mean-token-mean":
        seq = masked.sum(dim=-1) / tokens_per_seq.clamp(min=1)
        return seq.sum() / global_seqs * dp_size
    loss = masked.sum() / global_seqs * dp_size
    if mode == "seq-mean-token-sum-norm":
        if norm_constant is None or not norm_constant > 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_constant > 0 (e.g. the maximum response length); "
                             "the padded width is never used, since it changes with the micro-batch")
        loss = loss / norm_constant
    return loss


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float | None = None, dual_clip: float | None = None,
                mode: str = "token-mean", **agg_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient (PPO/GRPO) loss, aggregated.

    ``ratio = exp(logprobs - old_logprobs)``; per token ``l = max(-A ratio, -A clip(ratio, 1 - clip_low,
    1 + clip_high))`` (PPO, Schulman et al. 2017, eq. 7; DAPO's decoupled ``clip_high``); with
    ``dual_clip = c > 1``, tokens with ``A < 0`` get ``min(l, -A c)`` (Ye et al. 2020, dual-clip PPO).

    Args:
        logprobs, old_logprobs: ``(B, T)`` float log-probabilities of the sampled tokens.
        advantages: ``(B, T)`` (see :func:`broadcast_to_tokens`) or ``(B,)``.
        mask: ``(B, T)`` bool/0-1 loss mask.
        clip_low, clip_high: clip range (``clip_high`` defaults to ``clip_low``).
        dual_clip: constant c > 1, or None.
        mode, agg_kwargs: see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``; stats (detached scalars): ``clipfrac``, ``clipfrac_lower`` (dual clip),
        ``approx_kl`` (k1 estimate, mean over masked tokens).

    Raises:
        ValueError: shapes differ, clip values out of range, ``dual_clip <= 1``.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(f"logprobs, old_logprobs and mask must share one (B, T) shape; got {tuple(logprobs.shape)}, "
                         f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.shape[0] != logprobs.shape[0]:
        raise ValueError(f"advantages must be (B,) or (B, T) with B={logprobs.shape[0]}, got {tuple(advantages.shape)}")
    clip_high = clip_low if clip_high is None else clip_high
    if not (0 <= clip_low < 1) or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    adv = advantages.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(pg1, pg2)
    m = mask.to(logprobs.dtype)
    n_tok = m.sum().clamp(min=1)
    stats = {"clipfrac": ((pg2 > pg1).to(m.dtype) * m).sum().detach() / n_tok}
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        lower = (loss_tok > pg3) & (adv < 0)
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, pg3), loss_tok)
        stats["clipfrac_lower"] = (lower.to(m.dtype) * m).sum().detach() / n_tok
    stats["approx_kl"] = (-log_ratio * m).sum().detach() / n_tok
    return aggregate_loss(loss_tok, mask, mode, **agg_kwargs), stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)`` at the sampled tokens: ``exp(d) - d - 1`` with
    ``d = ref_logp - logp`` (``(B, T)`` float -> ``(B, T)``, >= 0, 0 where the two agree; GRPO, Shao et al.
    2024 eq. 4)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0

"""GRPO across data-parallel ranks: global loss denominators and group statistics.

Two things change when a GRPO batch is split over ranks, and both are fed here from collectives:

* **Loss aggregation** (:func:`treadle.grpo.aggregate_loss`): ``token-mean`` divides by the number
  of loss tokens of the *whole* batch, the ``seq-mean-*`` modes by its number of (non-empty)
  sequences. :func:`global_loss_denominators` all-reduces the counts of every micro-batch of the step
  over the ranks; :func:`aggregate_loss_dp` passes them on with ``dp_size = world size``, so that,
  after DDP/FSDP average the gradients over ranks, the loss and its gradient equal those of one
  process holding the whole batch (verl's ``global_batch_info`` / ``dp_size`` convention).
* **Group statistics** (:func:`treadle.grpo.grpo_advantages`): a group's rows may sit on several
  ranks (rollouts of one prompt spread over workers). :func:`grpo_advantages_dp` all-gathers the
  per-row scalars (rewards, group ids, masks: ``N`` numbers per rank, never tokens), computes the
  advantages of the whole batch once with the chosen backend, and returns this rank's rows, so they
  equal the single-process advantages of the concatenated batch exactly.

Group ids must mean the same group on every rank. :func:`global_group_ids` numbers any hashable
uids (verl's uuid strings, prompt ids) consistently over ranks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from treadle.distributed.process_group import collective_device, rank, require_initialized, world_size
from treadle.grpo.losses import LOSS_AGG_MODES, aggregate_loss

__all__ = ["global_loss_denominators", "aggregate_loss_dp", "grpo_advantages_dp", "global_group_ids",
           "all_gather_rows"]


def global_loss_denominators(masks: torch.Tensor | Sequence[torch.Tensor], *, group=None) -> tuple[float, float]:
    """Loss tokens and non-empty sequences of one optimizer step over every rank of ``group``.

    Args:
        masks: this rank's ``(B, T)`` bool/0-1 loss mask, or a list of them (one per micro-batch of the
            step: gradient accumulation).
        group: process group (None: the default group).

    Returns:
        ``(global_tokens, global_seqs)`` as Python floats (exact integer counts, summed in float64 with
        one all-reduce), to pass to :func:`treadle.grpo.aggregate_loss`.

    Raises:
        NotDistributedError: torch.distributed is not initialised.
        ValueError: a mask that is not 2-D, or an empty list.
    """
    require_initialized("global_loss_denominators")
    masks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    if not masks:
        raise ValueError("masks must be a (B, T) tensor or a non-empty list of them")
    for m in masks:
        if not isinstance(m, torch.Tensor) or m.dim() != 2:
            raise ValueError(f"each mask must be a (B, T) tensor, got {getattr(m, 'shape', type(m).__name__)}")
    tokens = sum(float(m.to(torch.float64).sum()) for m in masks)
    seqs = sum(float((m.to(torch.float64).sum(-1) > 0).sum()) for m in masks)
    counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return float(counts[0]), float(counts[1])


def aggregate_loss_dp(per_token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
                      norm_constant: float | None = None, group=None,
                      denominators: tuple[float, float] | None = None) -> torch.Tensor:
    """:func:`treadle.grpo.aggregate_loss` with the global denominators of all ranks (every mode of
    :data:`treadle.grpo.LOSS_AGG_MODES`).

    The result on rank r is ``sum_r(...) / global_denominator * world_size``: the mean of the ranks'
    results (what DDP/FSDP do to the gradients) is the whole batch's loss.

    Args:
        per_token_loss, mask: this rank's ``(B, T)`` micro-batch (see :func:`aggregate_loss`).
        mode: aggregation mode; norm_constant: for ``seq-mean-token-sum-norm``.
        group: process group (None: default).
        denominators: ``(global_tokens, global_seqs)`` from :func:`global_loss_denominators` (pass them
            with gradient accumulation: the counts of the whole step); None: computed from this
            micro-batch (one all-reduce).

    Raises:
        NotDistributedError: torch.distributed is not initialised. ValueError: as aggregate_loss.
    """
    if mode not in LOSS_AGG_MODES:  # before the collective: every rank raises the same error
        raise ValueError(f"mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if denominators is None:
        denominators = global_loss_denominators(mask, group=group)
    tokens, seqs = denominators
    return aggregate_loss(per_token_loss, mask, mode, global_tokens=tokens, global_seqs=seqs,
                          norm_constant=norm_constant, dp_size=world_size(group))


def all_gather_rows(t: torch.Tensor, *, group=None) -> tuple[torch.Tensor, list[int]]:
    """Concatenate every rank's 1-D tensor in rank order (ranks may hold different lengths).

    Returns:
        ``(gathered, sizes)``: the ``(sum N_r,)`` tensor on ``t``'s device and dtype, and each rank's
        ``N_r``. Bool tensors travel as uint8 (gloo has no bool all-gather).

    Raises:
        NotDistributedError: torch.distributed is not initialised. ValueError: ``t`` is not 1-D.
    """
    require_initialized("all_gather_rows")
    if t.dim() != 1:
        raise ValueError(f"all_gather_rows takes a 1-D tensor, got shape {tuple(t.shape)}")
    dev, W = collective_device(group), world_size(group)
    n = torch.tensor([t.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(W)]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s) for s in sizes]
    wire = t.to(torch.uint8) if t.dtype == torch.bool else t
    pad = torch.zeros(max(sizes), dtype=wire.dtype, device=dev)
    pad[:t.numel()] = wire.to(dev)
    parts = [torch.empty_like(pad) for _ in range(W)]
    dist.all_gather(parts, pad, group=group)
    out = torch.cat([p[:s] for p, s in zip(parts, sizes)]).to(t.device)
    return (out.bool() if t.dtype == torch.bool else out), sizes


def grpo_advantages_dp(rewards: torch.Tensor, group_ids: torch.Tensor, *, valid: torch.Tensor | None = None,
                       flags: torch.Tensor | None = None, group=None, **kwargs) -> torch.Tensor:
    """:func:`treadle.grpo.grpo_advantages` for a batch whose rows (and groups) are split over ranks.

    Each rank passes its own rows; the rows of all ranks are gathered in rank order, the advantages of
    that whole batch are computed once (same estimator, options and backend on every rank) and this
    rank's rows are returned: exactly the single-process result of the concatenated batch.

    Args:
        rewards: ``(N_r,)`` float rewards of this rank's rows (N_r may differ between ranks, may be 0).
        group_ids: ``(N_r,)`` integer ids that name the same group on every rank (see
            :func:`global_group_ids`).
        valid, flags: optional ``(N_r,)`` bool masks (see grpo_advantages).
        group: process group (None: default).
        kwargs: every other option of :func:`treadle.grpo.grpo_advantages` (estimator, std, eps, ...).

    Returns:
        ``(N_r,)`` advantages of this rank's rows (dtype and device as grpo_advantages gives them).

    Raises:
        NotDistributedError: torch.distributed is not initialised.
        TypeError / ValueError: as grpo_advantages (checked on this rank's rows before any collective).
    """
    from treadle.grpo import grpo_advantages

    require_initialized("grpo_advantages_dp")
    grpo_advantages(rewards, group_ids, valid=valid, flags=flags, **kwargs)  # this rank's input errors, early
    all_r, sizes = all_gather_rows(rewards, group=group)
    all_g, _ = all_gather_rows(group_ids, group=group)
    all_v = all_gather_rows(valid, group=group)[0] if valid is not None else None
    all_f = all_gather_rows(flags, group=group)[0] if flags is not None else None
    adv = grpo_advantages(all_r, all_g, valid=all_v, flags=all_f, **kwargs)
    start = sum(sizes[:rank(group)])
    return adv[start:start + rewards.numel()]


def global_group_ids(uids, *, group=None, device: torch.device | str | None = None) -> torch.Tensor:
    """``(N_r,)`` int64 group ids for this rank's uids, equal exactly where the uids are equal on ANY rank
    (numbered in first-appearance order over the rank-ordered concatenation, as
    :func:`treadle.grpo.group_ids_from_uids` numbers one process's batch).

    Args:
        uids: this rank's hashable, picklable uids (list, NumPy array or 1-D tensor).

    Raises:
        NotDistributedError: torch.distributed is not initialised. ValueError: uids not one-dimensional.
    """
    import numpy as np

    from treadle.grpo.grouping import group_ids_from_uids

    require_initialized("global_group_ids")
    arr = uids.detach().cpu().numpy() if isinstance(uids, torch.Tensor) else np.asarray(uids, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"uids must be one-dimensional, got shape {arr.shape}")
    mine = arr.tolist()
    every: list = [None] * world_size(group)
    dist.all_gather_object(every, mine, group=group)
    flat = np.empty(sum(len(x) for x in every), dtype=object)
    flat[:] = [u for x in every for u in x]
    ids = group_ids_from_uids(flat, device=device)
    start = sum(len(x) for x in every[:rank(group)])
    return ids[start:start + len(mine)]

"""Token broadcast of per-row advantages (DESIGN.md "GRPO family": only the current turn's policy
tokens get a row's advantage; prompt prefix, tool output and padding get 0)."""
from __future__ import annotations

import torch


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages for padded batches.

    Args:
        advantages: ``(B,)`` float, one value per row (response or atomic turn).
        response_mask: ``(B, T)`` bool or 0/1 numeric; True on the row's policy tokens.

    Returns:
        ``(B, T)`` with ``advantages[b]`` on masked-in tokens and 0 elsewhere, dtype of ``advantages``.

    Raises:
        TypeError / ValueError: non-tensors, non-float advantages, wrong ranks, B mismatch, devices differ.
    """
    if not isinstance(advantages, torch.Tensor) or not isinstance(response_mask, torch.Tensor):
        raise TypeError("advantages and response_mask must be torch.Tensors")
    if not advantages.is_floating_point():
        raise TypeError(f"advantages must be a floating tensor, got {advantages.dtype}")
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be (B,), got shape {tuple(advantages.shape)}")
    if response_mask.dim() != 2 or response_mask.shape[0] != advantages.shape[0]:
        raise ValueError(f"response_mask must be (B={advantages.shape[0]}, T), got shape {tuple(response_mask.shape)}")
    if response_mask.device != advantages.device:
        raise ValueError(f"response_mask is on {response_mask.device} but advantages on {advantages.device}")
    return advantages.unsqueeze(1) * response_mask.to(advantages.dtype)


def broadcast_packed(advantages: torch.Tensor, segment_ids: torch.Tensor,
                     policy_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token advantages for packed sequences (several rows' tokens concatenated).

    Args:
        advantages: ``(R,)`` float, one value per row (e.g. per atomic turn).
        segment_ids: ``(L,)`` integer; the row each token belongs to, ``-1`` for tokens of no row
            (padding, separators).
        policy_mask: optional ``(L,)`` bool; True on tokens the policy generated in that row's turn.
            False on the replayed prefix and on tool outputs, which then get 0.

    Returns:
        ``(L,)`` advantages, 0 wherever ``segment_ids < 0`` or ``policy_mask`` is False.

    Raises:
        TypeError / ValueError: wrong dtypes or ranks, lengths differ, segment ids >= R (checked on CPU
            tensors; on CUDA the check would synchronise and is skipped).
    """
    if not isinstance(advantages, torch.Tensor) or not isinstance(segment_ids, torch.Tensor):
        raise TypeError("advantages and segment_ids must be torch.Tensors")
    if not advantages.is_floating_point() or advantages.dim() != 1:
        raise ValueError(f"advantages must be a 1-D floating tensor (R,), got {advantages.dtype} {tuple(advantages.shape)}")
    if segment_ids.dim() != 1 or segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
        raise TypeError(f"segment_ids must be a 1-D integer tensor (L,), got {segment_ids.dtype} {tuple(segment_ids.shape)}")
    if policy_mask is not None and (policy_mask.dtype != torch.bool or policy_mask.shape != segment_ids.shape):
        raise ValueError(f"policy_mask must be a bool tensor of shape {tuple(segment_ids.shape)}, got "
                         f"{policy_mask.dtype} {tuple(policy_mask.shape)}")
    if segment_ids.device.type == "cpu" and segment_ids.numel() and int(segment_ids.max()) >= advantages.numel():
        raise ValueError(f"segment_ids must be < R={advantages.numel()} (or -1 for no row), got max {int(segment_ids.max())}")
    seg = segment_ids.to(torch.int64)
    keep = seg >= 0
    if policy_mask is not None:
        keep = keep & policy_mask
    if advantages.numel() == 0:
        return torch.zeros(seg.shape, dtype=advantages.dtype, device=advantages.device)
    vals = advantages[seg.clamp(min=0)]
    return torch.where(keep, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))

"""References for SCALE (the spec of ``treadle.ops.gated_lora`` and ``treadle.ops.topk_entropy``).

SCALE (seed paper, sec. 3.3 "per-token gates on LoRA", sec. 4.3 "top-k entropy objective";
DESIGN.md, SCALE section). For a LoRA module with frozen base ``W``, frozen ``A (r, d_in)``,
``B (d_out, r)`` and ``scaling = alpha / r``, a gate ``(w (d_in,), b)`` gives per token ``s``::

    g = w . sg(h_s) + b                      (sg = stop-gradient: no gradient into h through g)
    v = tanh(g / tau)
    lambda = 1 + (1 - L) * min(v, 0) + (U - 1) * max(v, 0)      in (L, U), L < 0 < 1 < U
    y = W h + lambda * scaling * B (A h)

Zero gates (w = 0, b = 0) give v = 0 and lambda = 1 exactly: the Stage-I LoRA model.

At v = 0 (every token of a zero-initialised gate) ``lambda`` has a kink: slope ``(1 - L)`` on the
left, ``(U - 1)`` on the right. The spec takes the midpoint ``d lambda / d v = (U - L) / 2`` there,
which is what ``torch.minimum`` / ``torch.maximum`` give (they split the gradient of a tie evenly),
so that zero-initialised gates receive a gradient.

Top-k entropy (sec. 4.3): per position, renormalise the next-token distribution over its ``k``
largest logits, take its entropy and divide by ``log k`` (so it lies in [0, 1]); the objective is
the mean over response positions.
"""
from __future__ import annotations

import math

import torch


def gate_lambda_reference(v: torch.Tensor, L: float, U: float) -> torch.Tensor:
    """``lambda = 1 + (1 - L) min(v, 0) + (U - 1) max(v, 0)`` elementwise (SCALE eq. for the gate)."""
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    return 1.0 + (1.0 - L) * torch.minimum(v, zero) + (U - 1.0) * torch.maximum(v, zero)


def gated_lora_reference(
    x: torch.Tensor,
    base_out: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    *,
    scaling: float,
    L: float,
    U: float,
    tau: float,
    return_lambda: bool = False,
):
    """Literal gated LoRA: ``y = base_out + lambda * scaling * (x A^T) B^T``.

    Args:
        x: ``(..., d_in)`` module input ``h``.
        base_out: ``(..., d_out)`` the base layer's output ``W h (+ bias)``; gradients flow through it
            unchanged.
        lora_A: ``(r, d_in)``; lora_B: ``(d_out, r)``.
        gate_weight: ``(d_in,)``; gate_bias: ``()`` or ``(1,)``.
        scaling: ``alpha / r``. L, U, tau: gate range and temperature.
        return_lambda: also return ``lambda`` with shape ``x.shape[:-1]``.

    Works in any float dtype (use float64 for the spec); computes in the inputs' dtype. The gate
    reads ``x.detach()`` (stop-gradient).
    """
    g = (x.detach() * gate_weight).sum(-1) + gate_bias.reshape(())
    v = torch.tanh(g / tau)
    lam = gate_lambda_reference(v, L, U)
    delta = (x @ lora_A.transpose(0, 1)) @ lora_B.transpose(0, 1)
    y = base_out + (lam * scaling).unsqueeze(-1) * delta
    return (y, lam) if return_lambda else y


def topk_entropy_rows_reference(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per-position normalised top-k entropy ``H_k / log k`` of ``logits (..., V)``: shape ``(...)``.

    ``softmax`` over the ``k`` largest logits of each position (ties at the k-th value do not
    change the value), entropy in nats, divided by ``log k``. Non-finite logits: ``-inf`` entries
    have probability 0 and ``0 log 0 = 0`` (so fewer than k finite logits is fine); a row of all
    ``-inf`` gives 0; a row with ``+inf`` entries gives the limit distribution, uniform over them;
    NaN gives NaN.
    """
    inf = float("inf")
    vals = torch.topk(logits, k, dim=-1).values
    pinf = (vals == inf).any(-1, keepdim=True)
    vals = torch.where(pinf, torch.where(vals == inf, 0.0, -inf), vals)
    logp = torch.log_softmax(vals, dim=-1)
    p = logp.exp()
    h = -torch.where(p == 0, 0.0, p * logp).sum(-1) / math.log(k)
    return torch.where((vals == -inf).all(-1), 0.0, h)


def topk_entropy_reference(logits: torch.Tensor, k: int = 100, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of :func:`topk_entropy_rows_reference` over the positions where ``mask`` is True (all if None)."""
    h = topk_entropy_rows_reference(logits, k)
    if mask is None:
        return h.mean()
    return h[mask].mean()

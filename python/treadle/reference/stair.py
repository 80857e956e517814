"""Reference STAIR reflected bank read-out (the spec of ``treadle.ops.stair_readout``).

Maths (STAIR sec. 3.4, eqs. for the reflected read-out; sec. 4.4 for the fused form; DESIGN.md
"STAIR"). Per batch row b, query head h (kv head ``h // (Hq // Hkv)``), current token t and bank key
j < L_b (the row's bank length), with q~ and k~ already rotated by the caller:

    u      = n_h / ||n_h||                          Householder normal of head h
    s_j    = scale * q~ . k~_j
    pi_ref = (1 - eps) * softmax_j(s) + eps / L_b   (uniform mixing over the valid bank)
    t_j    = scale * (q~R - q~) . k~_j = -2 * scale * (u . q~) * (u . k~_j),  q~R = q~ - 2 u (u . q~)
    pi_R_j = pi_ref_j * exp(t_j) / sum_i pi_ref_i * exp(t_i)

and the read-out ``mode="diff"``: ``sum_j (pi_R_j - pi_ref_j) v_j``; ``"reflected"``: ``sum_j pi_R_j
v_j`` (the direct reflected read control); ``"reference"``: ``sum_j pi_ref_j v_j``. A row with an
empty bank (L_b = 0) gives exactly 0. Bank slots ``j >= L_b`` never enter the result or the
gradient, whatever they hold (NaN, inf). With eps = 0, ``diff = attn(q~R, k~, v) - attn(q~, k~, v)``.

This module materialises the ``(B, Hq, T, M)`` weights on purpose: it is short and literal, works in
float64, and autograd through it is the ground truth for the kernels' gradients. ``pi_R`` is formed
in the log domain (``softmax(log pi_ref + t)``), which is the same quantity without overflow for
large logits.
"""
from __future__ import annotations

import math

import torch

MODES = ("diff", "reflected", "reference")


def stair_readout_reference(
    q: torch.Tensor,
    k_bank: torch.Tensor,
    v_bank: torch.Tensor,
    normals: torch.Tensor,
    *,
    bank_lengths: torch.Tensor | None = None,
    eps: float = 0.0,
    scale: float | None = None,
    mode: str = "diff",
) -> torch.Tensor:
    """Reflected bank read-out, literally (materialises ``T x M``).

    Args:
        q: ``(B, Hq, T, D)`` rotated current-turn queries (positions M + p).
        k_bank: ``(B, Hkv, M, D)`` rotated bank keys (positions 0..M-1); Hq % Hkv == 0.
        v_bank: ``(B, Hkv, M, Dv)`` bank values.
        normals: ``(Hq, D)`` one reflection normal per query head (normalised here).
        bank_lengths: optional ``(B,)`` integers in [0, M]; keys at j >= L_b are ignored.
        eps: uniform mixing weight of ``pi_ref`` in [0, 1).
        scale: logit scale (default ``D ** -0.5``).
        mode: ``"diff"`` | ``"reflected"`` | ``"reference"``.

    Returns:
        ``(B, Hq, T, Dv)`` in the promoted dtype of the inputs (no validation: this is the spec;
        :func:`treadle.ops.stair_readout` validates).
    """
    B, Hq, T, D = q.shape
    Hkv, M = k_bank.shape[1], k_bank.shape[2]
    Dv = v_bank.shape[-1]
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    if M == 0:
        return q.new_zeros(B, Hq, T, Dv) + 0.0 * q.sum() + 0.0 * normals.sum()
    if bank_lengths is None:
        lengths = torch.full((B,), M, dtype=torch.int64, device=q.device)
    else:
        lengths = bank_lengths.to(device=q.device, dtype=torch.int64)
    valid = torch.arange(M, device=q.device)[None, :] < lengths[:, None]      # (B, M)
    # slots past a row's length may hold anything (NaN, inf, stale data): they never enter the maths
    zero = torch.zeros((), dtype=k_bank.dtype, device=k_bank.device)
    k_bank = torch.where(valid[:, None, :, None], k_bank, zero)
    v_bank = torch.where(valid[:, None, :, None], v_bank, zero.to(v_bank.dtype))
    group = Hq // Hkv
    k = k_bank.repeat_interleave(group, dim=1)                     # (B, Hq, M, D)
    v = v_bank.repeat_interleave(group, dim=1)                     # (B, Hq, M, Dv)
    u = normals / normals.norm(dim=-1, keepdim=True)               # (Hq, D)
    uq = torch.einsum("hd,bhtd->bht", u.to(q.dtype), q)            # u . q~
    uk = torch.einsum("hd,bhmd->bhm", u.to(k.dtype), k)            # u . k~_j
    s = scale * q @ k.transpose(-1, -2)                            # (B, Hq, T, M)
    t = -2.0 * scale * uq[..., :, None] * uk[..., None, :]         # (B, Hq, T, M)

    has_bank = lengths > 0
    # empty rows: soft-max over everything (finite, so no NaN reaches autograd) and zero the result
    mask = (valid | ~has_bank[:, None])[:, None, None, :]                      # (B, 1, 1, M)
    neg_inf = torch.finfo(s.dtype).min
    log_p = torch.log_softmax(s.masked_fill(~mask, neg_inf), dim=-1)
    n_valid = lengths.clamp(min=1).to(s.dtype)[:, None, None, None]
    if eps == 0.0:
        log_pi_ref = log_p
    else:
        log_pi_ref = torch.logaddexp(math.log1p(-eps) + log_p, torch.log(eps / n_valid).expand_as(log_p))
    log_pi_ref = log_pi_ref.masked_fill(~mask, float("-inf"))
    pi_ref = log_pi_ref.exp()
    pi_r = torch.softmax(log_pi_ref + t, dim=-1)

    if mode == "diff":
        out = (pi_r - pi_ref) @ v
    elif mode == "reflected":
        out = pi_r @ v
    else:
        out = pi_ref @ v
    return out * has_bank.to(out.dtype)[:, None, None, None]

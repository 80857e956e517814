"""Reference group-relative advantages (the spec of ``treadle.ops.grpo_advantages``).

Maths (GRPO: Shao et al. 2024, eq. for outcome supervision; Dr.GRPO: Liu et al. 2025, sec. 3.1;
RLOO: Ahmadian et al. 2024, eq. 5; REINFORCE++-baseline: Hu et al. 2025; atomic-turn groups and
flagged turns: WEFT sec. 4.1). For each group g, over its *considered* rows S_g (``valid`` and, when
``skip_nonfinite``, a finite reward), with n = |S_g|, mean m, variance v (divisor n - 1 if
``unbiased`` else n) and std s = sqrt(v):

* ``grpo``:               A_i = (r_i - m) / (s + eps)      (``eps_in_sqrt``: / sqrt(v + eps))
  with ``scale_rewards="batch"`` s is the std over all considered rows of the batch (TRL), and with
  ``"none"`` there is no division (then it equals ``dr_grpo``).
* ``dr_grpo``:            A_i = r_i - m
* ``rloo``:               A_i = r_i - mean_{j in S_g, j != i} r_j = n / (n - 1) * (r_i - m)
* ``reinforce_baseline``: a_i = r_i - m, then whitened over all considered rows of the batch:
                          A_i = (a_i - mean(a)) / (std(a) + eps)

Then: a group whose considered rewards are all equal (max == min) gives exactly 0 (before the
batch whitening of ``reinforce_baseline``, whose whitening gives exactly 0 when all the considered
pre-whitening advantages are equal); a group of one gives 0 (``singleton="zero"``) or, with
``singleton="raw"``, verl's convention m = 0, s = 1 (so ``grpo`` gives r / (1 + eps) and the others
r); flagged rows get min(A_i, 0); rows not considered get 0.
"""
from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_baseline")


def _std(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    n = x.numel()
    m = x.mean()
    return (((x - m) ** 2).sum() / (n - 1 if unbiased else n)).sqrt()


def grpo_advantages_reference(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    *,
    estimator: str = "grpo",
    unbiased: bool = True,
    eps: float = 1e-6,
    eps_in_sqrt: bool = False,
    singleton: str = "zero",
    scale_rewards: str = "group",
    skip_nonfinite: bool = False,
) -> torch.Tensor:
    """Literal per-group loop; computes in float64 and returns float64 ``(N,)``.

    Arguments as :func:`treadle.ops.grpo_advantages` (no validation here: that is the op's job).
    """
    r = rewards.detach().to(torch.float64).cpu()
    ids = group_ids.detach().cpu()
    n_rows = r.numel()
    ok = torch.ones(n_rows, dtype=torch.bool) if valid is None else valid.detach().cpu().bool().clone()
    if skip_nonfinite:
        ok &= torch.isfinite(r)
    adv = torch.zeros(n_rows, dtype=torch.float64)
    considered = ok.nonzero().flatten()
    batch_std = _std(r[considered], unbiased) if considered.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    for g in torch.unique(ids[considered]).tolist():
        rows = considered[ids[considered] == g]
        x = r[rows]
        n = x.numel()
        if n == 1:
            if singleton == "raw":
                adv[rows] = x / (1.0 + eps) if (estimator == "grpo" and scale_rewards != "none") else x
            continue
        if bool(x.max() == x.min()):
            continue  # exactly 0
        d = x - x.mean()
        if estimator == "grpo":
            if scale_rewards == "group":
                v = ((d**2).sum() / (n - 1 if unbiased else n))
                adv[rows] = d / (v + eps).sqrt() if eps_in_sqrt else d / (v.sqrt() + eps)
            elif scale_rewards == "batch":
                adv[rows] = d / (batch_std + eps)
            else:
                adv[rows] = d
        elif estimator == "dr_grpo" or estimator == "reinforce_baseline":
            adv[rows] = d
        elif estimator == "rloo":
            adv[rows] = d * n / (n - 1)
        else:
            raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if estimator == "reinforce_baseline" and considered.numel() > 0:
        a = adv[considered]
        if bool(a.max() == a.min()):
            adv[considered] = 0.0  # exactly 0 (no 0/0 at eps = 0, no rounding noise of an inexact mean)
        else:
            s = _std(a, unbiased) if a.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
            adv[considered] = (a - a.mean()) / (s + eps)
    if flags is not None:
        f = flags.detach().cpu().bool()
        adv = torch.where(f, adv.clamp(max=0.0), adv)
    adv[~ok] = 0.0
    return adv


def grpo_advantages_scatter(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6,
                            unbiased: bool = True) -> torch.Tensor:
    """Plain vectorised PyTorch GRPO (``torch.unique`` + ``index_add_``) in the rewards' own dtype.

    What a user would write without treadle; the tests use its error in a dtype as the yardstick of
    the tolerance rule, and the benchmarks use it as a peer. ``grpo`` with group scaling only;
    groups of one get 0. No equal-rewards guard (that is the point of comparison).
    """
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    g = uniq.numel()
    r = rewards
    cnt = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / cnt
    d = r - mean[inv]
    m2 = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(0, inv, d * d)
    std = (m2 / ((cnt - 1).clamp(min=1) if unbiased else cnt)).sqrt()
    adv = d / (std[inv] + eps)
    return torch.where(cnt[inv] > 1, adv, torch.zeros_like(adv))

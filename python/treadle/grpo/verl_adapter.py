"""verl drop-in: treadle's estimators in verl's advantage-estimator registry.

Importing this module registers, when verl is importable, the estimators of :data:`ESTIMATOR_NAMES`
with ``verl.trainer.ppo.core_algos`` (a name already held by another function raises
:class:`EstimatorNameClash`: nothing is skipped silently). Use them from a verl config with
``algorithm.adv_estimator=treadle_grpo`` after importing this module in the driver and workers (verl's
``external_lib`` option, or an ``import`` in the entry point).

What verl's trainer passes (``verl.trainer.ppo.ray_trainer.compute_advantage``, every estimator name but
``gae`` and ``grpo``): ``token_level_rewards (B, T)``, ``response_mask (B, T)``, ``config`` (the
``AlgoConfig``, or None), ``index`` (the batch's ``uid`` column) and, when the batch has them,
``reward_baselines``. It never passes ``norm_adv_by_std_in_grpo`` or ``epsilon`` as keywords: the switch
travels in ``config.norm_adv_by_std_in_grpo``. Options read here, each with the meaning verl gives it:

- ``norm_adv_by_std_in_grpo`` (keyword, else ``config``, else True): ``treadle_grpo`` divides by the group
  std only when True (False: Dr.GRPO's ``r - mean``, as verl's ``grpo``). A keyword that contradicts the
  config raises ValueError.
- ``epsilon`` (keyword, default 1e-6): ``/(std + epsilon)``.
- ``reward_baselines``: ignored, as verl's ``grpo`` / ``rloo`` / ``reinforce_plus_plus_baseline`` ignore it
  (ReMax's greedy baselines: the baseline here is the group's).
- ``config.treadle`` (a dict config only; ``AlgoConfig`` has no such field) or keywords ``singleton``,
  ``std``, ``eps_placement``: treadle's options of :func:`treadle.ops.grpo_advantages` (unknown keys raise).
- ``flags`` / ``valid`` (``(B,)`` bool, keywords or carried by :class:`RowUid` uids): WEFT atomic-turn rows:
  flagged rows get ``min(A, 0)`` (after every normalisation), invalid rows 0 and no part in the statistics.
- Any other keyword raises TypeError. ``gamma``, ``lam``, ``use_kl_in_reward``, ``filter_groups``,
  ``rollout_correction``, ``use_pf_ppo`` act outside the estimator in verl (before it, on the rewards, or in
  the GAE branch only) and are not read, as verl's outcome estimators do not read them.

Semantics, under verl's names, equal verl's numbers: unbiased std, ``/(std + epsilon)``, a group of one gets
verl's mean 0 / std 1. ``treadle_reinforce_baseline`` is verl's ``reinforce_plus_plus_baseline``: ``r - m``
per group, broadcast to the response tokens, then whitened over the batch's response tokens (token-weighted
mean and variance, Bessel's correction over the token count, ``/sqrt(var + 1e-8)``). The row-weighted
whitening of :func:`treadle.ops.grpo_advantages` (``estimator="reinforce_baseline"``: every row weighs the
same, ``/(std + epsilon)``) is registered as ``treadle_reinforce_baseline_row_whitened``. One deliberate
difference everywhere: a group of equal rewards gets exactly 0, where verl's loop can leave
``(r - mean) / eps`` rounding noise (DESIGN.md: guard on max == min).

verl's trainer never passes per-row keywords from a batch, so a row's flag and validity travel in its uid: a
:class:`RowUid` is the group key (a ``str``: grouping, hashing and verl's reordering, chunking and
concatenation are unchanged) carrying ``flagged`` and ``valid``; the estimator reads them when no explicit
``flags`` / ``valid`` is given (:func:`treadle.weft.rl.groups.to_verl` writes such uids).
"""
from __future__ import annotations

import importlib.util

import torch

from treadle.grpo.grouping import group_ids_from_uids
from treadle.ops.grpo_advantages import grpo_advantages

ESTIMATOR_NAMES = {
    "treadle_grpo": "grpo",
    "treadle_dr_grpo": "dr_grpo",
    "treadle_rloo": "rloo",
    "treadle_reinforce_baseline": "reinforce_plus_plus_baseline",
    "treadle_reinforce_baseline_row_whitened": "reinforce_baseline",
}
"""verl registry name -> what it computes (verl's own estimator name where it matches verl's numbers; an op
estimator of :func:`treadle.ops.grpo_advantages` otherwise)."""

_TREADLE_OPTIONS = ("singleton", "std", "eps_placement")
_IGNORED = ("reward_baselines",)


class EstimatorNameClash(ValueError):
    """A name treadle registers already holds another function in verl's estimator registry."""


class RowUid(str):
    """A verl ``uid`` (the group key, a ``str``) that carries its row's WEFT ``flagged`` and ``valid``
    (see the module docstring). Pickles (Ray) and copies with both attributes."""

    flagged: bool
    valid: bool

    def __new__(cls, key: str, flagged: bool = False, valid: bool = True):
        obj = super().__new__(cls, key)
        obj.flagged, obj.valid = bool(flagged), bool(valid)
        return obj

    def __reduce__(self):
        return (RowUid, (str(self), self.flagged, self.valid))

    def __repr__(self) -> str:
        return f"RowUid({str(self)!r}, flagged={self.flagged}, valid={self.valid})"


def _uid_masks(index, flags, valid) -> dict:
    """``flags`` / ``valid`` for the op: the explicit ones, else those carried by :class:`RowUid` entries
    of ``index`` (plain uids: not flagged, valid).

    Raises:
        ValueError: an explicit mask disagrees with the one the uids carry.
    """
    tagged = [u for u in index if isinstance(u, RowUid)]
    if not tagged:
        return {k: v for k, v in (("flags", flags), ("valid", valid)) if v is not None}
    carried = {"flags": [isinstance(u, RowUid) and u.flagged for u in index],
               "valid": [not isinstance(u, RowUid) or u.valid for u in index]}
    out = {}
    for name, given in (("flags", flags), ("valid", valid)):
        if given is not None and torch.as_tensor(given, dtype=torch.bool).reshape(-1).tolist() != carried[name]:
            raise ValueError(f"{name} disagrees with the {name} the RowUid index entries carry; pass one or the other")
        out[name] = carried[name] if given is None else given
    return out


def _config_get(config, key: str, default=None):
    """``config[key]`` of an ``AlgoConfig`` / ``DictConfig`` / dict (attribute or mapping), else ``default``."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except (KeyError, AttributeError):
            pass
    return getattr(config, key, default)


def _options(config, kwargs) -> dict:
    """treadle's op options from ``config.treadle`` then the keywords (both checked: unknown keys raise)."""
    opts = {"singleton": "raw", "std": "unbiased", "eps_placement": "std"}
    extra = _config_get(config, "treadle")
    for where, source in (("config.treadle", extra or {}), ("keyword", kwargs)):
        unknown = sorted(set(source) - set(_TREADLE_OPTIONS) - set(_IGNORED))
        if unknown:
            err = TypeError if where == "keyword" else ValueError
            raise err(f"unknown {where} option(s) {unknown} for a treadle verl estimator; known: "
                      f"{list(_TREADLE_OPTIONS)} (plus verl's token_level_rewards, response_mask, index, epsilon, "
                      f"norm_adv_by_std_in_grpo, config, reward_baselines, flags, valid)")
        for k in _TREADLE_OPTIONS:
            if k in source:
                opts[k] = source[k]
    return opts


def _norm_by_std(keyword, config) -> bool:
    from_config = _config_get(config, "norm_adv_by_std_in_grpo")
    if keyword is not None and from_config is not None and bool(keyword) != bool(from_config):
        raise ValueError(f"norm_adv_by_std_in_grpo={keyword!r} (keyword) contradicts "
                         f"config.norm_adv_by_std_in_grpo={from_config!r}; give one")
    value = keyword if keyword is not None else from_config
    return True if value is None else bool(value)


def _token_whiten(adv: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten`` of the row values ``adv`` broadcast over ``mask`` (``(B, T)``), restricted to
    the ``rows`` considered: token-weighted mean and variance, Bessel over the token count,
    ``(a - mean) / sqrt(var + 1e-8)``; returns ``(B,)`` float64 (0 outside ``rows``).

    Raises:
        ValueError: fewer than two response tokens in the considered rows (verl raises too: no variance).
    """
    w = mask.to(torch.float64).sum(-1) * rows.to(torch.float64)
    n = float(w.sum())
    if n < 2:
        raise ValueError(f"reinforce_plus_plus_baseline whitens over response tokens: the batch has {n:g} "
                         f"considered response token(s), at least 2 are needed")
    a = adv.to(torch.float64)
    if bool(rows.any()) and bool(a[rows].max() == a[rows].min()):
        return torch.zeros_like(a)  # exactly 0 (no rounding noise of an inexact mean)
    mean = (a * w).sum() / n
    var = ((a - mean) ** 2 * w).sum() / n * (n / (n - 1))
    return torch.where(rows, (a - mean) * torch.rsqrt(var + 1e-8), torch.zeros_like(a))


def make_estimator(estimator: str):
    """A verl-signature advantage function computing ``estimator`` (a value of :data:`ESTIMATOR_NAMES`)."""

    def compute(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, epsilon: float = 1e-6,
                norm_adv_by_std_in_grpo: bool | None = None, config=None, flags=None, valid=None, **kwargs):
        if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
            raise ValueError(f"token_level_rewards and response_mask must both be (B, T); got "
                             f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}")
        if index is None or len(index) != token_level_rewards.shape[0]:
            raise ValueError(f"index (the batch's uid column) must have {token_level_rewards.shape[0]} entries, "
                             f"got {None if index is None else len(index)}")
        opts = _options(config, kwargs)
        scores = token_level_rewards.sum(dim=-1)
        ids = group_ids_from_uids(index, device=scores.device)
        with torch.no_grad():
            masks = {k: torch.as_tensor(v, dtype=torch.bool, device=scores.device)
                     for k, v in _uid_masks(index, flags, valid).items()}
            if estimator == "reinforce_plus_plus_baseline":
                flagged = masks.pop("flags", None)
                centred = grpo_advantages(scores, ids, estimator="dr_grpo", eps=epsilon, **opts, **masks)
                rows = masks.get("valid", torch.ones_like(scores, dtype=torch.bool))
                adv = _token_whiten(centred, response_mask, rows)
                if flagged is not None:
                    adv = torch.where(flagged, adv.clamp(max=0.0), adv)
            else:
                scale = None
                if estimator == "grpo":
                    scale = "group" if _norm_by_std(norm_adv_by_std_in_grpo, config) else "none"
                adv = grpo_advantages(scores, ids, estimator=estimator, eps=epsilon, scale_rewards=scale, **opts,
                                      **masks)
            out = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
        return out, out

    compute.__name__ = f"compute_treadle_{estimator}_outcome_advantage"
    compute.__doc__ = f"verl advantage estimator backed by treadle.ops.grpo_advantages ({estimator})."
    compute.treadle_estimator = estimator
    return compute


def register_verl_estimators() -> list[str]:
    """Register treadle's estimators in verl's registry; returns the names registered (a re-import replaces
    treadle's own earlier functions).

    Raises:
        ImportError: verl (its ``core_algos`` module) cannot be imported.
        EstimatorNameClash: a name already holds a function that is not treadle's (nothing is registered).
    """
    from verl.trainer.ppo import core_algos

    reg = core_algos.ADV_ESTIMATOR_REGISTRY
    clash = {n: reg[n] for n in ESTIMATOR_NAMES if n in reg and getattr(reg[n], "treadle_estimator", None) is None}
    if clash:
        raise EstimatorNameClash(
            "verl's advantage-estimator registry already holds "
            + ", ".join(f"{n!r} -> {getattr(f, '__module__', '?')}.{getattr(f, '__name__', f)}"
                        for n, f in clash.items())
            + "; treadle's estimators would replace them: remove that registration or rename it")
    for name, est in ESTIMATOR_NAMES.items():
        reg[name] = make_estimator(est)
    return list(ESTIMATOR_NAMES)


if importlib.util.find_spec("verl") is not None:
    try:
        register_verl_estimators()
    except ImportError:  # verl installed without what its core needs: the adapter stays callable
        pass

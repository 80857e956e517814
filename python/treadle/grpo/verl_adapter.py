"""verl drop-in: treadle's estimators in verl's advantage-estimator registry.

Importing this module registers, when verl is importable, ``treadle_grpo``, ``treadle_dr_grpo``,
``treadle_rloo`` and ``treadle_reinforce_baseline`` with ``verl.trainer.ppo.core_algos.register_adv_est``.
Use it from a verl config with ``algorithm.adv_estimator=treadle_grpo`` after importing this module in
the driver and workers (e.g. verl's ``external_lib`` option, or an ``import`` in your entry point).

Each function takes verl's arguments (``token_level_rewards (B, T)``, ``response_mask (B, T)``,
``index`` (uids, np.ndarray), ``epsilon``, ``norm_adv_by_std_in_grpo``, ``config``) and returns
``(advantages, returns)``, both ``(B, T)``. Configured like verl (the defaults here), the numbers equal
verl's: unbiased std, ``/(std + epsilon)``, a group of one gets verl's mean 0 / std 1. One deliberate
difference: a group of equal rewards gets exactly 0, where verl's loop can leave ``(r - mean) / eps``
rounding noise (DESIGN.md: guard on max == min). Extra options come from ``config`` when it has a
``treadle`` mapping (``singleton``, ``std``, ``eps_placement``) or from keyword arguments; ``flags`` and
``valid`` (``(B,)`` bool, optional) are passed to the op (WEFT atomic-turn rows: flagged rows get
``min(A, 0)``, invalid rows 0 and no part in the statistics).

verl's trainer (``verl.trainer.ppo.ray_trainer.compute_advantage``) calls a registered estimator with
``token_level_rewards``, ``response_mask``, ``config`` and ``index`` (the batch's ``uid`` column) only:
keyword arguments never reach it from a batch. So a row's flag and validity travel in its uid: a
:class:`RowUid` is the group key (a ``str``: grouping, hashing and verl's reordering, chunking and
concatenation are unchanged) carrying ``flagged`` and ``valid``; the estimator reads them when no
explicit ``flags`` / ``valid`` is given (:func:`treadle.weft.rl.groups.to_verl` writes such uids).
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
    "treadle_reinforce_baseline": "reinforce_baseline",
}


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


def _options(config, kwargs) -> dict:
    opts = {"singleton": "raw", "std": "unbiased", "eps_placement": "std"}
    extra = getattr(config, "treadle", None) if config is not None else None
    if extra is None and isinstance(config, dict):
        extra = config.get("treadle")
    for source in (extra or {}, kwargs):
        for k in ("singleton", "std", "eps_placement"):
            if k in source:
                opts[k] = source[k]
    return opts


def make_estimator(estimator: str):
    """A verl-signature advantage function computing ``estimator`` with treadle's op."""

    def compute(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index, epsilon: float = 1e-6,
                norm_adv_by_std_in_grpo: bool = True, config=None, flags=None, valid=None, **kwargs):
        if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
            raise ValueError(f"token_level_rewards and response_mask must both be (B, T); got "
                             f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}")
        if len(index) != token_level_rewards.shape[0]:
            raise ValueError(f"index has {len(index)} entries for {token_level_rewards.shape[0]} rows")
        opts = _options(config, kwargs)
        scores = token_level_rewards.sum(dim=-1)
        ids = group_ids_from_uids(index, device=scores.device)
        scale = None
        if estimator == "grpo":
            scale = "group" if norm_adv_by_std_in_grpo else "none"
        with torch.no_grad():
            masks = {k: torch.as_tensor(v, dtype=torch.bool, device=scores.device)
                     for k, v in _uid_masks(index, flags, valid).items()}
            adv = grpo_advantages(scores, ids, estimator=estimator, eps=epsilon, scale_rewards=scale, **opts, **masks)
            out = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
        return out, out

    compute.__name__ = f"compute_treadle_{estimator}_outcome_advantage"
    compute.__doc__ = f"verl advantage estimator backed by treadle.ops.grpo_advantages(estimator={estimator!r})."
    return compute


def register_verl_estimators() -> list[str]:
    """Register treadle's estimators in verl's registry; returns the names registered.

    Raises:
        ImportError: verl (its ``core_algos`` module) cannot be imported.
    """
    from verl.trainer.ppo import core_algos

    names = []
    for name, est in ESTIMATOR_NAMES.items():
        if name not in core_algos.ADV_ESTIMATOR_REGISTRY:
            core_algos.register_adv_est(name)(make_estimator(est))
        names.append(name)
    return names


if importlib.util.find_spec("verl") is not None:
    try:
        register_verl_estimators()
    except ImportError:  # verl installed without what its core needs: the adapter stays callable
        pass

"""TRL drop-in: ``GRPOTrainer`` with treadle's advantages.

Use :class:`treadle.grpo.trl_trainer.TreadleGRPOTrainer` instead of ``trl.GRPOTrainer`` (same arguments, plus ``estimator`` and
treadle options). TRL's own computation stays in place; after it, the advantages of the batch are
recomputed from the same rewards with :func:`treadle.ops.grpo_advantages` and replace TRL's. Groups
come from ids (TRL's sampler puts the ``num_generations`` completions of a prompt side by side, so the
ids are ``row // num_generations``), never from a reshape.

Configured like TRL (:func:`trl_options`: ``eps=1e-4``, unbiased std, unscorable (NaN) rows skipped,
``scale_rewards`` "group"/"batch"/"none", or TRL's booleans: True = "group", False = "none"), the numbers equal TRL's except one documented difference:
groups of equal rewards get exactly 0 rather than TRL's ``(r - mean) / 1e-4`` rounding noise.
"""
from __future__ import annotations

import torch

from treadle.ops.grpo_advantages import grpo_advantages


SCALE_REWARDS = ("group", "batch", "none")


def normalize_scale_rewards(scale_rewards: str | bool) -> str:
    """TRL's ``scale_rewards`` as one of :data:`SCALE_REWARDS`: booleans mapped the way
    ``trl.GRPOConfig`` maps them (True -> "group", False -> "none").

    Raises:
        ValueError: anything else than "group", "batch", "none", True or False.
    """
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be 'group', 'batch', 'none', True or False (TRL's GRPOConfig values), "
                         f"got {scale_rewards!r}")
    return scale_rewards


def trl_options(scale_rewards: str | bool = "group") -> dict:
    """Keyword arguments of :func:`grpo_advantages` that reproduce TRL's ``scale_rewards`` setting
    (``"group"``, ``"batch"``, ``"none"``, or TRL's booleans True = "group", False = "none").

    Raises:
        ValueError: ``scale_rewards`` is none of those.
    """
    scale_rewards = normalize_scale_rewards(scale_rewards)
    if scale_rewards == "none":
        return {"estimator": "dr_grpo", "eps": 1e-4, "nonfinite": "skip", "std": "unbiased"}
    return {"estimator": "grpo", "scale_rewards": scale_rewards, "eps": 1e-4, "nonfinite": "skip", "std": "unbiased"}


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str | bool = "group", **overrides) -> torch.Tensor:
    """Advantages for TRL's layout: ``rewards (N,)`` with each prompt's ``num_generations`` completions
    contiguous. ``scale_rewards`` as in :func:`trl_options` (booleans accepted). ``overrides`` replace any
    of :func:`trl_options` (e.g. ``estimator="rloo"``).

    Raises:
        ValueError: ``N`` is not a multiple of ``num_generations``; a bad ``scale_rewards``.
    """
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards has {rewards.numel()} rows, not a multiple of num_generations={num_generations}")
    ids = torch.arange(rewards.numel(), device=rewards.device) // num_generations
    return grpo_advantages(rewards, ids, **{**trl_options(scale_rewards), **overrides})


_OPTION_NAMES = ("estimator", "std", "eps", "eps_placement", "singleton", "nonfinite", "backend", "check_finite")


def _check_treadle_options(options) -> None:
    """``treadle_options`` are :func:`grpo_advantages` options other than the per-row masks and
    ``scale_rewards`` (that one is TRL's config field).

    Raises:
        TypeError: not a dict. ValueError: an unknown key, or ``scale_rewards`` (set it in the GRPOConfig).
    """
    if options is None:
        return
    if not isinstance(options, dict):
        raise TypeError(f"treadle_options must be a dict, got {type(options).__name__}")
    if "scale_rewards" in options:
        raise ValueError("treadle_options may not set scale_rewards: it is GRPOConfig(scale_rewards=...)")
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown treadle_options {unknown}; known: {list(_OPTION_NAMES)}")

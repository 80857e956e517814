"""TRL drop-in: ``GRPOTrainer`` with treadle's advantages.

Use :class:`TreadleGRPOTrainer` instead of ``trl.GRPOTrainer`` (same arguments, plus ``estimator`` and
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


def _make_trainer_class():
    from trl import GRPOTrainer

    class TreadleGRPOTrainer(GRPOTrainer):
        """``trl.GRPOTrainer`` whose advantages come from :func:`treadle.ops.grpo_advantages`.

        Extra keyword arguments: ``treadle_options`` (dict of :func:`grpo_advantages` options that
        override :func:`trl_options` of the trainer's ``scale_rewards``, e.g. ``{"estimator": "rloo"}``).

        ``GRPOConfig`` options that change advantages or their aggregation: ``scale_rewards`` ("group",
        "batch", "none", TRL's booleans), ``reward_weights``, ``num_generations`` / ``num_generations_eval``
        are honoured here (the advantages are recomputed from the same weighted rewards);
        ``multi_objective_aggregation="normalize_then_sum"`` is refused (one error at construction); ``loss_type``
        (grpo, bnpo, dr_grpo, dapo, cispo, sapo, vespo, luspo), ``mask_truncated_completions``, ``beta``,
        ``epsilon`` / ``epsilon_high`` / ``delta``, ``importance_sampling_level``, ``top_entropy_quantile``,
        ``off_policy_mask_threshold`` and the vLLM importance-sampling options act after the advantages, in
        TRL's own loss, which runs unchanged on them.
        """

        def __init__(self, *args, treadle_options: dict | None = None, **kwargs):
            args_ = kwargs.get("args", args[2] if len(args) > 2 else None)
            if getattr(args_, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
                raise ValueError("TreadleGRPOTrainer supports multi_objective_aggregation='sum_then_normalize' only "
                                 "(treadle recomputes the advantages from the weighted sum of the rewards)")
            _check_treadle_options(treadle_options)
            super().__init__(*args, **kwargs)
            self.scale_rewards = normalize_scale_rewards(self.scale_rewards)  # TRL's booleans too
            self.treadle_options = dict(treadle_options or {})
            self._treadle_rewards_per_func = None

        def _treadle_rows(self, output, rewards):
            """Hook: ``(rewards, extra op options)`` of the whole (gathered) batch before the advantages, e.g.
            ``{"flags": ...}`` (flagged rows get ``min(A, 0)``); may edit ``output`` (this process's rows).
            Default: unchanged, no options."""
            return rewards, {}

        def _calculate_rewards(self, *args, **kwargs):
            out = super()._calculate_rewards(*args, **kwargs)
            self._treadle_rewards_per_func = out
            return out

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            rpf = self._treadle_rewards_per_func
            if rpf is None:
                return output
            unscorable = torch.isnan(rpf).all(dim=1)
            rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
            rewards[unscorable] = torch.nan
            mode = "train" if self.model.training else "eval"
            g = self.num_generations if mode == "train" else self.num_generations_eval
            rewards, rows = self._treadle_rows(output, rewards)
            adv = trl_advantages(rewards, g, self.scale_rewards, **{**self.treadle_options, **rows})
            local = output["advantages"].shape[0]
            start = self.accelerator.process_index * local
            output["advantages"] = adv[start:start + local].to(output["advantages"].dtype)
            return output

    return TreadleGRPOTrainer


def __getattr__(name):
    if name == "TreadleGRPOTrainer":
        cls = _make_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)

"""``TreadleGRPOTrainer``: TRL's ``GRPOTrainer`` whose advantages come from treadle (imports ``trl``).

:mod:`treadle.grpo.trl_adapter` holds the advantage functions and never imports TRL; this module does,
for the trainer class.
"""
from __future__ import annotations

import torch
from trl import GRPOTrainer

from treadle.grpo.trl_adapter import _check_treadle_options, normalize_scale_rewards, trl_advantages

__all__ = ["TreadleGRPOTrainer"]


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

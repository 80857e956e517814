"""The settings of ``treadle weft train`` (WEFT 4.1 GRPO on the tiny tool policy), engine-free: they map onto
``trl.GRPOConfig`` in :func:`treadle.weft.rl.trl_run.grpo_config`.

Per GRPO step both groupings spend the same rollout budget, ``turns_per_step * G`` turn segments: atomic-turn
groups are ``turns_per_step`` turn starts x ``G`` candidates of that turn; trajectory groups are
``turns_per_step / 2`` task starts (two atomic turns each) x ``G`` whole trajectories.

Why these defaults (measured on the tiny tool policy, ``bench/results/``): ``seq-mean-token-mean`` aggregation
(TRL's ``loss_type="grpo"``) rather than ``token-mean`` (``bnpo``), because a failed candidate carries several
malformed steps (about twice the policy tokens of a passing one), so with ``token-mean`` most of the gradient
weight would come from negative advantages; lr 5e-5 x 4 iterations moves the policy by ``approx_kl`` ~0.01-0.05
per token, where lr 2e-4 x 2 moved it by ~0.05-0.3 and lr 5e-4 collapsed it within 2 steps.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

__all__ = ["WeftTrainConfig", "GROUPINGS"]

GROUPINGS = ("atomic", "trajectory")


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class WeftTrainConfig:
    """GRPO settings (bad values raise ``pydantic.ValidationError``, a ValueError, naming the field).

    Attributes:
        grouping: ``atomic`` (atomic-turn groups) or ``trajectory`` (whole-task groups, ``R = mean_k r_k``).
        seed: seeds episode draws and sampling. steps: GRPO steps (generation batches).
        turns_per_step: turn segments per step and candidate (even: two turns per episode); G: samples per
            group (8: at ~30% per-turn success a group of 4 is all-fail ~24% of the time and carries no
            signal; of 8, ~6%).
        lr, num_iterations, clip_low, clip_high, loss_agg_mode: optimizer and loss (``num_iterations``
            optimizer steps per generation batch; ``loss_agg_mode`` ``seq-mean-token-mean`` or ``token-mean``:
            see the module docstring).
        eval_episodes, eval_samples: held-out evaluation before and after (episodes, samples per turn).
        max_new_tokens, max_steps, temperature: sampling (a gold step is at most 33 tokens with EOS: 40
            leaves room and stops a runaway sample early; ``max_steps`` assistant steps per turn).
        kl_coef: beta of the k3 KL penalty to the start (SFT) policy (GRPO, Shao et al. 2024 eq. 3-4); 0 (no
            reference model kept) turns it off. CLI: ``treadle weft train --kl-coef``.
    """

    grouping: Literal["atomic", "trajectory"] = "atomic"
    seed: int = Field(0, ge=0, strict=True)
    steps: int = Field(16, ge=1, strict=True)
    turns_per_step: int = Field(8, ge=2, strict=True, multiple_of=2)
    G: int = Field(8, ge=2, strict=True)
    lr: float = Field(5e-5, gt=0, allow_inf_nan=False)
    num_iterations: int = Field(4, ge=1, strict=True)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "seq-mean-token-mean"
    eval_episodes: int = Field(24, ge=1, strict=True)
    eval_samples: int = Field(6, ge=2, strict=True)
    max_new_tokens: int = Field(40, ge=1, strict=True)
    max_steps: int = Field(4, ge=1, strict=True)
    temperature: float = Field(1.0, gt=0)
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False)

    @classmethod
    def quick(cls, **overrides) -> "WeftTrainConfig":
        kw = dict(steps=2, turns_per_step=2, G=2, eval_episodes=2, eval_samples=2, max_new_tokens=24, max_steps=2)
        kw.update(overrides)
        return cls(**kw)

    def as_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

"""``WeftGRPOTrainer``: atomic-turn GRPO on TRL's ``GRPOTrainer`` (WEFT 4.1; imports ``trl``).

Flagged turns (repetition, interface violation, malformed call, truncation, step cap) get ``min(A, 0)``;
environment failures are left out of the group, the loss and its normaliser. The environment, the turn
dataset and the config check live in :mod:`treadle.weft.rl.trl_env`, which does not import TRL.
"""
from __future__ import annotations

import torch

from treadle.grpo.trl_trainer import TreadleGRPOTrainer
from treadle.weft.rl.trl_env import _truncated, check_weft_trl_config, weft_environment

__all__ = ["WeftGRPOTrainer"]


class WeftGRPOTrainer(TreadleGRPOTrainer):
    """Atomic-turn GRPO on TRL (see the module docstring). Same arguments as ``trl.GRPOTrainer``;
    ``environment_factory`` defaults to :func:`weft_environment`; the config is checked first
    (:func:`check_weft_trl_config`)."""

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, *a, processing_class=None,
                 environment_factory=None, **kw):
        check_weft_trl_config(args, processing_class, train_dataset)
        env = environment_factory if environment_factory is not None else weft_environment()
        self._weft_completions = None
        super().__init__(model, reward_funcs or [], args, train_dataset, *a, processing_class=processing_class,
                         environment_factory=env, **kw)

    def _tool_call_loop(self, *args, **kwargs):
        out = super()._tool_call_loop(*args, **kwargs)
        self._weft_completions = out[1]
        return out

    def _treadle_rows(self, output, rewards):
        """flags / valid of the whole batch and its rewards (truncated segments score 0); masks the local
        environment failures out of the loss and its normaliser."""
        envs = self.environments or []
        comps = self._weft_completions or [None] * len(envs)
        ids = [row[m.bool()].tolist() for row, m in zip(output["completion_ids"], output["completion_mask"])]
        flags, trunc = [], []
        for env, comp, seq in zip(envs, comps, ids):
            f = set(getattr(env, "flags", ()))
            if _truncated(seq, self.eos_token_ids, self._tokenizer.pad_token_id):
                f.add("truncated")
            last = comp[-1] if comp else {}
            if last.get("tool_calls"):
                f.add("step_cap")
            if "<tool_call>" in str(last.get("content") or ""):
                f.add("malformed_call")
            flags.append(bool(f))
            trunc.append("truncated" in f)
        dev = rewards.device
        flags_all = self.accelerator.gather(torch.tensor(flags, dtype=torch.bool, device=dev))
        trunc_all = self.accelerator.gather(torch.tensor(trunc, dtype=torch.bool, device=dev))
        rewards = torch.where(trunc_all & ~torch.isnan(rewards), torch.zeros_like(rewards), rewards)
        failed = torch.tensor([getattr(e, "env_failure", None) is not None for e in envs], dtype=torch.bool,
                              device=output["completion_mask"].device)
        if failed.any():  # left out of the loss and its normaliser, not only of the group
            keep = (~failed).to(output["completion_mask"].dtype).unsqueeze(1)
            output["completion_mask"] = output["completion_mask"] * keep
            loss_mask = output["completion_mask"]
            if output.get("tool_mask") is not None:
                loss_mask = loss_mask * output["tool_mask"]
            if "num_items_in_batch" in output:
                output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        self._weft_completions = None
        return rewards, {"flags": flags_all}

"""``WeftGRPOTrainer``: WEFT GRPO on TRL's ``GRPOTrainer`` (WEFT 4.1; imports ``trl``).

Atomic-turn groups (:class:`~treadle.weft.rl.trl_env.WeftRollout` environments): flagged turns (repetition,
interface violation, malformed call, truncation, step cap) get ``min(A, 0)``. Trajectory groups
(:class:`~treadle.weft.rl.trl_env.WeftTrajectory`, the ablation baseline): each rollout plays the whole task,
turn after turn, in TRL's tool loop (the user's next request appended between turns, masked out of the loss),
rewarded ``R = mean_k r_k``, with no flags. Either way, environment failures are left out of the group, the
loss and its normaliser. The environment, the turn
dataset and the config check live in :mod:`treadle.weft.rl.trl_env`, which does not import TRL.
"""
from __future__ import annotations

import torch

from treadle.grpo.trl_trainer import TreadleGRPOTrainer
from treadle.weft.rl.trl_env import WeftTrajectory, _truncated, check_weft_trl_config, weft_environment

__all__ = ["WeftGRPOTrainer"]


class WeftGRPOTrainer(TreadleGRPOTrainer):
    """Atomic-turn GRPO on TRL (see the module docstring). Same arguments as ``trl.GRPOTrainer``;
    ``environment_factory`` defaults to :func:`weft_environment`; the config is checked first
    (:func:`check_weft_trl_config`)."""

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, *a, processing_class=None,
                 environment_factory=None, skip_zero_advantage: bool = False, **kw):
        check_weft_trl_config(args, processing_class, train_dataset)
        env = environment_factory if environment_factory is not None else weft_environment()
        self._weft_completions = None
        super().__init__(model, reward_funcs or [], args, train_dataset, *a, processing_class=processing_class,
                         environment_factory=env, **kw)
        self.skip_zero_advantage = bool(skip_zero_advantage) and self._zero_rows_add_nothing()

    def _zero_rows_add_nothing(self) -> bool:
        """True when a row whose advantage is 0 adds nothing to the loss's gradient: no KL term, no entropy
        bonus, no entropy quantile mask (it ranks every row's tokens), and a loss whose normaliser
        :meth:`_compute_loss` can keep (``grpo``, ``bnpo``, ``dapo``)."""
        return (self.beta == 0.0 and not getattr(self, "_entropy_bonus_enabled", False)
                and self.top_entropy_quantile >= 1.0 and self.loss_type in ("grpo", "bnpo", "dapo"))

    def _compute_loss(self, model, inputs):
        """TRL's loss; with ``skip_zero_advantage``, computed on the micro-batch's rows whose advantage is not 0
        (their clipped policy term is exactly 0: every all-equal group's rows, about half of a WEFT batch), with
        the padding columns they do not use dropped, and scaled so that the normaliser stays the whole
        micro-batch's (``grpo``: rows kept / rows; ``bnpo``: loss tokens kept / loss tokens; ``dapo``: the
        generation batch's token count, unchanged). Same gradient; TRL's logged per-batch metrics (entropy,
        clip ratios) then cover the kept rows."""
        adv = inputs["advantages"]
        keep = adv.reshape(adv.shape[0], -1).ne(0).any(dim=1)
        if not self.skip_zero_advantage or not self.model.training or bool(keep.all()):
            return super()._compute_loss(model, inputs)
        if not bool(keep.any()):  # nothing to learn: a zero loss that still reaches every parameter
            return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        sub = _rows(inputs, keep)
        loss = super()._compute_loss(model, sub)
        if self.loss_type == "grpo":
            return loss * (keep.sum() / keep.numel())
        if self.loss_type == "bnpo":
            return loss * (mask[keep].sum() / mask.sum().clamp(min=1.0))
        return loss

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """TRL's tool loop; for whole-task environments (:class:`~treadle.weft.rl.trl_env.WeftTrajectory`), then
        the task's later turns (:meth:`_next_turns`)."""
        asked = [list(p) for p in prompts]  # (TRL's loop appends the turn's messages to ``prompts`` in place)
        out = super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                      multimodal_fields)
        if self._trajectories():
            out = self._next_turns(asked, prompt_ids, list(out))
        self._weft_completions = out[1]
        return out

    def _trajectories(self) -> bool:
        envs = self.environments or []
        return bool(envs) and all(isinstance(e, WeftTrajectory) for e in envs)

    def _user_suffix_ids(self, message: dict) -> list[int]:
        """The tokens that follow an ended assistant turn (after its EOS) for a user ``message`` and the next
        assistant generation prompt (as TRL's ``_get_tool_suffix_ids`` does for tool messages)."""
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
        kw = dict(tokenize=True, chat_template=self.chat_template, return_dict=False, **self.chat_template_kwargs)
        before = self.processing_class.apply_chat_template(head, add_generation_prompt=False, **kw)
        full = self.processing_class.apply_chat_template(head + [message], add_generation_prompt=True, **kw)
        eos = [i for i, t in enumerate(before) if t == self._tokenizer.eos_token_id]
        if eos:
            before = before[:eos[-1] + 1]
        if full[:len(before)] != before:
            raise ValueError("chat template: a user message does not continue the conversation's tokens")
        return full[len(before):]

    def _next_turns(self, asked, prompt_ids, out):
        """Play the rest of each whole-task rollout: while its environment has a next turn
        (:meth:`~treadle.weft.rl.trl_env.WeftTrajectory._end_turn` verifies the turn just played and returns the
        next request), append the user's request (masked out of the loss like tool results; an EOS first when the
        turn was cut), generate the reply from the whole history and run TRL's tool loop on it. A row whose
        context would reach the model's length ends there (its later turns score 0)."""
        from trl.chat_template_utils import parse_response

        tool_mask, comps, comp_ids, logprobs, n_calls, n_fail, tool_images = out
        envs, pad, eos = self.environments, self._tokenizer.pad_token_id, self._tokenizer.eos_token_id
        limit = self.model.config.max_position_embeddings
        last = list(comp_ids)  # each row's tokens of the turn just played
        active = list(range(len(envs)))
        while active:
            rows = {}
            for i in active:
                cut = _truncated(last[i], self.eos_token_ids, pad)
                request = envs[i]._end_turn(truncated=cut)
                if request is None:
                    continue
                user = {"role": "user", "content": request}
                suffix = ([eos] if cut else []) + self._user_suffix_ids(user)
                context = prompt_ids[i] + comp_ids[i] + suffix
                if len(context) >= limit:
                    continue
                rows[i] = (user, suffix, context)
            active = sorted(rows)
            if not active:
                break
            gen, gen_lp = self._generate_single_turn([rows[i][2] for i in active], None, {}, num_generations=1)
            n = len(envs)
            sub_prompts = [asked[i] + comps[i] + [rows[i][0]] if i in rows else [] for i in range(n)]
            sub_ids = [rows[i][2] if i in rows else prompt_ids[i] + comp_ids[i] for i in range(n)]
            sub_comp, sub_msgs, sub_lp = [[] for _ in range(n)], [[{}] for _ in range(n)], None
            if logprobs is not None:
                sub_lp = [[] for _ in range(n)]
            for j, i in enumerate(active):
                tools = (self._env_tools[self._batch_environments[i]] if self.environment_factories is not None
                         else self.tools)
                sub_comp[i] = list(gen[j])
                sub_msgs[i] = [parse_response(self._tokenizer, gen[j], prefix=sub_ids[i], tools=tools)
                               if gen[j] else {}]
                if sub_lp is not None:
                    sub_lp[i] = list(gen_lp[j])
            t_mask, t_msgs, t_ids, t_lp, calls, fails, _ = super()._tool_call_loop(
                sub_prompts, sub_ids, sub_comp, sub_msgs, sub_lp, None, {})
            n_calls, n_fail = n_calls + calls, n_fail + fails
            for i in active:
                user, suffix, _ = rows[i]
                comp_ids[i] = comp_ids[i] + suffix + t_ids[i]
                tool_mask[i] = tool_mask[i] + [0] * len(suffix) + t_mask[i]
                if logprobs is not None:
                    logprobs[i] = logprobs[i] + [0.0] * len(suffix) + t_lp[i]
                comps[i] = comps[i] + [user] + [m for m in t_msgs[i] if m]
                last[i] = t_ids[i]
        return tool_mask, comps, comp_ids, logprobs, n_calls, n_fail, tool_images

    def _treadle_rows(self, output, rewards):
        """flags / valid of the whole batch and its rewards (truncated segments score 0); masks the local
        environment failures out of the loss and its normaliser."""
        envs = self.environments or []
        if self._trajectories():  # the published baseline: no flags; a cut turn already scored 0
            return self._mask_env_failures(output, rewards, envs), {}
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
        return self._mask_env_failures(output, rewards, envs), {"flags": flags_all}

    def _mask_env_failures(self, output, rewards, envs):
        """Environment failures out of the loss and its normaliser (the group already leaves out their NaN
        rewards); returns ``rewards``."""
        failed = torch.tensor([getattr(e, "env_failure", None) is not None for e in envs], dtype=torch.bool,
                              device=output["completion_mask"].device).reshape(-1)
        if failed.numel() == output["completion_mask"].shape[0]:
            keep = (~failed).to(output["completion_mask"].dtype).unsqueeze(1)
            output["completion_mask"] = output["completion_mask"] * keep
        loss_mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            loss_mask = loss_mask * output["tool_mask"]
        if "num_items_in_batch" in output:  # every rank joins the gather, failures or not
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        self._weft_completions = None
        return rewards


def _rows(inputs: dict, keep: torch.Tensor) -> dict:
    """``inputs`` (one TRL micro-batch) restricted to the rows ``keep``, without the padding columns no kept row
    uses (left padding of the prompts, right padding of the completions; RoPE positions shift by a constant,
    which leaves attention unchanged)."""
    n = keep.numel()
    pm, cm = inputs["prompt_mask"][keep], inputs["completion_mask"][keep]
    p0 = int((pm.sum(0) > 0).nonzero()[0]) if bool(pm.any()) else pm.shape[1]
    used = (cm.sum(0) > 0).nonzero()
    c1 = int(used[-1]) + 1 if used.numel() else 1
    width = inputs["completion_ids"].shape[1]
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n:
            v = v[keep]
            if k in ("prompt_ids", "prompt_mask"):
                v = v[:, p0:]
            elif v.dim() >= 2 and v.shape[1] == width:
                v = v[:, :c1]
        out[k] = v
    return out

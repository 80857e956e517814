"""``treadle demo`` section ``grpo-train``: a real GRPO run on the embedded tiny model.

A thin orchestration over public APIs, meant to be copied:

1. :func:`treadle.models.load_default_model` (trains the tiny Qwen3 if the cache is empty, or
   loads any local HF checkpoint given by ``model_path`` / ``$TREADLE_MODEL``);
2. a difficulty level where the policy is sometimes right (sampled reward closest to 1/2);
3. per step: prompts from :class:`treadle.data.ProblemGenerator`, ``G`` samples per prompt
   (:func:`treadle.models.generation.generate`), 0/1 rewards from math-verify
   (:func:`treadle.data.reward`), advantages from :func:`treadle.ops.grpo_advantages` with group
   ids = the problems' uids (never positions), the clipped policy loss with ``seq-mean-token-mean``
   aggregation (:func:`treadle.grpo.losses.policy_loss`), ``num_iterations`` optimizer steps per
   batch (GRPO's mu; DeepSeekMath sec. 4.1.2, Shao et al. 2024), and the per-update KL between the
   sampling policy and the updated one (``update_kl``: how far each batch moved the policy);
4. a summary table and a run folder: ``config.json``, ``steps.jsonl`` (one line per step),
   ``reward_curve.png``, ``summary.json``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from treadle.figures import png_figure

__all__ = ["GRPODemoConfig", "run", "train_grpo", "sequence_logprobs", "paired_change"]


#: loss aggregations the demo can run (``seq-mean-token-sum-norm`` needs a norm constant it does not set)
DEMO_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class GRPODemoConfig:
    """Settings of the demo run.

    A frozen pydantic dataclass (``dataclasses.asdict`` works): a bad value raises
    ``pydantic.ValidationError`` (a ``ValueError``) naming the field, before any model is loaded.

    Attributes:
        seed: seeds prompts and sampling.
        steps: GRPO steps (one batch of prompts each).
        prompts_per_step: distinct problems per step; group_size: samples per problem (G >= 2:
            a group of one has no spread, so its advantage is always 0).
        num_iterations: optimizer steps per batch (mu); > 1 makes the clip active.
        lr: AdamW learning rate; clip_low / clip_high: PPO clip range; temperature: sampling.
        level: difficulty level, or None to pick the one whose sampled reward is closest to 1/2.
        eval_prompts, eval_samples: held-out prompts x samples for reward before/after.
        max_new_tokens: completion budget.
        loss_agg_mode: loss aggregation, one of :data:`DEMO_LOSS_AGG_MODES`.

    Defaults: lr 5e-5 x 4 optimizer steps per batch with ``seq-mean-token-mean`` (each completion weighs
    the same); lr 3e-4 x 2 with ``token-mean`` moves the tiny model too far per batch (held-out greedy
    accuracy falls). 384 held-out prompts (a few seconds of generation) keep the paired interval of the
    reward change narrow. Measured results: ``bench/results/`` (demo over 3 seeds).
    """

    seed: int = Field(0, ge=0, strict=True)
    steps: int = Field(60, ge=1, strict=True)
    prompts_per_step: int = Field(16, ge=1, strict=True)
    group_size: int = Field(8, ge=2, strict=True)
    num_iterations: int = Field(4, ge=1, strict=True)
    lr: float = Field(5e-5, gt=0, allow_inf_nan=False)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, gt=0, allow_inf_nan=False)
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False)
    level: int | None = Field(None, strict=True)
    eval_prompts: int = Field(384, ge=1, strict=True)
    eval_samples: int = Field(4, ge=1, strict=True)
    max_new_tokens: int = Field(10, ge=1, strict=True)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "seq-mean-token-mean"

    @field_validator("level")
    @classmethod
    def _level_exists(cls, v: int | None) -> int | None:
        from treadle.data.arithmetic import difficulty

        if v is not None:
            difficulty(v)  # ValueError naming the valid range
        return v

    @classmethod
    def quick(cls, **overrides) -> "GRPODemoConfig":
        """Seconds-long smoke-test settings."""
        kw = dict(steps=2, prompts_per_step=4, group_size=4, eval_prompts=4, eval_samples=2, max_new_tokens=6)
        kw.update(overrides)
        return cls(**kw)


def sequence_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the completion tokens under ``model``.

    Args:
        prompt_ids, prompt_mask: ``(N, P)`` int64, left-padded prompts.
        completion_ids, completion_mask: ``(N, C)`` int64, right-padded completions.

    Returns:
        ``(N, C)`` float32 ``log p(completion_t | prefix)``; positions are ``cumsum(mask) - 1``, as
        in HF generation with left padding. Padding positions hold arbitrary finite values.
    """
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    p = prompt_ids.shape[1]
    logits = logits[:, p - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def _rewards_per_prompt(model, tokenizer, problems, *, samples: int, max_new_tokens: int, seed: int,
                        temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt rewards on ``problems``: ``(sampled (P,) float64: mean 0/1 reward of ``samples``
    completions at ``temperature``, greedy (P,) float64: 0/1)``."""
    from treadle.data.verify import reward
    from treadle.models.generation import generate

    prompts = [p.prompt for p in problems]
    gen = generate(model, tokenizer, prompts, n=samples, max_new_tokens=max_new_tokens, do_sample=True,
                   temperature=temperature, seed=seed)
    sampled = torch.zeros(len(problems), dtype=torch.float64)
    for t, i in zip(gen.texts, gen.prompt_index.tolist()):
        sampled[i] += reward(t, problems[i].answer)
    greedy = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    right = torch.tensor([float(reward(t, p.answer)) for t, p in zip(greedy.texts, problems)], dtype=torch.float64)
    return sampled / samples, right


def _mean_reward(model, tokenizer, problems, *, samples: int, max_new_tokens: int, seed: int,
                 temperature: float) -> tuple[float, float]:
    """(mean sampled reward, greedy accuracy) on ``problems``."""
    sampled, greedy = _rewards_per_prompt(model, tokenizer, problems, samples=samples, max_new_tokens=max_new_tokens,
                                          seed=seed, temperature=temperature)
    return sampled.mean().item(), greedy.mean().item()


def paired_change(before: torch.Tensor, after: torch.Tensor) -> tuple[float, float, float]:
    """Mean per-prompt change ``after - before`` and its normal-approximation 95% interval.

    Args:
        before, after: ``(P,)`` per-prompt rewards of the same held-out prompts, before and after training.

    Returns:
        ``(mean, low, high)``: ``mean(d) -/+ 1.96 * std(d) / sqrt(P)`` with ``d = after - before``
        (the uncertainty from the choice of held-out prompts and samples for this one run; the spread
        over training seeds is not in it). ``low == high == mean`` when ``P < 2``.

    Raises:
        ValueError: the shapes differ or are not 1-D.
    """
    if before.dim() != 1 or before.shape != after.shape:
        raise ValueError(f"before and after must be 1-D per-prompt rewards of one shape, got {tuple(before.shape)} "
                         f"and {tuple(after.shape)}")
    d = (after.double() - before.double())
    mean = d.mean().item() if d.numel() else float("nan")
    if d.numel() < 2:
        return mean, mean, mean
    half = 1.96 * d.std().item() / d.numel() ** 0.5
    return mean, mean - half, mean + half


def pick_level(model, tokenizer, cfg: GRPODemoConfig, n: int = 32) -> tuple[int, dict]:
    """The level whose mean sampled reward (``n`` held-out prompts x ``cfg.group_size``) is closest
    to 1/2, and the probe's per-level rewards."""
    from treadle.data.arithmetic import LEVELS, ProblemGenerator

    gen = ProblemGenerator(cfg.seed + 7)
    probe = {}
    for lv in range(1, len(LEVELS) + 1):
        probe[lv], _ = _mean_reward(model, tokenizer, gen.batch(lv, n, split="heldout"), samples=min(cfg.group_size, 4),
                                    max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + lv, temperature=cfg.temperature)
    return min(probe, key=lambda lv: (abs(probe[lv] - 0.5), lv)), probe


def train_grpo(model, tokenizer, cfg: GRPODemoConfig, *, level: int, log=None, progress: bool = True) -> list[dict]:
    """Run ``cfg.steps`` GRPO steps on ``model`` in place; returns one record per step.

    Each record holds ``update_kl``: the per-token k3 estimate of ``KL(pi_old || pi_new)`` (GRPO eq. 4's
    estimator, :func:`treadle.grpo.losses.kl_k3`) on the batch's own completions, between the policy that
    sampled them and the policy after the batch's ``num_iterations`` optimizer steps: how far one update
    moved the policy (``approx_kl`` is the loss's own statistic at the last iteration, before its step).

    Raises:
        ValueError: ``level`` out of range (from the generator).
    """
    from tqdm.auto import tqdm
    from treadle.cli_output import progress_enabled  # a bar only on a terminal

    from treadle.data.arithmetic import ProblemGenerator
    from treadle.data.verify import reward
    from treadle.grpo.losses import kl_k3, policy_loss
    from treadle.models.generation import generate
    from treadle.ops import grpo_advantages

    gen_problems = ProblemGenerator(cfg.seed)
    gen_problems.batch(level, 0)  # validates the level before any work
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    records = []
    for step in tqdm(range(cfg.steps), desc="grpo", disable=not progress_enabled(progress), dynamic_ncols=True):
        t0 = time.perf_counter()
        problems = gen_problems.batch(level, cfg.prompts_per_step, split="train")
        g = generate(model, tokenizer, [p.prompt for p in problems], n=cfg.group_size, do_sample=True,
                     temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed * 100_003 + step)
        t_gen = time.perf_counter() - t0
        t1 = time.perf_counter()
        idx = g.prompt_index.tolist()
        rewards = torch.tensor([reward(t, problems[i].answer) for t, i in zip(g.texts, idx)], dtype=torch.float32)
        t_reward = time.perf_counter() - t1
        group_ids = torch.tensor([problems[i].uid for i in idx], dtype=torch.int64)  # prompt ids, never positions
        t2 = time.perf_counter()
        adv = grpo_advantages(rewards, group_ids, estimator="grpo")
        t_adv = time.perf_counter() - t2
        t3 = time.perf_counter()
        cmask = g.completion_mask
        with torch.no_grad():
            old = sequence_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, cmask)
        model.train()
        stats = {}
        for _ in range(cfg.num_iterations):
            logp = sequence_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, cmask)
            loss, stats = policy_loss(logp, old, adv, cmask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      mode=cfg.loss_agg_mode)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        model.eval()
        with torch.no_grad():  # how far this batch's num_iterations updates moved the policy
            new = sequence_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, cmask)
        update_kl = (kl_k3(old, new) * cmask).sum().item() / max(int(cmask.sum()), 1)
        t_train = time.perf_counter() - t3
        n_tok = int(cmask.sum())
        grouped = rewards.view(cfg.prompts_per_step, cfg.group_size)
        rec = {"step": step, "level": level, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
               "groups_all_equal": int((grouped.max(1).values == grouped.min(1).values).sum()),
               "loss": loss.item(), "clipfrac": float(stats["clipfrac"]), "approx_kl": float(stats["approx_kl"]),
               "update_kl": update_kl,
               "completion_tokens": n_tok, "t_generate_s": t_gen, "t_reward_s": t_reward, "t_advantage_s": t_adv,
               "t_train_s": t_train, "t_step_s": time.perf_counter() - t0}
        records.append(rec)
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()
    return records


def _plot(records: list[dict], before: float, after: float, path: Path) -> None:
    steps = [r["step"] for r in records]
    rw = [r["reward_mean"] for r in records]
    k = max(1, len(rw) // 8)
    smooth = [sum(rw[max(0, i - k + 1):i + 1]) / len(rw[max(0, i - k + 1):i + 1]) for i in range(len(rw))]
    with png_figure(path, figsize=(6, 3.5), dpi=100) as (fig, ax):
        ax.plot(steps, rw, alpha=0.35, label="batch mean reward")
        ax.plot(steps, smooth, label=f"moving mean ({k})")
        ax.axhline(before, ls="--", c="gray", label=f"held-out before {before:.2f}")
        ax.axhline(after, ls=":", c="green", label=f"held-out after {after:.2f}")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("reward (math-verify)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7, loc="lower right")


def run(run_dir: Path, quick: bool, console, *, model_path: str | None = None,
        config: GRPODemoConfig | None = None) -> dict:
    """The ``grpo-train`` demo section (see the module docstring).

    Args:
        run_dir: output folder (created).
        quick: smoke-test settings (a seconds-long tiny model in ``tiny-qwen3-quick`` and 2 steps).
        console: a rich Console.
        model_path: a local HF causal-LM checkpoint to use instead of the tiny model (default:
            ``$TREADLE_MODEL`` if set).
        config: override the demo settings.

    Returns:
        The summary dict (also written to ``summary.json``).

    Raises:
        FileNotFoundError, treadle.models.CheckpointError: see :func:`treadle.models.load_default_model`.
    """
    from rich.table import Table

    from treadle.data.arithmetic import ProblemGenerator
    from treadle.models import TinyTrainConfig, load_default_model

    cfg = config or (GRPODemoConfig.quick() if quick else GRPODemoConfig())
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model_path = model_path or os.environ.get("TREADLE_MODEL") or None
    if model_path is None and quick:
        model, tokenizer = load_default_model(config=TinyTrainConfig.quick(), name="tiny-qwen3-quick",
                                              console=console, progress=False)
        source = "tiny-qwen3-quick (cache)"
    else:
        model, tokenizer = load_default_model(model_path, console=console)
        source = model_path or "tiny-qwen3 (cache)"
    t_model = time.perf_counter() - t_start
    torch.manual_seed(cfg.seed)
    if cfg.level is None:
        level, probe = pick_level(model, tokenizer, cfg, n=8 if quick else 32)
    else:
        level, probe = cfg.level, {}
    console.print(f"policy: {source}; level {level} (probe of sampled reward per level: "
                  f"{ {k: round(v, 2) for k, v in probe.items()} })")
    (run_dir / "config.json").write_text(json.dumps({"demo": dataclasses.asdict(cfg), "model": source,
                                                     "level": level, "probe": probe}, indent=1))
    evalset = ProblemGenerator(cfg.seed + 99).batch(level, cfg.eval_prompts, split="heldout")
    ev = dict(samples=cfg.eval_samples, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + 1, temperature=cfg.temperature)
    sampled_before, right_before = _rewards_per_prompt(model, tokenizer, evalset, **ev)
    t_train0 = time.perf_counter()
    with open(run_dir / "steps.jsonl", "w") as log:
        records = train_grpo(model, tokenizer, cfg, level=level, log=log, progress=not quick)
    t_train = time.perf_counter() - t_train0
    sampled_after, right_after = _rewards_per_prompt(model, tokenizer, evalset, **ev)
    before, after = sampled_before.mean().item(), sampled_after.mean().item()
    greedy_before, greedy_after = right_before.mean().item(), right_after.mean().item()
    change = paired_change(sampled_before, sampled_after)
    greedy_change = paired_change(right_before, right_after)
    _plot(records, before, after, run_dir / "reward_curve.png")

    k = max(1, len(records) // 4)
    tok = sum(r["completion_tokens"] for r in records)
    gen_s = sum(r["t_generate_s"] for r in records)
    adv_s = sum(r["t_advantage_s"] for r in records)
    step_s = sum(r["t_step_s"] for r in records)
    summary = {
        "level": level, "steps": len(records), "samples_per_step": cfg.prompts_per_step * cfg.group_size,
        "heldout_sampled_reward_before": before, "heldout_sampled_reward_after": after,
        "heldout_greedy_acc_before": greedy_before, "heldout_greedy_acc_after": greedy_after,
        "heldout_sampled_reward_change": change[0], "heldout_sampled_reward_change_ci95": list(change[1:]),
        "heldout_greedy_acc_change": greedy_change[0], "heldout_greedy_acc_change_ci95": list(greedy_change[1:]),
        "batch_reward_first_quarter": sum(r["reward_mean"] for r in records[:k]) / k,
        "batch_reward_last_quarter": sum(r["reward_mean"] for r in records[-k:]) / k,
        "update_kl_mean": sum(r["update_kl"] for r in records) / len(records),
        "update_kl_max": max(r["update_kl"] for r in records),
        "completion_tokens": tok, "generate_tokens_per_s": tok / max(gen_s, 1e-9),
        "rl_tokens_per_s": tok / max(step_s, 1e-9), "t_advantage_op_s": adv_s, "t_rest_of_steps_s": step_s - adv_s,
        "t_model_load_or_train_s": t_model, "t_grpo_s": t_train, "t_total_s": time.perf_counter() - t_start,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))

    t = Table(title=f"GRPO on {source}: level {level}, {len(records)} steps x {cfg.prompts_per_step} prompts x "
                    f"G={cfg.group_size}")
    t.add_column("reward (math-verify)")
    t.add_column("before", justify="right")
    t.add_column("after", justify="right")
    t.add_column("change (95% interval, paired over prompts)", justify="right")
    t.add_row(f"held-out sampled reward (T={cfg.temperature}, {cfg.eval_prompts} prompts x {cfg.eval_samples})",
              f"{before:.3f}", f"{after:.3f}", f"{change[0]:+.3f} ({change[1]:+.3f}, {change[2]:+.3f})")
    t.add_row("held-out greedy accuracy", f"{greedy_before:.3f}", f"{greedy_after:.3f}",
              f"{greedy_change[0]:+.3f} ({greedy_change[1]:+.3f}, {greedy_change[2]:+.3f})")
    t.add_row("training batch mean reward (first / last quarter of steps)",
              f"{summary['batch_reward_first_quarter']:.3f}", f"{summary['batch_reward_last_quarter']:.3f}", "")
    console.print(t)
    tt = Table(title="throughput and time")
    tt.add_column("what")
    tt.add_column("value", justify="right")
    tt.add_row("per-update KL(pi_old || pi_new), per token: mean / max over steps",
               f"{summary['update_kl_mean']:.4f} / {summary['update_kl_max']:.4f}")
    tt.add_row("completion tokens generated", f"{tok}")
    tt.add_row("tokens/s, generation only", f"{summary['generate_tokens_per_s']:.0f}")
    tt.add_row("tokens/s, whole RL step (generate + reward + advantages + update)", f"{summary['rl_tokens_per_s']:.0f}")
    tt.add_row("time in treadle.ops.grpo_advantages", f"{adv_s * 1e3:.2f} ms ({adv_s / max(step_s, 1e-9):.4%})")
    tt.add_row("time in the rest of the GRPO steps", f"{step_s - adv_s:.1f} s")
    tt.add_row("model load (or training) / GRPO loop / total", f"{t_model:.1f} s / {t_train:.1f} s / "
                                                             f"{summary['t_total_s']:.1f} s")
    console.print(tt)
    console.print(f"run folder: {run_dir} (config.json, steps.jsonl, reward_curve.png, summary.json)")
    return summary

"""``treadle weft train``: GRPO of the tiny tool policy on ``trl.GRPOTrainer``, atomic-turn or trajectory groups.

One run per grouping and seed, in ``<out>/<grouping>-seed<k>/`` (the start policy in ``<out>/start-policy/``): TRL's own output folder ``trl/`` (its checkpoints, one per
``checkpoint_every`` steps: an interrupted run continues from the last one with TRL's
``resume_from_checkpoint``), ``before.json`` (held-out success of the start policy) and, when finished,
``summary.json``. A finished run of the same settings is kept. The settings map onto ``GRPOConfig`` from
:class:`~treadle.weft.rl.config.WeftTrainConfig` (:func:`grpo_config`); the held-out evaluation is
:func:`treadle.weft.rl.sft.evaluate_policy` (sampled per-turn success from the gold history, unseen
customers, products and amounts), before and after.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from treadle.run_dirs import read_stored_json

__all__ = ["grpo_config", "train_seed", "run_trl"]

LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "bnpo"}
"""The update's aggregation -> TRL's ``loss_type`` of the same maths (``seq-mean-token-sum`` has none)."""


def grpo_config(cfg, output_dir: str | Path, *, checkpoint_every: int = 1, vllm: bool = False, **overrides):
    """The ``trl.GRPOConfig`` of a :class:`~treadle.weft.rl.config.WeftTrainConfig` (one generation batch of
    ``turns_per_step`` turn groups x ``G`` candidates per GRPO step, ``num_iterations`` optimizer steps on it).
    ``vllm``: TRL's ``use_vllm=True, vllm_mode="colocate"`` (generation in vLLM on the training GPUs; TRL
    raises at construction where vLLM is not installed). Trajectory grouping spends the same segment budget:
    ``turns_per_step / 2`` task rows (two turns each) x ``G`` whole trajectories per step; the completion
    budget (``max_completion_length``) and the tool-call cap hold per turn.

    Raises:
        ValueError: ``cfg.loss_agg_mode`` has no TRL ``loss_type``.
    """
    import torch
    from trl import GRPOConfig

    if cfg.loss_agg_mode not in LOSS_TYPES:
        raise ValueError(f"loss_agg_mode {cfg.loss_agg_mode!r} has no TRL loss_type; use one of {list(LOSS_TYPES)}")
    rows = cfg.turns_per_step // 2 if cfg.grouping == "trajectory" else cfg.turns_per_step
    kw = dict(output_dir=str(output_dir), per_device_train_batch_size=rows * cfg.G,
              num_generations=cfg.G, max_steps=cfg.steps * cfg.num_iterations, learning_rate=cfg.lr,
              lr_scheduler_type="constant",
              num_iterations=cfg.num_iterations, epsilon=cfg.clip_low, epsilon_high=cfg.clip_high,
              loss_type=LOSS_TYPES[cfg.loss_agg_mode], beta=cfg.kl_coef, temperature=cfg.temperature, top_k=0,
              top_p=1.0, max_completion_length=cfg.max_new_tokens * cfg.max_steps,
              max_tool_calling_iterations=cfg.max_steps - 1, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
              warmup_steps=0, seed=cfg.seed, data_seed=cfg.seed, remove_unused_columns=False, report_to=[],
              logging_steps=1, save_strategy="steps", save_steps=checkpoint_every, save_only_model=False,
              use_cpu=not torch.cuda.is_available(), bf16=False, scale_rewards="group",
              disable_tqdm=True,
              # TRL's default recomputes activations in the backward pass (memory for time): the tiny policy fits,
              # and the recomputation was half the update's time in bench/bench_weft_rl.py
              gradient_checkpointing=False)
    if vllm:
        kw.update(use_vllm=True, vllm_mode="colocate", use_cpu=False)
    kw.update(overrides)
    return GRPOConfig(**kw)


def _last_checkpoint(folder: Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def train_seed(run: Path, policy, cfg, *, held, checkpoint_every: int = 1, console=None, backend=None,
               vllm: bool = False, callbacks=None) -> dict:
    """Train one seed on TRL in ``run`` (resuming from TRL's last checkpoint there); returns its summary.
    ``callbacks``: extra ``transformers.TrainerCallback`` objects for the trainer."""
    from treadle.weft.rl.sft import evaluate_policy
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset
    from treadle.weft.rl.trl_trainer import WeftGRPOTrainer
    from treadle.weft.rl.vocab import with_tool_calling

    run.mkdir(parents=True, exist_ok=True)
    done = run / "summary.json"
    if done.exists():
        return read_stored_json(done, what="finished run summary")
    model, tok = copy.deepcopy(policy[0]), with_tool_calling(copy.deepcopy(policy[1]))
    ev = dict(samples=cfg.eval_samples, seed=cfg.seed * 31 + 100_000, max_new_tokens=cfg.max_new_tokens,
              max_steps=cfg.max_steps)
    bpath = run / "before.json"
    if bpath.exists():
        before = read_stored_json(bpath, what="evaluation before training")
    else:
        before = evaluate_policy(model, tok, held, **ev)
        bpath.write_text(json.dumps(before), encoding="utf-8")
    n_eps = max(1, cfg.steps * cfg.turns_per_step // 2)
    whole = cfg.grouping == "trajectory"
    data = weft_turn_dataset(n_eps, "train", start=500_000 + cfg.seed * 10_000, backend=backend, whole_tasks=whole)
    args = grpo_config(cfg, run / "trl", checkpoint_every=checkpoint_every, vllm=vllm)
    trainer = WeftGRPOTrainer(model=model, args=args, processing_class=tok, train_dataset=data,
                              environment_factory=weft_environment(backend, grouping=cfg.grouping),
                              callbacks=callbacks, skip_zero_advantage=True)  # same gradient, fewer rows
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=_last_checkpoint(run / "trl"))
    seconds = time.perf_counter() - t0
    model.eval()
    after = evaluate_policy(model, tok, held, **ev)
    summary = {"engine": "trl", "config": cfg.as_dict(), "before": before, "after": after,
               "turn_change": after["turn_success_sampled"] - before["turn_success_sampled"],
               "train_seconds": seconds, "global_step": trainer.state.global_step,
               "log": [r for r in trainer.state.log_history if "loss" in r]}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    tmp.replace(done)
    if console is not None:
        console.print(f"{cfg.grouping} seed {cfg.seed} (trl): held-out per-turn {before['turn_success_sampled']:.3f} -> "
                      f"{after['turn_success_sampled']:.3f} ({seconds:.0f} s)", markup=False)
    return summary


def run_trl(out: Path, policy, seeds, *, steps: int | None, quick: bool, console, overrides: dict | None = None,
            checkpoint_every: int = 1, vllm: bool = False, groupings=("atomic",)) -> dict:
    """Every (grouping, seed) run on TRL (:func:`train_seed`; the start policy saved in ``<out>/start-policy``
    first), then ``<out>/summary.json`` (per grouping: mean and sd of the held-out per-turn change over the
    seeds)."""
    import statistics

    from treadle.weft.rl.sft import gold_episodes
    from treadle.weft.rl.config import WeftTrainConfig

    out = Path(out)
    start = out / "start-policy"
    if not (start / "config.json").exists():
        policy[0].save_pretrained(start)
        policy[1].save_pretrained(start)
    summary = {"engine": "trl", "seeds": list(seeds), "groupings": {}}
    held = None
    for grouping in groupings:
        runs = {}
        for seed in seeds:
            kw = {"grouping": grouping, "seed": seed} | ({"steps": steps} if steps else {}) \
                | (overrides or {})
            cfg = WeftTrainConfig.quick(**kw) if quick else WeftTrainConfig(**kw)
            if held is None:
                held = gold_episodes(cfg.eval_episodes, "heldout", start=900_000)
            runs[seed] = train_seed(out / f"{grouping}-seed{seed}", policy, cfg, held=held,
                                    checkpoint_every=checkpoint_every, console=console, vllm=vllm)
        changes = [r["turn_change"] for r in runs.values()]
        summary["groupings"][grouping] = {
            "turn_change_mean": sum(changes) / len(changes),
            "turn_change_sd": statistics.stdev(changes) if len(changes) > 1 else 0.0,
            "runs": {str(k): {"before": v["before"]["turn_success_sampled"],
                              "after": v["after"]["turn_success_sampled"]} for k, v in runs.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    for grouping, g in summary["groupings"].items():
        console.print(f"{grouping} (trl): held-out per-turn success change {g['turn_change_mean']:+.3f} (sd "
                      f"{g['turn_change_sd']:.3f}) over seeds {list(seeds)} -> {out / 'summary.json'}", markup=False)
    return summary

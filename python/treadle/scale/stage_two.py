"""The SCALE Stage-II run (SCALE sec. 4.3) behind :func:`train`: checks, data, gates,
run folder, the evaluation before and after, and the summary around one :class:`treadle.scale.trainer.
ScaleTrainer` run (``transformers.Trainer``: one process, or DDP / FSDP on the ranks torchrun or
``accelerate launch`` started; checkpoints and resume are the Trainer's).

The global batches are the same on any number of ranks: the ``seed + 1`` generator draws one
permutation of the training responses per epoch and the batches are its consecutive ``batch_size``
chunks (:func:`treadle.scale.trainer.batch_indices`); a run resumed at step ``s`` skips the batches
already trained (the Trainer skips them in the same order).

Run folder: ``config.json``, ``stage_two.json`` (the settings a checkpoint must share with the run that
resumes it, and the evaluation before training), ``log.jsonl``, ``checkpoint-<step>/`` (the Trainer's),
then ``gates.safetensors``, ``lambda_hist.png`` and ``summary.json``. The main process writes them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from treadle.run_dirs import read_stored_json

if TYPE_CHECKING:
    from treadle.scale.training import ScaleTrainConfig

__all__ = ["run", "train", "gate_parameters"]


def gate_parameters(peft_model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every gate, in module order (weight, bias)."""
    from treadle.scale.gates import gated_layers

    return [(f"{name}.{p}", getattr(m, p)) for name, m in gated_layers(peft_model).items()
            for p in ("scale_gate_weight", "scale_gate_bias")]


def _prepared_pairs(peft_model, tokenizer, config, main: bool) -> list:
    from treadle.data.arithmetic import ProblemGenerator
    from treadle.scale.batches import collate, problem_pairs, sampled_pairs
    from treadle.trainer_support import broadcast_from_main

    torch.manual_seed(config.seed)
    problems = ProblemGenerator(config.seed).mixture(config.train_size, {lv: 1.0 for lv in config.levels},
                                                     split="train")
    if config.responses == "sampled":  # from the Stage-I model (no gates yet: exactly lambda = 1), once
        pairs = broadcast_from_main(sampled_pairs(peft_model, tokenizer, problems, max_new_tokens=config.max_new_tokens,
                                                  temperature=config.temperature, seed=config.seed) if main else None)
    else:
        pairs = problem_pairs(tokenizer, problems)
    collate(pairs, tokenizer.pad_token_id)  # every example has a response position (ValueError otherwise)
    return pairs


STATE = "stage_two.json"


def _read_state(out_dir, ckpt_cfg: dict):
    """``(newest checkpoint folder, stage_two.json)`` of a run to resume (``(None, None)``: none).

    Raises:
        ValueError: the run there is of another config (the differing keys named), or unreadable."""
    from treadle.trainer_support import latest_checkpoint

    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        return None, None
    try:
        state = read_stored_json(Path(out_dir) / STATE, what="Stage-II state")
    except (OSError, ValueError) as err:
        raise ValueError(f"{out_dir} holds a Stage-II checkpoint ({ckpt.name}) without a readable {STATE} "
                         f"({type(err).__name__}); delete the checkpoint-* folders to start afresh") from None
    old = state.get("config") or {}
    if old != ckpt_cfg:
        diff = [f"{k}: {old.get(k, '<absent>')!r} -> {ckpt_cfg.get(k, '<absent>')!r}"
                for k in sorted(set(old) | set(ckpt_cfg)) if old.get(k) != ckpt_cfg.get(k)]
        raise ValueError(f"{Path(out_dir)} holds a Stage-II checkpoint of another config ({'; '.join(diff[:6])}); "
                         f"use the same settings to resume it, resume=False to start afresh (it is replaced), or "
                         f"another out_dir")
    return ckpt, state


def run(peft_model: nn.Module, tokenizer, config, out_dir, *, console=None, progress: bool = False,
        evaluate_model: bool = True, evaluate_before: bool = True, report_to=None, resume: bool = True,
        save_every: int | None = 10, parallel: str | None = None) -> dict:
    """Stage II (arguments, files and summary: :func:`train`)."""
    import torch.distributed as dist

    from treadle.reporting import resolve_report_to
    from treadle.run_dirs import check_out_dir, make_out_dir
    from treadle.scale.batches import _check_tokenizer
    from treadle.scale.checkpoint import checkpoint_config, truncate_log
    from treadle.scale.gates import _active_adapter, _lora_layers, attach_gates, save_gates
    from treadle.scale.trainer import GateStep, ScaleTrainer, ScaleTrainingArguments, StepLog
    from treadle.scale.training import (ScaleTrainConfig, _base_name, _heldout, _objective_over, _vocab,
                                        clamp_lambda, evaluate, lambda_histogram)
    from treadle.trainer_support import (broadcast_from_main, check_launch, decoder_layer_classes, fsdp_arguments,
                                         launched_world, remove_checkpoints)

    config = config or ScaleTrainConfig()
    if not isinstance(config, ScaleTrainConfig):
        raise TypeError(f"config must be a ScaleTrainConfig, got {type(config).__name__}")
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1):
        raise ValueError(f"save_every must be an int >= 1 (steps between checkpoints) or None, got {save_every!r}")
    sinks = resolve_report_to(report_to)
    if parallel is not None:
        check_launch(parallel, flag="parallel")
    W = launched_world()
    if config.batch_size < W:
        raise ValueError(f"batch_size ({config.batch_size}) must be >= the world size ({W}): every rank trains on "
                         f"a part of each global batch")
    _check_tokenizer(tokenizer)
    # everything attach_gates would refuse, checked before the (possibly slow) data preparation
    _lora_layers(peft_model, _active_adapter(peft_model), disable_dropout=True, expect_gated=False)
    main = int(__import__("os").environ.get("RANK", "0")) == 0
    if out_dir is not None and main:
        check_out_dir(out_dir)
    vocab = _vocab(peft_model)
    if vocab < 2:
        raise ValueError(f"the model's vocabulary has {vocab} entries; the top-k entropy needs >= 2")
    k = min(config.k, vocab)
    say = console.print if (console is not None and main) else (lambda *a, **kw: None)
    if k != config.k:
        say(f"[yellow]k = {config.k} exceeds the vocabulary ({vocab}); using k = {k} (normaliser log {k})[/yellow]")
    ckpt_cfg = checkpoint_config(config, k, _base_name(peft_model))
    resume_from, state = _read_state(out_dir, ckpt_cfg) if (resume and out_dir is not None) else (None, None)

    tmp = tempfile.TemporaryDirectory(prefix="treadle-scale-") if out_dir is None else None
    args = ScaleTrainingArguments(
        output_dir=str(out_dir) if out_dir is not None else tmp.name,
        max_steps=config.epochs * math.ceil(config.train_size / config.batch_size),  # one pair per problem
        per_device_train_batch_size=config.batch_size, learning_rate=config.lr, k=k, objective=config.objective,
        shuffle_seed=config.seed + 1, seed=config.seed,
        save_strategy="steps" if (out_dir is not None and save_every is not None) else "no",
        save_steps=save_every or 10, use_cpu=not torch.cuda.is_available(), disable_tqdm=not (progress and main),
        report_to=sinks or "none", **fsdp_arguments(parallel, decoder_layer_classes(peft_model)))
    W, main = args.world_size, args.process_index == 0
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank has read the folder before the main process writes to it
    pairs = _prepared_pairs(peft_model, tokenizer, config, main)
    per_epoch = math.ceil(len(pairs) / config.batch_size)
    steps = config.epochs * per_epoch
    start = int(resume_from.name.split("-")[-1]) if resume_from is not None else 0
    if start > steps:
        raise ValueError(f"{out_dir} holds a Stage-II checkpoint at step {start}, past this run's {steps} steps "
                         f"({config.epochs} epochs of {per_epoch}); give at least "
                         f"{math.ceil(start / per_epoch)} epochs to resume it, or another out_dir")
    out = None
    if out_dir is not None:
        out = make_out_dir(out_dir) if main else Path(out_dir)  # before the model gets gates

    attach_gates(peft_model, config.L, config.U, config.tau, disable_dropout=True)
    lo, hi = config.lambda_bounds
    if lo is not None or hi is not None:
        clamp_lambda(peft_model, lo, hi)
    peft_model.eval()  # no dropout anywhere: Stage II changes only the gates
    n_gate = sum(p.numel() for _, p in gate_parameters(peft_model))
    pad = tokenizer.pad_token_id
    dist_keys = {"parallel": parallel, "world_size": W} if (parallel is not None or W > 1) else {}

    log = None
    if out is not None and main:
        cfg_json = {**dataclasses.asdict(config), "k_used": k, "lambda_bounds": list(config.lambda_bounds),
                    **dist_keys}
        (out / "config.json").write_text(json.dumps(cfg_json, indent=1))
        if state is not None:
            truncate_log(out / "log.jsonl", start)
        else:
            remove_checkpoints(out)  # a fresh start: an older run's checkpoints must not be resumed later
        log = open(out / "log.jsonl", "a" if state is not None else "w")  # noqa: SIM115

    def write(rec):
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    heldout = _heldout(config) if evaluate_model else None
    losses: list[float] = []
    try:
        if state is None:
            write({"type": "config", **dataclasses.asdict(config), "k_used": k, "gate_params": n_gate, **dist_keys})
            obj_before, before = broadcast_from_main((  # the Stage-I model (zero gates)
                _objective_over(peft_model, pairs, pad, k=k, objective=config.objective,
                                batch_size=max(config.batch_size, 64)),
                evaluate(peft_model, tokenizer, heldout, k=k, max_new_tokens=config.max_new_tokens)
                if evaluate_model and evaluate_before else None) if main else None)
            write({"type": "eval", "when": "before", "objective": obj_before, **(before or {})})
            if out is not None and main:
                (out / STATE).write_text(json.dumps({"config": ckpt_cfg, "objective_before": obj_before,
                                                     "before": before}, indent=1, default=str))
        else:
            obj_before, before = state["objective_before"], state["before"]
            if isinstance(before, dict) and isinstance(before.get("accuracy"), dict):  # JSON keys: str -> level
                before["accuracy"] = {int(lv) if str(lv).lstrip("-").isdigit() else lv: v
                                      for lv, v in before["accuracy"].items()}
            losses = [json.loads(x)["loss"] for x in (Path(out_dir) / "log.jsonl").read_text().splitlines()
                      if '"type": "step"' in x][:start] if (Path(out_dir) / "log.jsonl").exists() else []
            write({"type": "resume", "at_step": start, "of_steps": steps, "world_size": W})
            say(f"resuming Stage II at step {start} of {steps} from {resume_from}")

        def step_record(step: int, epoch: int, loss: float) -> None:
            losses.append(loss)
            write({"type": "step", "step": step, "epoch": epoch, "loss": loss})

        module = GateStep(peft_model, pairs, pad, k=k, objective=config.objective, world=W)
        trainer = ScaleTrainer(module, args, callbacks=[StepLog(step_record, per_epoch)])
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        t0 = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
        seconds = time.perf_counter() - t0
        obj_after = _objective_over(peft_model, pairs, pad, k=k, objective=config.objective,
                                    batch_size=max(config.batch_size, 64))
        after = (evaluate(peft_model, tokenizer, heldout, k=k, max_new_tokens=config.max_new_tokens,
                          keep_lambdas=True) if evaluate_model and main else None)
        lambdas = after.pop("lambdas") if after else None
        after = broadcast_from_main(after)
        write({"type": "eval", "when": "after", "objective": obj_after, **(after or {})})
    finally:
        if log is not None:
            log.close()
        if tmp is not None:
            tmp.cleanup()
    summary = {"config": dataclasses.asdict(config), "k": k, "gate_params": n_gate, "objective": config.objective,
               "objective_before": obj_before, "objective_after": obj_after, "before": before, "after": after,
               "losses": losses, "steps": len(losses), "seconds": seconds, "gates": None, "histogram": None,
               "base_model": _base_name(peft_model), "adapter": getattr(peft_model, "scale_adapter_path", None),
               "start_step": start, **dist_keys}
    if out is not None and main:
        summary["gates"] = str(save_gates(peft_model, out / "gates.safetensors"))
        if lambdas is not None and lambdas.numel():
            summary["histogram"] = str(lambda_histogram(
                lambdas, out / "lambda_hist.png", L=config.L, U=config.U,
                title=f"lambda on generated held-out tokens (L={config.L:g}, U={config.U:g}"
                      + "".join(f", {a}" for a, on in (("no reverse", config.no_reverse),
                                                       ("no extrapolate", config.no_extrapolate)) if on) + ")"))
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if dist.is_available() and dist.is_initialized() and W > 1:
        dist.barrier()
    return summary


def train(peft_model: nn.Module, tokenizer, config: ScaleTrainConfig | None = None, out_dir: str | Path | None = None,
          *, console=None, progress: bool = False, evaluate_model: bool = True,
          evaluate_before: bool = True, report_to=None, parallel: str | None = None,
          resume: bool = True, save_every: int | None = 10) -> dict:
    """SCALE Stage II (sec. 4.3): attach gates to ``peft_model`` and train only them, on
    ``transformers.Trainer`` (:class:`treadle.scale.trainer.ScaleTrainer`).

    Args:
        peft_model: a PEFT model with one active LoRA adapter (Stage I), without gates; gates are
            attached in place (``attach_gates(..., disable_dropout=True)``) and stay on it.
        tokenizer: its tokenizer (chat template, EOS, pad).
        config: :class:`ScaleTrainConfig`.
        out_dir: run folder: ``config.json``, ``log.jsonl`` (config, evals, one line per step, lambda
            shares), ``summary.json``, ``gates.safetensors`` (:func:`treadle.scale.save_gates`),
            ``lambda_hist.png``, ``stage_two.json`` and the Trainer's ``checkpoint-<step>/``
            (:mod:`treadle.scale.checkpoint`). None: nothing written.
        console: rich Console (None: silent); progress: tqdm bar.
        evaluate_model: run the held-out evaluation before/after (accuracy, entropy, lambda shares).
        evaluate_before: also before training (the Stage-I model); False when the caller has it already
            (:func:`treadle.scale.sweep.sweep` evaluates Stage I once for all cells).
        report_to: extra metric sinks, as Hugging Face trainers' ``report_to``: ``"tensorboard"``,
            ``"wandb"``, a list, ``"all"`` (those installed) or None / ``"none"`` (:mod:`treadle.reporting`).
        parallel: None, or ``"ddp"`` / ``"fsdp2"`` in a process started by torchrun / ``accelerate launch``:
            the Trainer runs DDP whenever it is launched on several ranks (each rank one part of every global
            batch; same losses and gates as one process); ``"fsdp2"`` asks it for FSDP2 (accelerators only).
            The evaluations run on the main process and are broadcast.
        resume: continue from the newest ``out_dir/checkpoint-<step>`` when it holds a run of the same config
            (``epochs`` may grow), written by one process or by any number of ranks; False: start afresh.
        save_every: write ``checkpoint/`` every this many optimizer steps and after the last (None: never).

    A resumed run gives the steps, losses and gates of the uninterrupted run: the data order is replayed
    (one seeded permutation per epoch), the gates and Adam's state come from the checkpoint, and the
    evaluation before training is the checkpoint's; ``log.jsonl`` keeps the steps up to the checkpoint
    and logs the rest once.

    Returns:
        A summary dict: ``config``, ``k`` (used), ``gate_params``, ``objective_before/after`` (mean over
        the training responses), ``before``/``after`` (:func:`evaluate` results, without raw lambdas),
        ``losses`` (per step, the resumed-from steps included), ``steps``, ``start_step`` (0, or the
        checkpoint's step), ``seconds`` (this call's training), paths, ``base_model`` (the base's
        ``name_or_path``) and ``adapter`` (the Stage-I adapter folder, when loaded by
        :func:`load_stage_one` or written by :func:`treadle.scale.sft`).

    Raises:
        GateError (ValueError): no LoRA layers, several active adapters, unsupported layers, gates
            already attached (:func:`treadle.scale.attach_gates`), before any change.
        ValueError: ``out_dir`` is a file, under a file, or not writable; ``out_dir`` holds a checkpoint of
            another config, or past this run's steps (with ``resume``); ``save_every`` not an int >= 1
            (all before any change).
        ValueError: a tokenizer without chat template / EOS / pad; an example without response position;
            a ``report_to`` sink that is unknown or not installed (before any change).
        KeyboardInterrupt: passed on; the last checkpoint stays in ``out_dir``.
    """
    return run(peft_model, tokenizer, config, out_dir, console=console, progress=progress,
               evaluate_model=evaluate_model, evaluate_before=evaluate_before, report_to=report_to, resume=resume,
               save_every=save_every, parallel=parallel)

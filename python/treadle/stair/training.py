"""Training STAIR's reflection normals on multi-problem sessions (STAIR sec. 4.4, "Training").

Each session holds ``turns`` independent problems. The backbone's own greedy responses are the
targets (``responses="self"``; right or wrong, as in the paper: an earlier wrong answer is a legal
history state) or the gold answers (``responses="gold"``). Turn 1 is replayed natively (its bank is
empty) to build the bank; turns 2..n are teacher-forced over the session cache with

    loss = CE(stair) + lambda_kl * KL(p_native || p_stair)

on the response tokens, the native distribution computed on the same inputs and prefix without the
read-out and without grad. The read-out is added on each turn's prompt tokens only (as in a
prefill). Only the controller's parameters train (``len(layers) x Hq x D`` normals); the backbone is
frozen and never gets gradients. :func:`train` runs on ``transformers.Trainer``
(:class:`treadle.stair.trainer.StairTrainer`): DDP / FSDP, gradient accumulation, mixed precision,
checkpoints and resume are the Trainer's.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, field
from pathlib import Path
from typing import Annotated, Literal, Union

import torch
from pydantic import AfterValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from treadle.data.arithmetic import known_levels
from treadle.run_dirs import read_stored_json
from treadle.stair.loss import stair_loss

__all__ = ["StairTrainConfig", "make_training_sessions", "self_responses", "stair_loss", "train_step", "train"]


Levels = Annotated[list[Annotated[int, Field(strict=True)]], AfterValidator(known_levels)]
PosInt = Annotated[int, Field(ge=1, strict=True)]


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class StairTrainConfig:
    """Settings of :func:`train` (everything a run needs to be reproduced); a pydantic dataclass, so
    every field is checked when the config is made (:class:`pydantic.ValidationError`, a ``ValueError``
    naming the field).

    Attributes:
        layers: controlled layers, or ``"auto"`` (default: the paper's (3, 11, 19) where the model has
            them, else spread softmax layers; see :func:`treadle.stair.default_layers`).
        eps: pi_ref mixing, in [0, 1); kind: "stair" or "bank_free" (control).
        turns: problems per session, >= 2 (turn 1 builds the bank). levels: difficulty level per turn
            (treadle.data levels; cycled if shorter than ``turns``).
        sessions: size of the training pool; steps: optimizer steps; batch_size: sessions per
            micro-batch; grad_accum: micro-batches per step (each >= 1).
        lr: AdamW learning rate (> 0; no weight decay on normals); lambda_kl: KL weight (>= 0).
        responses: "self" (the backbone's greedy responses) or "gold".
        max_new_tokens: decoding budget of the self-generated responses.
        amp: bfloat16 autocast on CUDA.
        seed: seeds the sessions, the initial normals and the batch order.
        save_every: checkpoint every N steps (and at the end).
    """

    layers: Union[Literal["auto"], tuple[Annotated[int, Field(strict=True)], ...]] = "auto"
    eps: Annotated[float, Field(ge=0, lt=1)] = 0.0
    kind: Literal["stair", "bank_free"] = "stair"
    turns: Annotated[int, Field(ge=2, strict=True)] = 4
    levels: Levels = field(default_factory=lambda: [2, 3, 2, 3])
    sessions: PosInt = 64
    steps: PosInt = 50
    batch_size: PosInt = 16
    grad_accum: PosInt = 1
    lr: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 2e-2
    lambda_kl: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    responses: Literal["self", "gold"] = "self"
    max_new_tokens: PosInt = 10
    amp: bool = True
    seed: int = 0
    save_every: PosInt = 25


def make_training_sessions(n: int, turns: int, levels, *, seed: int = 0, split: str = "train"):
    """``n`` sessions of ``turns`` independent problems (:func:`treadle.data.make_sessions`)."""
    from treadle.data import make_sessions

    lv = [levels[i % len(levels)] for i in range(turns)]
    return make_sessions(n, turns, lv, seed=seed, split=split)


@torch.no_grad()
def self_responses(model, tokenizer, sessions, *, max_new_tokens: int = 10, batch_size: int = 32) -> list[list[str]]:
    """The backbone's own greedy responses, turn by turn in one native conversation per session
    (no STAIR): ``result[i][t]`` is session i's response to turn t."""
    from treadle.stair.session import StairSession

    out: list[list[str]] = []
    for s0 in range(0, len(sessions), batch_size):
        chunk = sessions[s0:s0 + batch_size]
        sess = StairSession(model, tokenizer, None, batch_size=len(chunk))
        rows = [[] for _ in chunk]
        for t in range(len(chunk[0].problems)):
            res = sess.generate([s.problems[t].prompt for s in chunk], max_new_tokens=max_new_tokens)
            for r, text in zip(rows, res.texts):
                r.append(text)
        out.extend(rows)
    return out


def train_step(controller, model, tokenizer, sessions, responses, *, lambda_kl: float = 1.0, amp: bool = False,
               scale: float = 1.0, backward: bool = True) -> dict:
    """Forward/backward over one micro-batch of sessions (accumulates ``.grad`` on the controller).

    Args:
        sessions: list of :class:`treadle.data.Session`; responses: ``[i][t]`` response texts.
        scale: the loss is multiplied by it before backward (1 / grad_accum).
        backward: False only measures the loss (no graph, no ``.grad``).

    Returns:
        {"loss", "ce", "kl", "tokens"} averaged over turns 2..n.
    """
    from treadle.stair.session import StairSession

    B, n = len(sessions), len(sessions[0].problems)
    sess = StairSession(model, tokenizer, controller, batch_size=B)
    sess.forward([s.problems[0].prompt for s in sessions], [r[0] for r in responses])  # turn 1: builds the bank
    device = next(model.parameters()).device
    use_amp = amp and device.type == "cuda"
    tot = {"loss": 0.0, "ce": 0.0, "kl": 0.0, "tokens": 0}
    for t in range(1, n):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            out = sess.forward([s.problems[t].prompt for s in sessions], [r[t] for r in responses], grad=backward,
                               native_too=True)
        loss, parts = stair_loss(out["logits"], out["native_logits"], out["labels"], lambda_kl)
        if backward:
            (loss * scale / (n - 1)).backward()
        tot["loss"] += float(loss.detach()) / (n - 1)
        tot["ce"] += parts["ce"] / (n - 1)
        tot["kl"] += parts["kl"] / (n - 1)
        tot["tokens"] += parts["tokens"]
    return tot


def _truncate_log(path: Path, step: int) -> None:
    """Keep only the step records ``<= step`` of a JSONL training log (the steps a checkpoint holds), so
    that a resumed run does not log the steps after its checkpoint twice."""
    if not path.exists():
        return
    keep, past = [], False
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by an interrupt
        if not isinstance(rec, dict):
            continue
        if "step" in rec:
            past = past or rec["step"] > step
            if rec["step"] <= step:
                keep.append(line + "\n")
        elif not past:  # other records (probe losses) of the part the checkpoint holds
            keep.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)



def freeze_and_attach(model, config, backend):
    """Freeze every parameter of ``model`` and attach STAIR's controller (the normals are the only
    trainable parameters).

    Returns ``(controller, flags, cfg_json)``: ``flags`` the ``(parameter, requires_grad)`` pairs to
    restore when training ends, ``cfg_json`` the run's config record. Raises what
    :func:`treadle.stair.attach` raises, with the caller's ``requires_grad`` flags restored first.
    """
    from treadle.stair.controller import attach

    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        ctrl = attach(model, layers=config.layers, eps=config.eps, kind=config.kind, seed=config.seed, backend=backend)
    except BaseException:
        for p, f in flags:  # leave the caller's model as it was
            p.requires_grad_(f)
        raise
    cfg_json = {**asdict(config), "layers": list(ctrl.layers),
                "model_name": str(getattr(model.config, "_name_or_path", "") or type(model).__name__)}
    return ctrl, flags, cfg_json

def train(model, tokenizer, config: StairTrainConfig, run_dir, *, resume: bool = True, progress: bool = True,
          console=None, backend: str | None = None, report_to=None, parallel: str | None = None) -> dict:
    """Train a STAIR controller on ``model`` with :class:`treadle.stair.trainer.StairTrainer` (a
    ``transformers.Trainer``); writes ``run_dir/{normals.safetensors, log.jsonl, config.json}`` and the
    Trainer's ``checkpoint-<step>/`` folders.

    Args:
        model, tokenizer: the frozen backbone (any supported HF causal LM) and its tokenizer.
        config: :class:`StairTrainConfig`.
        run_dir: output folder; with ``resume`` its newest checkpoint is continued.
        backend: forced backend of the read-out op (None: dispatch rule).
        report_to: the Trainer's metric sinks (``"tensorboard"``, ``"wandb"``, a list, ``"all"``, None /
            ``"none"``).
        parallel: None, or ``"ddp"`` / ``"fsdp2"`` in a process started by torchrun / ``accelerate
            launch``: the Trainer runs DDP whenever it is launched on several ranks; ``"fsdp2"`` asks it for
            FSDP2 (accelerators only). Each rank trains on its part of every global batch; the losses and
            normals are one process's.

    A resumed run continues from the newest checkpoint (every ``save_every`` steps and after the last), on
    any world size: ``log.jsonl`` keeps the steps up to it and the steps after it are trained and logged
    again (once).

    Returns:
        {"path", "trainable", "first_loss", "last_loss", "probe_loss_before", "probe_loss_after", "layers",
        "steps", "start_step", "seconds", "world_size", "normals"}.

    Raises:
        ValueError: a checkpoint in ``run_dir`` from another config (``resume``); an unknown or missing
            ``report_to`` sink; ``batch_size`` below the world size; see attach(). All before any change
            to ``run_dir``.
        KeyboardInterrupt: passed on; the last checkpoint stays in ``run_dir``.
    """
    import torch.distributed as dist

    from treadle.reporting import resolve_report_to
    from treadle.stair.trainer import JsonlLog, SaveNormals, StairStep, StairTrainer, arguments_from_config
    from treadle.trainer_support import (broadcast_from_main, check_launch, decoder_layer_classes, latest_checkpoint,
                                         remove_checkpoints)

    run_dir = Path(run_dir)
    sinks = resolve_report_to(report_to)
    if parallel is not None:
        check_launch(parallel, flag="parallel")
    ctrl, flags, cfg_json = freeze_and_attach(model, config, backend)
    keys = ("layers", "kind", "eps", "seed", "turns")
    try:
        resume_from = latest_checkpoint(run_dir) if resume else None
        if resume_from is not None:
            old = read_stored_json(run_dir / "config.json", what="run config") if (run_dir / "config.json").exists() else {}
            if {k: old.get(k) for k in keys} != {k: cfg_json[k] for k in keys}:
                raise ValueError(f"{run_dir} holds a run with another config ({old}); use another run_dir or "
                                 f"resume=False")
        args = arguments_from_config(config, run_dir, report_to=sinks or "none", parallel=parallel,
                                     layer_classes=decoder_layer_classes(model), progress=progress)
        W, main = args.world_size, args.process_index == 0
        if config.batch_size < W:
            raise ValueError(f"batch_size ({config.batch_size}) must be >= the world size ({W}): every rank trains "
                             f"on a part of each global batch")
        start = int(resume_from.name.split("-")[-1]) if resume_from is not None else 0
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank has read the folder before the main process writes to it
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            _truncate_log(run_dir / "log.jsonl", start)
            if resume_from is None:  # a fresh start: an older run's log and checkpoints go
                if (run_dir / "log.jsonl").exists():
                    (run_dir / "log.jsonl").unlink()
                remove_checkpoints(run_dir)
            (run_dir / "config.json").write_text(json.dumps({**cfg_json, "world_size": W,
                                                            **({"parallel": parallel} if parallel else {})},
                                                           indent=1))
            if console is not None:
                console.print(f"STAIR {config.kind}: trainable parameters = {len(ctrl.layers)} layers x "
                              f"{ctrl.num_heads} heads x "
                              f"{ctrl.head_dim if config.kind == 'stair' else ctrl.value_dim} = {ctrl.num_trainable}"
                              + (f" ({W} ranks)" if W > 1 else "")
                              + (f" (resuming at step {start})" if start else ""))
        pool = make_training_sessions(config.sessions, config.turns, config.levels, seed=config.seed)
        if config.responses == "self":  # once, by the main process, then the same on every rank
            responses = None
            if main:
                ctrl.enabled = False
                responses = self_responses(model, tokenizer, pool, max_new_tokens=config.max_new_tokens)
                ctrl.enabled = True
            responses = broadcast_from_main(responses)
        else:
            responses = [[p.answer for p in s.problems] for s in pool]
        probe = (pool[:config.batch_size], responses[:config.batch_size])

        def probe_loss() -> float:
            return train_step(ctrl, model, tokenizer, *probe, lambda_kl=config.lambda_kl, backward=False)["loss"]

        if resume_from is not None:  # the probe before this run sees the checkpoint's normals
            from safetensors.torch import load_file

            from treadle.trainer_support import TRAINABLE_FILE

            saved = load_file(str(resume_from / TRAINABLE_FILE))
            with torch.no_grad():
                for n, p in ctrl.named_parameters():
                    p.copy_(saved[f"ctrl.{n}"].to(p.dtype))
        probe_start = probe_loss()
        step_module = StairStep(ctrl, model, tokenizer, pool, responses, lambda_kl=config.lambda_kl, world=W)
        log = JsonlLog(run_dir / "log.jsonl", main)
        trainer = StairTrainer(step_module, args, callbacks=[log, SaveNormals(ctrl, run_dir / "normals.safetensors",
                                                                                main)])
        if not progress:
            from transformers.trainer_callback import PrinterCallback

            trainer.remove_callback(PrinterCallback)
        t0 = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
        seconds = time.perf_counter() - t0
        probe_end = probe_loss()
        if main:
            with open(run_dir / "log.jsonl", "a") as f:
                f.write(json.dumps({"probe": True, "sessions": len(probe[0]), "loss_before_run": probe_start,
                                    "loss_after_run": probe_end}) + "\n")
        losses = log.losses
        return {"path": run_dir / "normals.safetensors", "trainable": ctrl.num_trainable,
                "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
                "probe_loss_before": probe_start, "probe_loss_after": probe_end, "layers": ctrl.layers,
                "steps": config.steps, "start_step": start, "seconds": seconds, "world_size": W,
                "normals": {n: p.detach().cpu().clone() for n, p in ctrl.named_parameters()}}
    finally:
        ctrl.detach()
        for p, f in flags:
            p.requires_grad_(f)


def read_log(run_dir) -> list[dict]:
    """The JSONL training log of ``run_dir`` as a list of dicts."""
    p = Path(run_dir) / "log.jsonl"
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []
    return [r for r in rows if "step" in r]


def smoothed(values: list[float], k: int = 5) -> list[float]:
    """Trailing mean over ``k`` values (for printing a falling-loss summary)."""
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


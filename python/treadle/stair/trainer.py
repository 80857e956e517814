"""STAIR training (STAIR sec. 4.4) on ``transformers.Trainer``: :class:`StairTrainer` and its arguments
:class:`StairTrainingArguments` (a ``TrainingArguments`` with STAIR's fields, as TRL's configs are).

The Trainer does what every engine user expects of it: the process group under torchrun / ``accelerate
launch`` and DDP / FSDP through accelerate, gradient accumulation, bf16 autocast, the AdamW optimizer
and its schedule, ``report_to``, ``checkpoint-<step>/`` folders and ``resume_from_checkpoint``. STAIR
gives it the model to train and the loss:

* The model is :class:`StairStep`: the attached controller (trainable: the reflection normals, or the
  bank-free control's biases) and the frozen backbone. Its forward runs one micro-batch of sessions:
  turn 1 natively to build the bank, then turns 2..n teacher-forced with
  ``CE(stair) + lambda_kl * KL(p_native || p_stair)`` per turn (token mean), averaged over turns.
* The data order is STAIR's own: micro-batch ``a`` of step ``s`` is the first ``batch_size`` of a
  permutation of the session pool drawn from ``Generator(seed * 100003 + s)`` (the ``grad_accum``
  micro-batches of a step from the same generator, in turn). Each rank trains on its contiguous part of
  every micro-batch (:class:`treadle.trainer_support.RankBatches`); each turn's token count is summed
  over ranks, so every rank's loss is its share of the global batch's token mean, times the world size:
  DDP's gradient average is then the gradient of one process holding the whole batch.
* Checkpoints hold the trainable parameters (``trainable.safetensors``) and the Trainer's optimizer,
  scheduler, RNG and state files, so a run resumes on any number of ranks.

The defaults of :class:`StairTrainingArguments` reproduce STAIR's recipe: AdamW with betas (0.9, 0.99) and
no weight decay, a constant learning rate, no gradient clipping (``max_grad_norm`` 1e9: the norm is
logged, never binding).

:func:`treadle.stair.training.train` (and ``treadle stair train``) build all of this from a
``StairTrainConfig``; by hand::

    ctrl, flags, _ = freeze_and_attach(model, StairTrainConfig(layers=(3, 11, 19)), None)
    pool = make_training_sessions(64, 4, [2, 3])
    responses = self_responses(model, tok, pool)
    args = StairTrainingArguments(output_dir="runs/stair", max_steps=50, per_device_train_batch_size=16,
                                  report_to="wandb")
    step = StairStep(ctrl, model, tok, pool, responses, lambda_kl=1.0, world=args.world_size)
    StairTrainer(step, args).train()          # torchrun --nproc-per-node 8 script.py: DDP on 8 ranks
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from treadle.trainer_support import RankBatches, Rows, TrainableOnlyCheckpoints, all_reduce_sum, collate_rows

__all__ = ["StairTrainingArguments", "StairTrainer", "StairStep", "stair_batches"]


@dataclass
class StairTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus STAIR's settings (:class:`treadle.stair.training.StairTrainConfig` holds
    the same fields, validated, for :func:`treadle.stair.training.train`).

    ``per_device_train_batch_size`` is the *global* number of sessions per micro-batch (split over the
    ranks, so that the batch, and the result, do not depend on the world size); ``max_steps`` the
    optimizer steps; ``gradient_accumulation_steps`` the micro-batches per step.
    """

    sessions: int = field(default=64, metadata={"help": "Size of the training pool of sessions."})
    turns: int = field(default=4, metadata={"help": "Problems per session (turn 1 builds the bank)."})
    lambda_kl: float = field(default=1.0, metadata={"help": "Weight of KL(native || stair)."})
    stair_seed: int = field(default=0, metadata={"help": "Seeds the session pool, the normals and the batch order."})
    learning_rate: float = 2e-2
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    lr_scheduler_type: str = "constant"
    max_grad_norm: float = 1e9
    logging_steps: float = 1
    save_strategy: str = "steps"
    save_total_limit: int | None = 2
    remove_unused_columns: bool = False
    ddp_find_unused_parameters: bool | None = False
    ddp_broadcast_buffers: bool | None = False
    dataloader_num_workers: int = 0
    report_to: str | list[str] | None = "none"


class StairStep(nn.Module):
    """The module the Trainer trains: ``ctrl`` (trainable) and ``model`` (frozen backbone). ``forward(idx)``
    is the STAIR loss of sessions ``idx`` of the pool, scaled to this rank's share of the global batch
    (see the module doc); the parts (ce, kl, tokens) are added to :attr:`parts`."""

    def __init__(self, ctrl, model, tokenizer, pool, responses, *, lambda_kl: float, world: int):
        super().__init__()
        self.ctrl = ctrl
        self.model = model
        self.tokenizer, self.pool, self.responses = tokenizer, pool, responses
        self.lambda_kl, self.world = float(lambda_kl), int(world)
        self.parts = {"loss": 0.0, "ce": 0.0, "kl": 0.0, "tokens": 0.0}

    def train(self, mode: bool = True):
        """Only the flag: the backbone keeps its mode (no dropout switched on; the loss is the one-process
        loop's)."""
        self.training = mode
        return self

    def forward(self, idx: list[int], real: bool = True) -> torch.Tensor:
        from treadle.stair.session import StairSession
        from treadle.stair.loss import stair_loss

        sessions = [self.pool[i] for i in idx]
        responses = [self.responses[i] for i in idx]
        n = len(sessions[0].problems)
        sess = StairSession(self.model, self.tokenizer, self.ctrl, batch_size=len(sessions))
        sess.forward([s.problems[0].prompt for s in sessions], [r[0] for r in responses])  # turn 1: the bank
        grad = torch.is_grad_enabled()
        total = None
        for t in range(1, n):
            out = sess.forward([s.problems[t].prompt for s in sessions], [r[t] for r in responses], grad=grad,
                               native_too=True)
            mine = int((out["labels"] != -100).sum()) if real else 0
            (tokens,) = all_reduce_sum([mine])
            loss, parts = stair_loss(out["logits"], out["native_logits"], out["labels"], self.lambda_kl,
                                     tokens=max(tokens, 1.0))
            if not real:  # a stand-in session: weight 0
                loss, parts = loss * 0.0, {"ce": 0.0, "kl": 0.0, "tokens": 0}
            term = loss / (n - 1)
            total = term if total is None else total + term
            self.parts["loss"] += float(term.detach())
            self.parts["ce"] += parts["ce"] / (n - 1)
            self.parts["kl"] += parts["kl"] / (n - 1)
            self.parts["tokens"] += parts["tokens"]
        return total * self.world


def stair_batches(pool_size: int, *, steps: int, batch_size: int, grad_accum: int, seed: int) -> list[list[int]]:
    """The global micro-batches of a run, in order (``steps x grad_accum`` lists of session indices):
    micro-batch ``a`` of step ``s`` is the first ``batch_size`` of the ``a``-th permutation drawn from
    ``Generator(seed * 100003 + s)``."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        for _ in range(grad_accum):
            out.append(torch.randperm(pool_size, generator=g)[:batch_size].tolist())
    return out


class StairTrainer(TrainableOnlyCheckpoints, Trainer):
    """``transformers.Trainer`` for a :class:`StairStep` (arguments :class:`StairTrainingArguments`).

    The train data is the session pool of the step module; ``train_dataset`` is not used. Logs add
    ``ce``, ``kl`` and ``tokens`` (summed over ranks: the global batch's) and replace ``loss`` by the
    exact global value (mean over the step's micro-batches)."""

    def __init__(self, model: StairStep, args: StairTrainingArguments, **kwargs):
        if args.max_steps <= 0:
            raise ValueError("StairTrainingArguments.max_steps must be >= 1: STAIR's batches are drawn per optimizer "
                             "step from the session pool (there are no epochs)")
        kwargs.setdefault("train_dataset", Rows(len(model.pool)))
        super().__init__(model=model, args=args, **kwargs)
        self.model_accepts_loss_kwargs = False  # the loss is already a token mean: the Trainer divides by GA

    def get_train_dataloader(self):
        a = self.args
        batches = stair_batches(len(self.train_dataset), steps=a.max_steps, batch_size=a.per_device_train_batch_size,
                                grad_accum=a.gradient_accumulation_steps, seed=a.stair_seed)
        sampler = RankBatches(batches, a.process_index, a.world_size)
        return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=sampler,
                                           collate_fn=collate_rows)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = model(inputs["idx"], inputs["real"])
        return (loss, None) if return_outputs else loss

    def _step_module(self) -> StairStep:
        return self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs:
            m = self._step_module()
            ga = self.args.gradient_accumulation_steps
            steps = max(1, round(self.args.logging_steps)) if self.args.logging_steps >= 1 else 1
            loss, ce, kl, tokens = all_reduce_sum([m.parts[k] for k in ("loss", "ce", "kl", "tokens")])
            logs = {**logs, "loss": loss / (ga * steps), "ce": ce / (ga * steps), "kl": kl / (ga * steps),
                    "tokens": int(tokens)}
            m.parts = dict.fromkeys(m.parts, 0.0)
        super().log(logs, start_time)


class JsonlLog(TrainerCallback):
    """Writes ``log.jsonl`` (main process): one line per logged step (``step``, ``loss``, ``ce``, ``kl``,
    ``tokens``, ``grad_norm``, ``seconds``), appended to the records a resumed run kept."""

    def __init__(self, path: Path, main: bool):
        self.path, self.main, self.t0 = Path(path), main, time.perf_counter()
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs or "ce" not in logs:
            return
        self.losses.append(float(logs["loss"]))
        if not self.main:
            return
        rec = {"step": state.global_step, **{k: round(float(logs[k]), 6) for k in ("loss", "ce", "kl")},
               "tokens": int(logs["tokens"]), "grad_norm": round(float(logs.get("grad_norm", 0.0)), 6),
               "seconds": round(time.perf_counter() - self.t0, 3)}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


class SaveNormals(TrainerCallback):
    """After each Trainer checkpoint, the main process also writes the normals file of the run folder
    (``normals.safetensors``, :meth:`StairController.save` with the step), what ``treadle stair eval``
    reads."""

    def __init__(self, ctrl, path: Path, main: bool):
        self.ctrl, self.path, self.main = ctrl, Path(path), main

    def on_save(self, args, state, control, **kwargs):
        if self.main:
            self.ctrl.save(self.path, extra={"step": state.global_step})


def arguments_from_config(config, run_dir, *, report_to=None, parallel: str | None = None, layer_classes=(),
                          progress: bool = False) -> StairTrainingArguments:
    """The :class:`StairTrainingArguments` of a :class:`treadle.stair.training.StairTrainConfig` run in
    ``run_dir`` (checkpoints every ``save_every`` steps and after the last)."""
    from treadle.trainer_support import fsdp_arguments

    cuda = torch.cuda.is_available()
    return StairTrainingArguments(
        output_dir=str(run_dir), max_steps=config.steps, per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum, learning_rate=config.lr, sessions=config.sessions,
        turns=config.turns, lambda_kl=config.lambda_kl, stair_seed=config.seed, seed=config.seed,
        save_steps=config.save_every, bf16=bool(config.amp and cuda), use_cpu=not cuda,
        report_to=report_to if report_to not in (None, "none") else "none", disable_tqdm=not progress,
        **fsdp_arguments(parallel, layer_classes))


def as_dict(args: StairTrainingArguments) -> dict:
    """The STAIR fields of ``args`` (for a run record)."""
    keep = ("sessions", "turns", "lambda_kl", "stair_seed", "learning_rate", "max_steps",
            "per_device_train_batch_size", "gradient_accumulation_steps")
    return {k: v for k, v in dataclasses.asdict(args).items() if k in keep}

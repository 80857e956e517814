"""SCALE Stage II (SCALE sec. 4.3) on ``transformers.Trainer``: :class:`ScaleTrainer` and its arguments
:class:`ScaleTrainingArguments` (a ``TrainingArguments`` with Stage II's fields, as TRL's configs are).

The Trainer runs the process group (torchrun / ``accelerate launch``), DDP / FSDP through accelerate,
gradient accumulation, mixed precision, the optimizer, ``report_to`` and ``checkpoint-<step>/`` folders
with resume. Stage II gives it:

* :class:`GateStep`, the module it trains: the PEFT model with gates (only the gates require grad). Its
  forward is the Stage-II objective (:func:`treadle.scale.training.gate_objective`: the mean normalised
  top-k entropy over response positions, or the CE-calibration ablation) of this rank's rows, weighted by
  its share of the global batch's response positions (summed over ranks) and multiplied by the world
  size, so that DDP's gradient average is the gradient of the whole batch's mean.
* The data order of the one-process recipe: one permutation of the training responses per epoch from
  ``Generator(seed + 1)``, its consecutive ``batch_size`` chunks the global batches
  (:func:`batch_indices`); each rank takes its contiguous part of each
  (:class:`treadle.trainer_support.RankBatches`).
* Checkpoints of the gates only (``trainable.safetensors``) next to the Trainer's optimizer, scheduler,
  RNG and state files: a run resumes on any number of ranks.

The defaults of :class:`ScaleTrainingArguments` are Stage II's recipe: Adam (AdamW without weight decay),
a constant learning rate, no gradient clipping.

:func:`treadle.scale.stage_two.train` (and ``treadle scale train``) add the data, the evaluations and the run
folder around it; by hand::

    attach_gates(peft_model, L=-2.0, U=2.0, tau=1.0, disable_dropout=True)
    pairs = problem_pairs(tok, problems)        # (prompt ids, response ids)
    args = ScaleTrainingArguments(output_dir="runs/stage2", num_train_epochs=2, per_device_train_batch_size=32)
    step = GateStep(peft_model, pairs, tok.pad_token_id, k=100, objective="entropy", world=args.world_size)
    ScaleTrainer(step, args).train()
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from treadle.trainer_support import RankBatches, Rows, TrainableOnlyCheckpoints, all_reduce_sum, collate_rows

__all__ = ["ScaleTrainingArguments", "ScaleTrainer", "GateStep", "batch_indices"]


@dataclass
class ScaleTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus Stage II's settings (:class:`treadle.scale.training.ScaleTrainConfig` holds
    the method's fields, validated, for :func:`treadle.scale.stage_two.train`).

    ``per_device_train_batch_size`` is the *global* number of rows per step (split over the ranks, so
    that the batches, and the result, do not depend on the world size); ``max_steps`` (epochs x
    batches per epoch) or ``num_train_epochs``: the passes over the training responses.
    """

    k: int = field(default=100, metadata={"help": "Top-k of the entropy objective."})
    objective: str = field(default="entropy", metadata={"help": "'entropy' (SCALE) or 'ce' (CE calibration)."})
    shuffle_seed: int = field(default=1, metadata={"help": "Seed of the per-epoch permutations (config seed + 1)."})
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    lr_scheduler_type: str = "constant"
    max_grad_norm: float = 0.0
    logging_steps: float = 1
    save_strategy: str = "steps"
    save_total_limit: int | None = 2
    remove_unused_columns: bool = False
    ddp_find_unused_parameters: bool | None = False
    ddp_broadcast_buffers: bool | None = False
    dataloader_num_workers: int = 0
    report_to: str | list[str] | None = "none"


def batch_indices(n: int, batch_size: int, seed: int | None, epochs: int) -> list[list[int]]:
    """The global batches of ``epochs`` passes over ``n`` rows: per epoch one ``randperm`` from a generator
    seeded once with ``seed`` (None: in order), cut into consecutive ``batch_size`` chunks."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=g).tolist() if g is not None else list(range(n))
        out.extend(order[i:i + batch_size] for i in range(0, n, batch_size))
    return out


def steps_per_epoch(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


class GateStep(nn.Module):
    """The module the Trainer trains: ``model`` (the gated PEFT model); ``forward(idx)`` is this rank's
    weighted share of the Stage-II objective of the global batch (module doc). The unweighted share is
    added to :attr:`loss` (summed over ranks: the global batch's objective)."""

    def __init__(self, model, pairs, pad_id: int, *, k: int, objective: str, world: int):
        super().__init__()
        self.model = model
        self.pairs, self.pad_id, self.k, self.objective, self.world = pairs, pad_id, k, objective, int(world)
        self.loss = 0.0

    def train(self, mode: bool = True):
        """Only the flag: the PEFT model stays in eval mode (no dropout; Stage II changes only the gates)."""
        self.training = mode
        return self

    def forward(self, idx: list[int], real: bool = True) -> torch.Tensor:
        from treadle.scale.batches import collate
        from treadle.scale.training import gate_objective

        device = next(self.model.parameters()).device
        batch = collate([self.pairs[i] for i in idx], self.pad_id).to(device)
        mine = int(batch.response_mask.sum()) if real else 0  # weight 0: a stand-in row
        (total,) = all_reduce_sum([mine])
        part = gate_objective(self.model, batch, k=self.k, objective=self.objective) * (mine / total)
        self.loss += float(part.detach())
        return part * self.world


class ScaleTrainer(TrainableOnlyCheckpoints, Trainer):
    """``transformers.Trainer`` for a :class:`GateStep` (arguments :class:`ScaleTrainingArguments`). The
    logged ``loss`` is the global batch's objective (exact, summed over ranks)."""

    def __init__(self, model: GateStep, args: ScaleTrainingArguments, **kwargs):
        kwargs.setdefault("train_dataset", Rows(len(model.pairs)))
        if args.max_steps <= 0:  # the epochs are the Stage-II data order's: one loader pass holds them all
            args.max_steps = math.ceil(args.num_train_epochs) * steps_per_epoch(len(model.pairs),
                                                                                args.per_device_train_batch_size)
        super().__init__(model=model, args=args, **kwargs)
        self.model_accepts_loss_kwargs = False

    def get_train_dataloader(self):
        a = self.args
        n, bs = len(self.train_dataset), a.per_device_train_batch_size
        batches = batch_indices(n, bs, a.shuffle_seed, math.ceil(a.max_steps / steps_per_epoch(n, bs)))[:a.max_steps]
        return torch.utils.data.DataLoader(self.train_dataset,
                                           batch_sampler=RankBatches(batches, a.process_index, a.world_size),
                                           collate_fn=collate_rows)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = model(inputs["idx"], inputs["real"])
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs:
            m = self.accelerator.unwrap_model(self.model)
            (loss,) = all_reduce_sum([m.loss])
            logs = {**logs, "loss": loss / (self.args.gradient_accumulation_steps * max(1, round(self.args.logging_steps)))}
            m.loss = 0.0
        super().log(logs, start_time)


class StepLog(TrainerCallback):
    """Calls ``write(step, epoch, loss)`` for every logged optimizer step (0-based step, the epoch of the
    Stage-II data order)."""

    def __init__(self, write, per_epoch: int):
        self.write, self.per_epoch = write, per_epoch

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            step = state.global_step - 1
            self.write(step, step // self.per_epoch, float(logs["loss"]))

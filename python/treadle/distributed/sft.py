"""SCALE Stage I (LoRA SFT) under FSDP2 on torch.distributed (issue 18): :func:`train_fsdp2`, reached through
``treadle.scale.sft.sft(..., parallel="fsdp2")`` / ``treadle scale sft --parallel fsdp2`` under torchrun.

Why not the HF Trainer's own FSDP2: accelerate applies its FSDP plugin only on accelerators; on CPU
(gloo) it silently falls back to DDP. So the TRL ``SFTTrainer`` stays the source of everything but the
sharding: its data (prompt-completion dataset, collator with the completion-only labels, the dataloader
that accelerate shards per rank so that the ranks together see the one-process global batch), its loss
(``training_step``: token mean over the *global* batch through ``num_items_in_batch``, scaled by the
world size, so the ranks' gradients averaged by FSDP2's reduce-scatter are the whole batch's) and its
optimizer and LR schedule (``create_optimizer_and_scheduler``). This module only runs the step loop
over a model sharded with :func:`treadle.distributed.parallel.wrap`: ``fully_shard`` per decoder layer
(the model's ``_no_split_modules``) and then the root, so every parameter, the frozen base included, is
a ``Shard(0)`` DTensor (1 / world of it per rank), and only the LoRA A/B are trainable.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from treadle.distributed.parallel import all_reduce_sum, decoder_layers, wrap
from treadle.distributed.process_group import world_size

__all__ = ["train_fsdp2"]


def train_fsdp2(trainer, steps: int, on_step: Callable[[int, float, float], None] | None = None, *,
                checkpoint_every: int | None = None, resume_from: str | Path | None = None) -> list[float]:
    """Shard ``trainer.model`` (a PEFT model whose only trainable parameters are LoRA A/B) with FSDP2 and run
    ``steps`` optimizer steps of the trainer's own loss, optimizer and LR schedule on its per-rank
    dataloader. A collective: every rank calls it.

    Args:
        trainer: an untrained ``trl.SFTTrainer`` (:func:`treadle.scale.sft.stage_one_trainer`) under torchrun,
            ``gradient_accumulation_steps`` 1.
        steps: optimizer steps (``<= `` the dataloader's batches).
        on_step: called on every rank with ``(step, loss, lr)``: the global batch's loss (the mean of the
            ranks' scaled losses, as the Trainer logs it) and the learning rate used by that step.
        checkpoint_every: write a step checkpoint into ``trainer.args.output_dir`` every that many steps and
            after the last (:func:`treadle.distributed.sft_checkpoint.save_fsdp2_checkpoint`, the Trainer's
            format; None: none). The trainer's callbacks get ``on_save`` after each.
        resume_from: a ``checkpoint-<k>`` folder (written by this loop or by the Trainer, any world size):
            load it and run steps ``k .. steps - 1``, skipping the first ``k`` global batches (the same data
            order as an uninterrupted run).

    Returns:
        The per-step losses of the steps run here.

    Raises:
        ValueError: ``steps`` < 1, ``checkpoint_every`` < 1, gradient accumulation > 1, or the dataloader runs
            out of batches (no model change in the first three cases); a checkpoint of another model / LoRA
            config (:func:`~treadle.distributed.sft_checkpoint.load_fsdp2_checkpoint`).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be an int >= 1 (steps between checkpoints), got {checkpoint_every!r}")
    if trainer.args.gradient_accumulation_steps != 1:
        raise ValueError("FSDP2 Stage I runs one micro-batch per step (gradient_accumulation_steps=1), got "
                         f"{trainer.args.gradient_accumulation_steps}")
    from treadle.distributed.sft_checkpoint import load_fsdp2_checkpoint, save_fsdp2_checkpoint

    model = trainer.model
    wrap(model, "fsdp2", blocks=decoder_layers(model))
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    trainer.state.compute_steps(trainer.args, steps)
    trainer.state.max_steps, trainer.state.train_batch_size = steps, trainer.args.per_device_train_batch_size
    first = 0 if resume_from is None else load_fsdp2_checkpoint(trainer, model, resume_from)
    params = [p for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device
    batches = iter(trainer.get_train_dataloader())
    for step in range(first):  # the global batches the checkpoint's steps trained on
        if not trainer.get_batch_samples(batches, 1, device)[0]:
            raise ValueError(f"the training data ran out after {step} of the checkpoint's {first} steps")
    W = world_size()
    losses = []
    for step in range(first, steps):
        samples, n_items = trainer.get_batch_samples(batches, 1, device)
        if not samples:
            raise ValueError(f"the training data ran out after {step} of {steps} steps")
        lr = sched.get_last_lr()[0]
        loss = trainer.training_step(model, samples[0], n_items)
        if trainer.args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, trainer.args.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        trainer.state.global_step = step + 1
        (total,) = all_reduce_sum([float(loss)])
        losses.append(total / W)
        if on_step is not None:
            on_step(step, losses[-1], lr)
        if checkpoint_every is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
            save_fsdp2_checkpoint(trainer, model, trainer.args.output_dir, step + 1)
            trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    model.eval()
    return losses

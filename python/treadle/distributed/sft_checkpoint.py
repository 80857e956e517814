"""Step checkpoints of SCALE Stage I (LoRA SFT, :func:`treadle.scale.sft.sft`) in the HF Trainer's own format,
so that a run resumes on any world size and across one process, DDP and FSDP2 (issue 18).

Why the Trainer's format (``<trainer output_dir>/checkpoint-<step>/``: ``adapter_model.safetensors`` +
``adapter_config.json`` (PEFT ``save_pretrained``, full tensors), ``optimizer.pt`` (the AdamW
``state_dict`` in the one-process format), ``scheduler.pt``, ``trainer_state.json``, ``rng_state*.pth``):
one process and DDP run ``trainer.train()``, whose own ``save_strategy="steps"`` checkpoints and
``resume_from_checkpoint`` are correct across world sizes for this setup (DDP replicas hold the whole
LoRA and AdamW state and rank 0 writes them; on resume the Trainer skips the first ``global_step``
batches of its per-rank dataloader, and ``config.batch_size`` is the global batch, so the skipped
batches are the same problems on 1 or N ranks; the RNG of a rank that has no ``rng_state_<rank>.pth``
is not restored, which only matters with ``lora_dropout > 0``). The FSDP2 loop
(:func:`treadle.distributed.sft.train_fsdp2`) is not the Trainer's, so it writes and reads the same
files itself here: the LoRA A/B and the AdamW moments gathered into full tensors before rank 0
writes them, and sharded again on load. Any of the three can therefore continue any other's checkpoint.

``trainer_state.json`` is written last by rank 0: a checkpoint folder without it (a run killed while
writing) is not used (:func:`latest_checkpoint`).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["latest_checkpoint", "save_fsdp2_checkpoint", "load_fsdp2_checkpoint", "checkpoint_step"]

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a ``checkpoint-<step>`` folder was written after."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a trainer checkpoint folder (checkpoint-<step>)")
    return int(m.group(1))


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The complete ``checkpoint-<step>`` folder of ``folder`` with the highest step (None: none). A folder
    whose ``trainer_state.json`` is missing (written last) is skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    done = [p for p in folder.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / STATE).is_file()]
    return max(done, key=checkpoint_step, default=None)


def _lora_state(model) -> dict:
    """The LoRA A/B entries of ``model.state_dict()`` as full tensors (a collective under FSDP2)."""
    from treadle.distributed.parallel import full_tensor

    return {k: full_tensor(v).detach().cpu().clone() for k, v in model.state_dict().items() if "lora_" in k}


def save_fsdp2_checkpoint(trainer, model, folder: str | Path, step: int, *, keep: int = 2) -> Path:
    """After optimizer step ``step`` of :func:`~treadle.distributed.sft.train_fsdp2`: write
    ``folder/checkpoint-<step>`` in the Trainer's format (module docstring). A collective: every rank
    gathers the shards; rank 0 writes the adapter, optimizer, scheduler and ``trainer_state.json`` (last),
    every rank its ``rng_state_<rank>.pth``; older checkpoints beyond the newest ``keep`` are removed."""
    from treadle.distributed.parallel import full_optimizer_state
    from treadle.distributed.process_group import is_main

    lora = _lora_state(model)
    optim = full_optimizer_state(trainer.optimizer)
    out = Path(folder) / f"checkpoint-{step}"
    main = is_main()
    if main:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        model.save_pretrained(str(out), state_dict=lora)
        torch.save(optim, out / "optimizer.pt")
        torch.save(trainer.lr_scheduler.state_dict(), out / "scheduler.pt")
    if dist.is_initialized():
        dist.barrier()
    trainer._save_rng_state(str(out))  # the Trainer's own rng_state[_<rank>].pth (private API, same format)
    if dist.is_initialized():
        dist.barrier()
    if main:
        trainer.state.global_step = step
        trainer.state.save_to_json(str(out / STATE))
        done = sorted((p for p in Path(folder).iterdir() if p.is_dir() and _NAME.match(p.name)), key=checkpoint_step)
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return out


def load_fsdp2_checkpoint(trainer, model, checkpoint: str | Path) -> int:
    """Load a Stage I checkpoint (written by the Trainer in one process / DDP, or by
    :func:`save_fsdp2_checkpoint` on any world size) into an FSDP2-sharded PEFT ``model`` and the
    trainer's optimizer and scheduler (already created over the sharded parameters). Every rank reads the
    files (a shared file system, as the Trainer assumes). Returns the step to run next.

    Raises:
        ValueError: the adapter does not hold exactly the model's LoRA tensors, or a tensor of another shape
            (a checkpoint of another model or LoRA config); the model is unchanged then.
    """
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    from treadle.distributed.parallel import load_optimizer_state

    checkpoint = Path(checkpoint)
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    names = {n: p for n, p in model.named_parameters() if "lora_" in n}
    # PEFT's save_pretrained drops the adapter name: base_model...q_proj.lora_A.default.weight -> ...lora_A.weight
    by_saved = {n.replace(".default", ""): n for n in names}
    if set(by_saved) != set(saved):
        missing, extra = sorted(set(by_saved) - set(saved)), sorted(set(saved) - set(by_saved))
        raise ValueError(f"checkpoint {checkpoint} holds other LoRA tensors than the model (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}): another model or LoRA config")
    for k, v in saved.items():
        p = names[by_saved[k]]
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"checkpoint {checkpoint}: {k} has shape {tuple(v.shape)}, the model's {tuple(p.shape)}")
    with torch.no_grad():
        for k, v in saved.items():
            p = names[by_saved[k]]
            v = v.to(device=p.device, dtype=p.dtype)
            p.copy_(distribute_tensor(v, p.device_mesh, p.placements) if isinstance(p, DTensor) else v)
    load_optimizer_state(trainer.optimizer, torch.load(checkpoint / "optimizer.pt", map_location="cpu",
                                                       weights_only=True))
    trainer.lr_scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
    trainer._load_rng_state(str(checkpoint))
    return checkpoint_step(checkpoint)

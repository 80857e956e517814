"""What STAIR's and SCALE Stage II's ``transformers.Trainer`` subclasses share: seeded global batches split
over ranks, checkpoints that hold only the trainable parameters, and the launcher check of ``--parallel``.

The trainers train a handful of parameters (STAIR's reflection normals, SCALE's gates) on top of a
frozen model, with a data order of their own (one seeded permutation per step or per epoch, fixed by
the method's settings, not by the world size). Everything else is the Trainer's: the process group
(torchrun / ``accelerate launch``), DDP / FSDP through accelerate, gradient accumulation, mixed
precision, the optimizer and its schedule, logging to ``report_to`` and checkpoints / resume.

* :class:`RankBatches`: this rank's contiguous part of each global batch (``torch.tensor_split``
  sizes), so that ``world`` ranks together see exactly the rows one process would; a run resumed on
  another world size skips the same global batches (the Trainer skips ``global_step x grad_accum``
  loader batches).
* :class:`TrainableOnlyCheckpoints`: a Trainer mix-in whose checkpoints (``checkpoint-<step>/``) store
  the trainable parameters only (``trainable.safetensors``, full tensors written once by the main
  process), next to the Trainer's own ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth`` and
  ``trainer_state.json``; resume loads them by name on any world size.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["Rows", "collate_rows", "RankBatches", "TrainableOnlyCheckpoints", "TRAINABLE_FILE", "all_reduce_sum", "broadcast_from_main",
           "latest_checkpoint", "remove_checkpoints", "check_launch", "launched_world", "PARALLEL", "fsdp_arguments",
           "decoder_layer_classes"]

TRAINABLE_FILE = "trainable.safetensors"
PARALLEL = ("ddp", "fsdp2")
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _share(n: int, rank: int, world: int) -> slice:
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return slice(lo, lo + base + (1 if rank < extra else 0))


class Rows(torch.utils.data.Dataset):
    """Row indices ``0..n-1`` as a dataset for :class:`RankBatches`: item ``i`` is ``(i, True)``; the stand-in
    item ``(i, False)`` (asked for as ``-1 - i``) marks a row run with weight 0."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return (i, True) if i >= 0 else (-1 - i, False)


def collate_rows(items) -> dict:
    """``{"idx": row indices, "real": False when this rank's part of the batch is empty}``."""
    return {"idx": [i for i, _ in items], "real": all(r for _, r in items)}


class RankBatches(torch.utils.data.Sampler):
    """A batch sampler over precomputed global batches (lists of row indices of a :class:`Rows` dataset):
    yields this rank's contiguous part of each, in order. A rank whose part of a batch is empty (a batch
    with fewer rows than ranks) gets the batch's first row to run with weight 0, so that every rank makes
    the same forward and collective calls."""

    def __init__(self, global_batches: Sequence[Sequence[int]], rank: int, world: int):
        self.batches = [list(b) for b in global_batches]
        self.rank, self.world = rank, world

    def __iter__(self):
        for b in self.batches:
            part = b[_share(len(b), self.rank, self.world)]
            yield part if part else [-1 - b[0]]

    def __len__(self) -> int:
        return len(self.batches)


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Sum Python numbers over the default process group (one float64 all-reduce; identity in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(v) for v in values]
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_from_main(obj):
    """Rank 0's picklable ``obj`` on every rank (``obj`` itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The complete ``checkpoint-<step>`` folder of ``folder`` with the highest step (None: none); a folder
    without ``trainer_state.json`` (the Trainer writes it last) is skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    done = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
            and p.name[len("checkpoint-"):].isdigit() and (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name[len("checkpoint-"):]), default=None)


def remove_checkpoints(folder: str | Path) -> None:
    """Remove the ``checkpoint-<step>`` folders of ``folder`` (a run that starts afresh there)."""
    import shutil

    folder = Path(folder)
    if folder.is_dir():
        for p in folder.iterdir():
            if p.is_dir() and p.name.startswith("checkpoint-") and p.name[len("checkpoint-"):].isdigit():
                shutil.rmtree(p)


def launched_world() -> int:
    """``WORLD_SIZE`` set by torchrun / ``accelerate launch`` (1 when not launched)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def launched_state():
    """accelerate's process state of this rank (``is_main_process``, ``device``), joined to the process group
    torchrun / accelerate launch set up. On a machine without an accelerator accelerate only forms a
    multi-process CPU group when asked for the CPU; otherwise every rank would think it is the only one
    (and each would write the run folder)."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def check_launch(parallel: str | None, *, flag: str = "--parallel") -> None:
    """``parallel`` is None in a process of its own, or ``"ddp"`` / ``"fsdp2"`` in a process started by
    torchrun or ``accelerate launch`` (FSDP needs an accelerator: accelerate applies its FSDP plugin only
    there).

    Raises:
        ValueError: an unknown value; a launcher variable missing (named, with the command to use);
            ``fsdp2`` without CUDA; None in one of several launched ranks (each would write the run folder).
    """
    if parallel is None:
        if launched_world() > 1:
            raise ValueError(f"this process is one of {launched_world()} ranks torchrun / accelerate launch started: "
                             f"add {flag} ddp (or run in one process)")
        return
    if parallel not in PARALLEL:
        raise ValueError(f"{flag} must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    missing = [v for v in _LAUNCH_ENV if v not in os.environ]
    if missing:
        raise ValueError(f"{flag} {parallel} runs one process per rank, started by torchrun or accelerate launch "
                         f"(e.g. torchrun --nproc-per-node 2 -m treadle ...); missing environment: "
                         f"{', '.join(missing)}")
    if parallel == "fsdp2" and not torch.cuda.is_available():
        raise ValueError(f"{flag} fsdp2 shards the model with the Trainer's FSDP, which accelerate applies on "
                         f"accelerators only; on CPU use {flag} ddp")


def decoder_layer_classes(model) -> list[str]:
    """The class names a Hugging Face model (or a PEFT wrapper of one) lists in ``_no_split_modules``: its
    decoder layers, FSDP's units."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return sorted(names)


def fsdp_arguments(parallel: str | None, layer_classes: Sequence[str] = ()) -> dict:
    """``TrainingArguments`` keywords for ``parallel``: FSDP2 (``fully_shard`` per decoder layer) for
    ``"fsdp2"``; nothing for ``"ddp"`` / None (the Trainer runs DDP whenever it is launched on ranks)."""
    if parallel != "fsdp2":
        return {}
    cfg = {"fsdp_version": 2, "reshard_after_forward": True}
    if layer_classes:
        cfg["transformer_layer_cls_to_wrap"] = list(layer_classes)
    return {"fsdp": "full_shard auto_wrap", "fsdp_config": cfg}


class TrainableOnlyCheckpoints:
    """``transformers.Trainer`` mix-in: the model is a frozen network plus a few trainable parameters; a
    checkpoint stores those (``trainable.safetensors``, by parameter name) and the Trainer's optimizer,
    scheduler, RNG and state files; resume loads them into the same names (any world size)."""

    def _trainable_names(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        from safetensors.torch import save_file

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        names = self._trainable_names()
        sd = state_dict if state_dict is not None else self.model.state_dict()
        full = {}
        for n in names:
            t = sd[n]
            if hasattr(t, "full_tensor"):  # a DTensor (FSDP): gathered, every rank takes part
                t = t.full_tensor()
            full[n] = t.detach().to("cpu", torch.float32).contiguous().clone()
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        save_file(full, os.path.join(output_dir, TRAINABLE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        from safetensors.torch import load_file

        model = self.model if model is None else model
        saved = load_file(os.path.join(resume_from_checkpoint, TRAINABLE_FILE))
        params = dict(model.named_parameters())
        names = self._trainable_names()
        if sorted(saved) != sorted(names):
            raise ValueError(f"checkpoint {resume_from_checkpoint} holds other trainable parameters than the model "
                             f"(e.g. {sorted(set(saved) ^ set(names))[:3]}): another model or layout")
        with torch.no_grad():
            for n, v in saved.items():
                p = params[n]
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(f"checkpoint {resume_from_checkpoint}: {n} has shape {tuple(v.shape)}, the "
                                     f"model's {tuple(p.shape)}")
                if hasattr(p, "device_mesh"):  # FSDP2 DTensor
                    from torch.distributed.tensor import distribute_tensor

                    p.copy_(distribute_tensor(v.to(p.dtype), p.device_mesh, p.placements))
                else:
                    p.copy_(v.to(device=p.device, dtype=p.dtype))

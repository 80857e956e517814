"""Which process group a distributed call uses, and this process's place in it (torch.distributed only).

Every function in :mod:`treadle.distributed` takes an explicit ``group=`` (a
``torch.distributed.ProcessGroup``; None = the default group). Nothing is read from hidden global
state other than torch.distributed's own (``dist.is_initialized()``, the default group).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class NotDistributedError(RuntimeError):
    """A distributed call was made but ``torch.distributed`` is not initialised (run under ``torchrun``,
    or call ``torch.distributed.init_process_group`` first)."""


def require_initialized(what: str) -> None:
    """Raise :class:`NotDistributedError` naming ``what`` unless a default process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise NotDistributedError(f"{what} needs torch.distributed to be initialised (run under torchrun, or call "
                                  f"torch.distributed.init_process_group first)")


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group=None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def is_main(group=None) -> bool:
    """True on rank 0 (and in a single process): the one rank that writes checkpoints and logs."""
    return rank(group) == 0


def collective_device(group=None) -> torch.device:
    """The device collectives of ``group`` run on: CUDA for NCCL, else CPU (gloo)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

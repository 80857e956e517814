"""Joining the process group ``torchrun`` set up, for ``treadle weft train --parallel`` (the WEFT GRPO loop on
torch.distributed, until it runs on TRL). ``treadle stair|scale train --parallel`` use the Trainer's own
launch handling (:func:`treadle.trainer_support.check_launch`).

``torchrun --nproc-per-node N -m treadle stair train --parallel ddp ...`` starts N processes with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set;
:func:`init_from_torchrun` reads them through ``init_process_group`` (``env://``): NCCL with one GPU
per process (``cuda:LOCAL_RANK``) where CUDA is available, else gloo on CPU.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ValueError):
    """``--parallel`` was given outside ``torchrun`` (or a like launcher)."""


def init_from_torchrun(parallel: str | None, *, flag: str = "--parallel") -> torch.device | None:
    """Initialise torch.distributed from torchrun's environment when ``parallel`` is set.

    Returns:
        None when ``parallel`` is None (one process); else this rank's device (``cuda:LOCAL_RANK``
        or ``cpu``).

    Raises:
        LaunchError: ``parallel`` is set but the torchrun variables are missing (names them and the flag).
    """
    if parallel is None:
        return None
    missing = [v for v in _ENV if v not in os.environ]
    if missing:
        raise LaunchError(f"{flag} {parallel} runs one process per rank under torchrun (e.g. torchrun "
                          f"--nproc-per-node 2 -m treadle ...); missing environment: {', '.join(missing)}")
    local = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", local) if cuda else torch.device("cpu")


def shutdown() -> None:
    """Leave the process group (no-op when none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

"""Run a function on N local CPU processes over gloo: what the distributed tests and quick local checks
use (``torch.multiprocessing.spawn``). Each process gets the variables torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free local port), so that
``transformers.Trainer`` / accelerate see a launched job, and joins the default process group (gloo,
``env://``) before the function runs. Real runs use ``torchrun`` or ``accelerate launch``.

The function is passed as ``(source file, name)`` and imported from that file in each child, so it may
live in a test module that is not importable by name (pytest's ``--import-mode=importlib``).
"""
from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import torch


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"_treadle_spawned_{Path(path).stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _entry(local_rank: int, path: str, name: str, world: int, out_dir: str, args: tuple, threads: int,
           port: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method="env://", rank=local_rank, world_size=world)
    try:
        result = _load(path, name)(*args)
        torch.save(result, os.path.join(out_dir, f"rank{local_rank}.pt"))
        # every rank done before any tears down: a rank leaving while gloo still serves another rank's
        # traffic aborted once in CI ("terminate called without an active exception", SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn, world: int, out_dir, *args, threads: int = 1) -> list:
    """Run module-level ``fn(*args)`` on ``world`` gloo ranks (CPU); returns each rank's (picklable)
    result in rank order. ``out_dir`` must be an empty, writable folder (results travel through it).

    Raises:
        ValueError: ``world < 1``; ``fn`` not a module-level function of a source file.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is in the message).
    """
    import torch.multiprocessing as mp

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    path, name = getattr(getattr(fn, "__code__", None), "co_filename", None), getattr(fn, "__name__", "")
    if path is None or not os.path.exists(path) or "<" in name:
        raise ValueError(f"fn must be a module-level function defined in a source file, got {fn!r}")
    out_dir = str(out_dir)
    with socket.socket() as s:  # a free local port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(path, name, world, out_dir, args, threads, port), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]

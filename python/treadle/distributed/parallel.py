"""DDP / FSDP2 wrapping and the collectives around it, for the WEFT GRPO loop on torch.distributed
(:mod:`treadle.weft.rl.parallel`, :mod:`treadle.distributed.weft_resume`) until that loop runs on TRL's
``GRPOTrainer``. STAIR and SCALE train on ``transformers.Trainer``, which does all of this itself.

* :func:`wrap`: ``"ddp"`` wraps a module in ``DistributedDataParallel``; ``"fsdp2"`` applies
  ``torch.distributed.fsdp.fully_shard`` to each given block (decoder layers) and then to the module.
* :func:`share`: this rank's contiguous part of a global batch, so that ``world`` ranks together see
  exactly the batch one process would.
* :func:`full_tensor`, :func:`full_optimizer_state`, :func:`load_optimizer_state`: checkpoints in the
  single-process format (full tensors), loadable on any world size.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from treadle.distributed.process_group import collective_device, rank, require_initialized, world_size

__all__ = ["PARALLEL", "check_parallel", "decoder_layers", "wrap", "share", "full_tensor", "full_optimizer_state",
           "load_optimizer_state", "all_reduce_sum", "broadcast_object"]

PARALLEL = ("ddp", "fsdp2")


def check_parallel(parallel: str | None, what: str = "training") -> None:
    """Raise ValueError for an unknown ``parallel`` and NotDistributedError when it is set but
    torch.distributed is not initialised (None: single process, always fine)."""
    if parallel is None:
        return
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {PARALLEL} or None, got {parallel!r}")
    require_initialized(f"{what} with parallel={parallel!r}")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The sub-modules of ``model`` whose class is one of its ``_no_split_modules`` (HF decoder layers):
    FSDP2's units. Empty when the model names none (then the whole model is one unit)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    for m in model.modules():  # a PEFT wrapper: the HF model inside names them
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap(module: nn.Module, parallel: str, *, blocks: Sequence[nn.Module] = (), group=None) -> nn.Module:
    """Make ``module`` data-parallel over ``group``.

    Args:
        module: the step module (its forward runs one micro-batch and returns the loss).
        parallel: ``"ddp"`` or ``"fsdp2"``.
        blocks: FSDP2 only: the sub-modules that become their own FSDP units (decoder layers), so that
            one block's weights at a time are all-gathered.
        group: process group (None: default). FSDP2 uses a 1-D device mesh over it.

    Returns:
        The DDP wrapper, or ``module`` itself (FSDP2 changes it in place).

    Raises:
        ValueError: unknown ``parallel``; NotDistributedError: torch.distributed not initialised.
    """
    check_parallel(parallel)
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = next(module.parameters()).device
        ids = [dev.index] if dev.type == "cuda" else None
        return DDP(module, device_ids=ids, process_group=group)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = collective_device(group)
    mesh = DeviceMesh.from_group(group, dev.type) if group is not None else init_device_mesh(dev.type, (world_size(),))
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def share(n: int, *, group=None) -> tuple[slice, bool]:
    """This rank's contiguous part of ``n`` global rows (``torch.tensor_split`` sizes: they differ by at
    most one, the first ranks get the extra rows).

    Returns:
        ``(rows, real)``: a slice of ``range(n)``; ``real`` is False when this rank's part is empty, in
        which case ``rows`` is ``slice(0, 1)``: the rank runs row 0 with weight 0, so every rank makes
        the same collective calls (FSDP2 all-gathers in every forward).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"a global batch needs at least one row, got {n}")
    W, r = world_size(group), rank(group)
    base, extra = divmod(n, W)
    lo = r * base + min(r, extra)
    size = base + (1 if r < extra else 0)
    if size == 0:
        return slice(0, 1), False
    return slice(lo, lo + size), True


def all_reduce_sum(values: Sequence[float], *, group=None) -> list[float]:
    """Sum Python numbers over ranks (one float64 all-reduce)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def broadcast_object(obj, *, src: int = 0, group=None):
    """Rank ``src``'s picklable ``obj`` on every rank (``dist.broadcast_object_list``)."""
    box = [obj if rank(group) == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective: every rank must call it), detached, on CPU;
    a plain tensor is returned detached on CPU."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.cpu()


def full_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` with every DTensor state (FSDP2's sharded Adam moments) gathered into a full
    CPU tensor: the single-process format, loadable at any world size. A collective: every rank calls."""
    sd = opt.state_dict()
    state = {i: {k: (full_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_optimizer_state(opt: torch.optim.Optimizer, sd: dict) -> None:
    """Load a full (single-process format) optimizer state into ``opt`` whose parameters may be FSDP2
    DTensors: each state tensor shaped like its parameter is sharded like it first
    (``distribute_tensor`` with the parameter's mesh and placements).

    Raises:
        ValueError: a state tensor whose shape is neither the parameter's nor a scalar (another model).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        out = {}
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {k!r} of parameter {i} has shape {tuple(v.shape)}, the "
                                     f"parameter has {tuple(p.shape)}: the checkpoint is from another model")
                if isinstance(p, DTensor):
                    v = distribute_tensor(v.to(p.dtype), p.device_mesh, p.placements)
            out[k] = v
        state[i] = out
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})

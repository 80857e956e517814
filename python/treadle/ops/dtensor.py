"""treadle's ops take plain tensors; a DTensor (a sharded or replicated ``torch.distributed.tensor``
parameter, as FSDP2 stores them outside the forward) is refused with a clear error rather than run on
its local shard or sent to DTensor dispatch (which has no sharding rule for treadle's custom ops).

Under FSDP2 (``fully_shard``, as the Trainer's FSDP2 applies it) the ops run inside the wrapped
module's forward, where the all-gathered plain parameters are swapped in, so this never fires. Outside it, convert explicitly: ``t.full_tensor()`` (a collective) or ``t.to_local()``
(a replicated DTensor's full value on each rank).
"""
from __future__ import annotations

import sys

import torch


class DTensorInputError(TypeError):
    """A treadle op got a ``torch.distributed.tensor.DTensor`` input."""


def refuse_dtensor(op: str, **tensors) -> None:
    """Raise :class:`DTensorInputError` if any of ``tensors`` (name -> tensor or None) is a DTensor.

    Costs one ``type(...)`` check per argument for plain tensors (nothing is imported: DTensor can only
    exist once ``torch.distributed.tensor`` has been imported).
    """
    if torch.compiler.is_compiling():  # traced graphs see fake tensors; DTensor programs are not ours to trace
        return
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None:
        return
    for name, t in tensors.items():
        if t is not None and type(t) is not torch.Tensor and isinstance(t, mod.DTensor):
            raise DTensorInputError(
                f"treadle op {op!r} got a DTensor for {name!r} (placements {tuple(t.placements)}, global shape "
                f"{tuple(t.shape)}); treadle ops take plain tensors. Call it inside the FSDP-wrapped module's "
                f"forward (fully_shard gives plain, all-gathered parameters there), or convert explicitly: "
                f"{name}.full_tensor() (sharded; a collective) or {name}.to_local() (replicated)")

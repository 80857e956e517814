"""Scale-out training on torch.distributed (issue 18): DDP / FSDP2 for the STAIR and SCALE trainers
(:mod:`treadle.distributed.stair`, :mod:`treadle.distributed.scale`, :mod:`treadle.distributed.parallel`)
and GRPO's global loss denominators and group statistics (:mod:`treadle.distributed.grpo`), and the WEFT GRPO
trainer on DDP (:mod:`treadle.distributed.weft`) with step checkpoints resumed on any world size
(:mod:`treadle.distributed.weft_resume`), and SCALE Stage I under FSDP2 (:mod:`treadle.distributed.sft`). Every
function takes an explicit ``group=`` (None: the default process group); nothing here starts
processes (use ``torchrun``). Names are imported lazily, so ``treadle.ops`` (which imports
:mod:`treadle.distributed.dtensor`) stays light."""
from __future__ import annotations

import importlib

_NAMES = {
    "aggregate_loss_dp": "grpo", "all_gather_rows": "grpo", "global_group_ids": "grpo",
    "global_loss_denominators": "grpo", "grpo_advantages_dp": "grpo",
    "NotDistributedError": "process_group", "is_main": "process_group", "rank": "process_group",
    "world_size": "process_group", "DTensorInputError": "dtensor", "PARALLEL": "parallel",
    "train_policy_dp": "weft", "RowKeyedSampler": "weft", "StepCheckpoint": "weft_resume",
    "train_fsdp2": "sft",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"treadle.distributed.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'treadle.distributed' has no attribute {name!r}")

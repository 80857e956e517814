"""What user code needs on several ranks with any engine (TRL, verl, ``transformers.Trainer``, a loop of its
own): GRPO's global loss denominators and group statistics across ranks (:mod:`treadle.distributed.grpo`),
and the process-group helpers they take (:mod:`treadle.distributed.process_group`). Every function takes
an explicit ``group=`` (None: the default process group); nothing here starts processes (use torchrun or
``accelerate launch``). Names are imported lazily.

Training runs on the engines: STAIR and SCALE on ``transformers.Trainer`` (:mod:`treadle.stair.trainer`,
:mod:`treadle.scale.trainer`), WEFT GRPO on ``trl.GRPOTrainer`` (:mod:`treadle.weft.rl.trl_trainer`): DDP / FSDP,
checkpoints and resume are theirs. No module here imports a method package (stair, scale, weft).
"""
from __future__ import annotations

import importlib

_NAMES = {
    "aggregate_loss_dp": "grpo", "all_gather_rows": "grpo", "global_group_ids": "grpo",
    "global_loss_denominators": "grpo", "grpo_advantages_dp": "grpo",
    "NotDistributedError": "process_group", "is_main": "process_group", "rank": "process_group",
    "world_size": "process_group",
}
__all__ = sorted([*_NAMES, "DTensorInputError"])


def __getattr__(name: str):
    if name == "DTensorInputError":  # the ops' own check (treadle.ops.dtensor); this name stays for old imports
        from treadle.ops.dtensor import DTensorInputError

        return DTensorInputError
    if name in _NAMES:
        return getattr(importlib.import_module(f"treadle.distributed.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'treadle.distributed' has no attribute {name!r}")

"""Scale-out training on torch.distributed (issue 18): DDP / FSDP2 helpers for the STAIR and SCALE
trainers and GRPO's global loss denominators and group statistics. Every function takes an explicit
``group=`` (None: the default process group); nothing here starts processes (use ``torchrun``)."""
from treadle.distributed.grpo import (aggregate_loss_dp, all_gather_rows, global_group_ids, global_loss_denominators,
                                      grpo_advantages_dp)
from treadle.distributed.process_group import NotDistributedError, is_main, rank, world_size

__all__ = ["aggregate_loss_dp", "all_gather_rows", "global_group_ids", "global_loss_denominators",
           "grpo_advantages_dp", "NotDistributedError", "is_main", "rank", "world_size"]

"""GRPO family: group-relative advantages, token broadcast, atomic-turn groups, loss aggregation, and
drop-in adapters for verl and TRL (seeds: WEFT sec. 4.1 "atomic-turn GRPO"; DESIGN.md "GRPO family")."""
from treadle.grpo.broadcast import broadcast_packed, broadcast_to_tokens
from treadle.grpo.grouping import atomic_turn_group_ids, group_ids_from_uids
from treadle.grpo.losses import LOSS_AGG_MODES, aggregate_loss, kl_k3, policy_loss
from treadle.ops.grpo_advantages import grpo_advantages

__all__ = [
    "grpo_advantages", "broadcast_to_tokens", "broadcast_packed", "atomic_turn_group_ids", "group_ids_from_uids",
    "aggregate_loss", "policy_loss", "kl_k3", "LOSS_AGG_MODES",
]

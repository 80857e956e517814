"""Plain-PyTorch references: the executable spec of every treadle kernel (float64-capable)."""
from treadle.reference.grpo import grpo_advantages_reference
from treadle.reference.scale import gated_lora_reference, topk_entropy_reference
from treadle.reference.stair import stair_readout_reference

__all__ = ["gated_lora_reference", "grpo_advantages_reference", "topk_entropy_reference", "stair_readout_reference"]

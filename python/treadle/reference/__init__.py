"""Plain-PyTorch references: the executable spec of every treadle kernel (float64-capable)."""
from treadle.reference.grpo import grpo_advantages_reference

__all__ = ["grpo_advantages_reference"]

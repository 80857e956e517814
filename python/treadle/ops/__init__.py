"""treadle's public ops: one module per op (API, torch.library registration, autograd, dispatch)."""
from treadle.ops.grpo_advantages import grpo_advantages

__all__ = ["grpo_advantages"]

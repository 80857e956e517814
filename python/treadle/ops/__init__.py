"""treadle's public ops: one module per op (API, torch.library registration, autograd, dispatch)."""
from treadle.ops.gated_lora import gated_lora, gated_lora_linear
from treadle.ops.grpo_advantages import grpo_advantages
from treadle.ops.stair_readout import stair_readout
from treadle.ops.topk_entropy import topk_entropy, topk_entropy_from_hidden

__all__ = ["gated_lora", "gated_lora_linear", "grpo_advantages", "stair_readout", "topk_entropy",
           "topk_entropy_from_hidden"]

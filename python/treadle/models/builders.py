"""Tiny, randomly initialised Hugging Face causal LMs built from configs (no download).

Architectures (``ARCHITECTURES``), the ones treadle's integrations must support:

- ``qwen3``: Qwen3 (``Qwen3ForCausalLM``): GQA, per-head q/k RMSNorm before RoPE.
- ``qwen2``: Qwen2 (``Qwen2ForCausalLM``): GQA, q/k/v biases, no q/k norm.
- ``llama``: Llama (``LlamaForCausalLM``).
- ``qwen3_5``: the Qwen3.5 text model (``Qwen3_5ForCausalLM``): gated attention (``q_proj`` also
  emits a per-head sigmoid output gate), partial RoPE (``partial_rotary_factor=0.25``), Gated
  DeltaNet linear-attention layers with a full-attention layer every fourth layer.
- ``qwen3_next``: Qwen3-Next (``Qwen3NextForCausalLM``): the same hybrid attention stack with a
  sparse MoE MLP.

Sizes are deliberately tiny (tens of thousands of parameters by default) so tests run in seconds.
"""
from __future__ import annotations

import torch

__all__ = ["ARCHITECTURES", "tiny_config", "build_tiny_model"]

ARCHITECTURES = ("qwen3", "qwen2", "llama", "qwen3_5", "qwen3_next")

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)


def _layer_types(n: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def tiny_config(arch: str, **overrides):
    """A tiny ``transformers`` config of architecture ``arch``.

    Args:
        arch: one of :data:`ARCHITECTURES`.
        **overrides: any config field (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``pad_token_id``...).
            For ``qwen3_5``/``qwen3_next``, ``layer_types`` defaults to a full-attention layer
            every fourth layer (``linear, linear, linear, full, ...``).

    Returns:
        A ``PretrainedConfig`` subclass instance (``Qwen3Config``, ``Qwen2Config``, ``LlamaConfig``,
        ``Qwen3_5TextConfig``, ``Qwen3NextConfig``).

    Raises:
        ValueError: unknown ``arch``.
    """
    import transformers as tf

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    kw = dict(_COMMON)
    kw.update(overrides)
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    if arch == "qwen3":
        return tf.Qwen3Config(**kw)
    if arch == "qwen2":
        return tf.Qwen2Config(**kw)
    if arch == "llama":
        return tf.LlamaConfig(**kw)
    kw.setdefault("layer_types", _layer_types(kw["num_hidden_layers"]))
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    kw.setdefault("linear_num_key_heads", 2)
    kw.setdefault("linear_num_value_heads", 4)
    kw.setdefault("linear_key_head_dim", 16)
    kw.setdefault("linear_value_head_dim", 16)
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**kw)
    kw.setdefault("num_experts", 4)
    kw.setdefault("num_experts_per_tok", 2)
    kw.setdefault("moe_intermediate_size", 32)
    kw.setdefault("shared_expert_intermediate_size", 32)
    return tf.Qwen3NextConfig(**kw)


def build_tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny causal LM of architecture ``arch`` (eval mode, on CPU).

    Args:
        arch: one of :data:`ARCHITECTURES`.
        seed: initialisation seed (the global RNG state is saved and restored).
        dtype: parameter dtype.
        **overrides: config fields, see :func:`tiny_config`.

    Returns:
        The ``*ForCausalLM`` model; ``model(input_ids (B, T) int64).logits`` is ``(B, T, vocab_size)``.

    Raises:
        ValueError: unknown ``arch``.
        TypeError: ``dtype`` is not a floating torch dtype.
    """
    import transformers as tf

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    config = tiny_config(arch, **overrides)
    cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "llama": tf.LlamaForCausalLM,
           "qwen3_5": tf.Qwen3_5ForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM}[arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(dtype).eval()

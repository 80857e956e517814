"""Where STAIR plugs into a Hugging Face causal LM: per-architecture facts, found before anything is altered.

For each supported architecture (:data:`SUPPORTED`) this module locates, without touching the
model: the decoder layers, each controlled layer's softmax-attention module, the submodules whose
outputs are the pre-RoPE queries / keys / values (``q_norm`` / ``k_norm`` where the model has per-head
norms, else ``q_proj`` / ``k_proj``; always ``v_proj``), the model's own rotary embedding module and
its modelling file's ``apply_rotary_pos_emb`` (which handles partial RoPE), and whether the attention
output passes through a sigmoid gate before ``o_proj`` (Qwen3.5 / Qwen3-Next gated attention).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

__all__ = ["SUPPORTED", "UnsupportedModelError", "ArchInfo", "inspect_model"]

#: HF ``config.model_type`` -> human name. Qwen3.5 here is the text model (``Qwen3_5ForCausalLM``).
SUPPORTED = {
    "qwen3": "Qwen3",
    "qwen2": "Qwen2",
    "llama": "Llama",
    "qwen3_5_text": "Qwen3.5 (text)",
    "qwen3_next": "Qwen3-Next",
}
_GATED = ("qwen3_5_text", "qwen3_next")


class UnsupportedModelError(ValueError):
    """The model (or a requested layer) cannot host STAIR; the message names what is supported."""


@dataclass
class ArchInfo:
    """What :func:`inspect_model` found (no reference to it alters the model).

    Attributes:
        model_type: ``config.model_type``.
        attn: layer index -> the softmax attention module of that layer.
        q_src, k_src, v_src: layer index -> module whose forward output is the pre-RoPE query
            ``(B, T, Hq, D)`` or ``(B, T, Hq*D)``, key (``Hkv``) and value (``Hkv*Dv``).
        rotary: the model's rotary embedding module (``forward(x, position_ids) -> (cos, sin)``).
        apply_rotary: the modelling file's ``apply_rotary_pos_emb(q, k, cos, sin)``.
        eager: the modelling file's ``eager_attention_forward``.
        num_layers, num_heads, num_kv_heads, head_dim: shapes.
        gated: attention output goes through ``sigmoid(gate)`` before ``o_proj``.
        full_attention_layers: indices of the layers with softmax attention.
        max_positions: ``config.max_position_embeddings``.
    """

    model_type: str
    attn: dict
    q_src: dict
    k_src: dict
    v_src: dict
    rotary: torch.nn.Module
    apply_rotary: object
    eager: object
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gated: bool
    full_attention_layers: list
    max_positions: int


def _supported_text() -> str:
    return ", ".join(f"{v} (model_type {k!r})" for k, v in SUPPORTED.items())


def _base(model):
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers"):
        raise UnsupportedModelError(f"{type(model).__name__} has no `.model.layers`; STAIR supports the causal-LM classes "
                                    f"of: {_supported_text()}")
    return base


def inspect_model(model, layers) -> ArchInfo:
    """Locate everything STAIR needs in ``model`` for the zero-based decoder ``layers``.

    Args:
        model: a HF ``*ForCausalLM`` of a supported architecture.
        layers: iterable of distinct ints, each a softmax-attention layer of the model.

    Returns:
        :class:`ArchInfo`.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` with a config; a layer is not an int.
        UnsupportedModelError: unsupported ``config.model_type`` (lists the supported ones); a layer
            out of range or without softmax attention (lists the model's full-attention layers);
            empty or repeated layers.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be a Hugging Face PreTrainedModel (an nn.Module with .config), got {type(model).__name__}")
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED:
        raise UnsupportedModelError(f"STAIR does not support model_type {mt!r} ({type(model).__name__}); supported: "
                                    f"{_supported_text()}")
    base = _base(model)
    decoder = list(base.layers)
    n = len(decoder)
    full = [i for i, lay in enumerate(decoder) if isinstance(getattr(lay, "self_attn", None), torch.nn.Module)]
    try:
        layers = tuple(layers)
    except TypeError:
        raise TypeError(f"layers must be an iterable of ints, got {type(layers).__name__}") from None
    if not layers:
        raise UnsupportedModelError("layers must name at least one decoder layer")
    for li in layers:
        if not isinstance(li, int) or isinstance(li, bool):
            raise TypeError(f"layers must be ints (zero-based decoder layer indices), got {li!r}")
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"layers must be distinct, got {layers}")
    for li in layers:
        if not 0 <= li < n:
            raise UnsupportedModelError(f"layer {li} is out of range: {type(model).__name__} has {n} decoder layers "
                                        f"(0..{n - 1}); its softmax-attention layers are {full}")
        if li not in full:
            kind = getattr(cfg, "layer_types", [None] * n)[li] if getattr(cfg, "layer_types", None) else "non-softmax"
            raise UnsupportedModelError(f"layer {li} of {type(model).__name__} is a {kind} layer without softmax "
                                        f"attention; STAIR reads a bank through softmax attention only. Softmax-attention "
                                        f"layers of this model: {full}")
    attn, q_src, k_src, v_src = {}, {}, {}, {}
    for li in layers:
        a = decoder[li].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(a, name, None), torch.nn.Module):
                raise UnsupportedModelError(f"layer {li}'s attention ({type(a).__name__}) has no {name}; expected the "
                                            f"standard HF attention of {_supported_text()}")
        gated = mt in _GATED
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        if gated and qn is None:
            raise UnsupportedModelError(f"gated attention at layer {li} without q_norm: q_proj also carries the gate, "
                                        f"so the pre-RoPE query cannot be read")
        attn[li], q_src[li], k_src[li], v_src[li] = a, qn if qn is not None else a.q_proj, \
            kn if kn is not None else a.k_proj, a.v_proj
    mod = sys.modules[type(attn[layers[0]]).__module__]
    apply_rotary = getattr(mod, "apply_rotary_pos_emb", None)
    eager = getattr(mod, "eager_attention_forward", None)
    rotary = getattr(base, "rotary_emb", None)
    if apply_rotary is None or eager is None or not isinstance(rotary, torch.nn.Module):
        raise UnsupportedModelError(f"{type(model).__name__}: could not find the model's rotary embedding / "
                                    f"apply_rotary_pos_emb / eager_attention_forward")
    a0 = attn[layers[0]]
    head_dim = int(a0.head_dim)
    hq = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
    return ArchInfo(mt, attn, q_src, k_src, v_src, rotary, apply_rotary, eager, n, hq, hkv, head_dim, mt in _GATED,
                    full, int(getattr(cfg, "max_position_embeddings", 0) or 0))

"""A tiny UNTRAINED chat checkpoint to serve in tests and benchmarks (seconds to build, no download,
no training): a ``Qwen3ForCausalLM`` from :func:`treadle.models.build_tiny_model` with the embedded
ChatML character tokenizer."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["save_untrained_checkpoint"]


def save_untrained_checkpoint(path: str | os.PathLike, *, seed: int = 0):
    """Save the checkpoint to ``path`` (``save_pretrained`` of model and tokenizer); returns ``(path, tokenizer)``.

    Its generation config suppresses newline and the pad/unk/role tokens (all an untrained model tends to
    emit, and that servers strip), so replies hold visible characters; ``<|im_end|>`` stays allowed (a
    reply may stop early). Its context (``max_position_embeddings``) holds the longest prompt a role sends
    with the character tokenizer: servers refuse a request longer than the model's context.
    """
    from treadle.models import build_tiny_model, build_tokenizer

    path = Path(path)
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", seed=seed, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None,
                             max_position_embeddings=32768)
    suppress = [tok.convert_tokens_to_ids(t) for t in ("<|pad|>", "<|unk|>", "<|im_start|>", "system", "user",
                                                        "assistant", "\n")]
    model.generation_config.suppress_tokens = suppress
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok

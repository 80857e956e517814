"""Prompt encoding, batched generation and accuracy-by-level for chat causal LMs (any HF checkpoint).

Prompts are rendered with the tokenizer's own chat template and **left**-padded, so that a batch's
completions start at the same column; completions are right-padded after their first EOS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["encode_prompts", "Generation", "generate", "accuracy_by_level"]


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Render each prompt as one user turn + generation prompt and left-pad the batch.

    Args:
        tokenizer: a HF tokenizer with a chat template and a pad token.
        prompts: user messages.

    Returns:
        ``input_ids (B, P)`` int64 and ``attention_mask (B, P)`` int64 (0 on left padding).

    Raises:
        ValueError: empty ``prompts``; the tokenizer has no chat template or no pad token.
    """
    if not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; use a chat model's tokenizer")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer has no pad token; set tokenizer.pad_token first")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


@dataclass
class Generation:
    """Output of :func:`generate` for ``B`` prompts x ``n`` samples (rows ordered prompt-major).

    Attributes:
        prompt_ids: ``(B*n, P)`` int64, left-padded.
        prompt_mask: ``(B*n, P)`` int64.
        completion_ids: ``(B*n, C)`` int64, right-padded with the pad id after the first EOS.
        completion_mask: ``(B*n, C)`` int64, 1 on generated tokens up to and including the first EOS.
        texts: the ``B*n`` decoded completions (special tokens removed).
        prompt_index: ``(B*n,)`` int64, which prompt each row came from.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    prompt_index: torch.Tensor


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, n: int = 1, max_new_tokens: int = 12, do_sample: bool = False,
             temperature: float = 1.0, seed: int | None = None) -> Generation:
    """Generate ``n`` completions per prompt with ``model.generate`` (KV cache, left padding).

    Args:
        n: samples per prompt (G in GRPO).
        do_sample: multinomial sampling at ``temperature`` (no top-k/top-p) if True, else greedy.
        seed: seeds the global torch RNG before sampling (deterministic for a seed).

    Raises:
        ValueError: ``n < 1``, ``max_new_tokens < 1``, ``temperature <= 0`` with sampling; see
            :func:`encode_prompts`.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature!r}")
    ids, mask = encode_prompts(tokenizer, prompts)
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    device = next(model.parameters()).device
    if seed is not None:
        torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **kw)
    model.train(was_training)
    comp = out[:, ids.shape[1]:].cpu()
    is_eos = comp == tokenizer.eos_token_id
    # 1 up to and including the first EOS
    before_eos = (is_eos.cumsum(1) - is_eos.long()) == 0
    cmask = before_eos.long()
    comp = torch.where(before_eos, comp, torch.full_like(comp, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(comp, skip_special_tokens=True)
    index = torch.arange(len(prompts)).repeat_interleave(n)
    return Generation(ids, mask, comp, cmask, texts, index)


def accuracy_by_level(model, tokenizer, problems_by_level: dict[int, list], *, batch_size: int = 128,
                      max_new_tokens: int = 12) -> dict[int, float]:
    """Greedy accuracy per level, answers checked with math-verify.

    Args:
        problems_by_level: level -> list of :class:`treadle.data.Problem`.

    Returns:
        level -> fraction correct in [0, 1].
    """
    from treadle.data.verify import is_correct

    acc = {}
    for level, problems in problems_by_level.items():
        right = 0
        for i in range(0, len(problems), batch_size):
            chunk = problems[i:i + batch_size]
            gen = generate(model, tokenizer, [p.prompt for p in chunk], max_new_tokens=max_new_tokens)
            right += sum(is_correct(t, p.answer) for t, p in zip(gen.texts, chunk))
        acc[level] = right / max(len(problems), 1)
    return acc

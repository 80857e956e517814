"""Prompt + response batches for SCALE Stage I (SFT) and Stage II (gate training), SCALE sec. 4.3.

A training example is a pair of token-id lists: the prompt rendered with the tokenizer's chat template
(one user turn + the generation prompt) and the response (the answer's tokens followed by EOS, or a
completion sampled from the Stage-I model, up to and including its first EOS). Batches are
**right**-padded, so positions are plain ``0..T-1`` as in teacher forcing.

Positions: the response mask marks the positions whose next-token distribution produces a response
token, i.e. ``mask[:, t] = labels[:, t + 1] != -100``; these are the "response positions" over which
the Stage-II objective (normalised top-k entropy) is averaged, and the positions where CE is taken.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ResponseBatch", "problem_pairs", "sampled_pairs", "collate", "iterate_batches"]


@dataclass
class ResponseBatch:
    """A right-padded teacher-forcing batch of ``B`` prompt+response rows of width ``T``.

    Attributes:
        input_ids: ``(B, T)`` int64 (pad id on the right).
        attention_mask: ``(B, T)`` int64, 1 on real tokens.
        labels: ``(B, T)`` int64, the token id on response tokens, -100 elsewhere (HF convention:
            the model shifts them).
        response_mask: ``(B, T)`` bool, True at positions ``t`` whose next token ``t + 1`` is a
            response token (the positions that generate the response).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor

    def to(self, device) -> "ResponseBatch":
        """The same batch on ``device``."""
        return ResponseBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.labels,
                                                      self.response_mask)))


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; SCALE batches render prompts with the chat template")
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("tokenizer needs an eos and a pad token (set tokenizer.pad_token = tokenizer.eos_token)")


def problem_pairs(tokenizer, problems) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, response ids)`` of worked problems: the dataset's answer followed by EOS.

    Args:
        tokenizer: a HF tokenizer with a chat template, an EOS and a pad token.
        problems: :class:`treadle.data.Problem` (``prompt``, ``answer``) or any objects with those
            attributes.

    Raises:
        ValueError: empty ``problems``; a tokenizer without a chat template / EOS / pad token.
    """
    if not problems:
        raise ValueError("problems must be a non-empty list")
    _check_tokenizer(tokenizer)
    return [(_prompt_ids(tokenizer, p.prompt), tokenizer(p.answer, add_special_tokens=False)["input_ids"]
             + [tokenizer.eos_token_id]) for p in problems]


def sampled_pairs(model, tokenizer, problems, *, max_new_tokens: int = 12, temperature: float = 1.0,
                  seed: int = 0, batch_size: int = 64) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, response ids)`` with responses sampled from ``model`` (SCALE sec. 4.3: Stage II
    needs only unlabelled responses, e.g. the Stage-I model's own).

    Completions are multinomial samples at ``temperature`` (seeded), cut after their first EOS (kept);
    a completion that hits ``max_new_tokens`` without EOS is kept as it is.

    Raises:
        ValueError: empty ``problems``, ``max_new_tokens < 1``, ``temperature <= 0``, ``batch_size < 1``.
    """
    from treadle.models.generation import generate

    if not problems:
        raise ValueError("problems must be a non-empty list")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    _check_tokenizer(tokenizer)
    pairs = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        gen = generate(model, tokenizer, [p.prompt for p in chunk], max_new_tokens=max_new_tokens, do_sample=True,
                       temperature=temperature, seed=seed + i)
        for j, p in enumerate(chunk):
            resp = gen.completion_ids[j][gen.completion_mask[j].bool()].tolist()
            pairs.append((_prompt_ids(tokenizer, p.prompt), resp))
    return pairs


def collate(pairs: list[tuple[list[int], list[int]]], pad_token_id: int) -> ResponseBatch:
    """Right-pad ``(prompt ids, response ids)`` pairs into a :class:`ResponseBatch`.

    Raises:
        ValueError: no pairs; an empty prompt or an empty response (no response position).
    """
    if not pairs:
        raise ValueError("pairs must be a non-empty list of (prompt ids, response ids)")
    for i, (p, r) in enumerate(pairs):
        if len(p) == 0:
            raise ValueError(f"example {i} has an empty prompt: the first response token has no position to "
                             f"be predicted from")
        if len(r) == 0:
            raise ValueError(f"example {i} has an empty response: no response positions (SCALE's objective "
                             f"averages over response positions)")
    t = max(len(p) + len(r) for p, r in pairs)
    b = len(pairs)
    ids = torch.full((b, t), int(pad_token_id), dtype=torch.long)
    att = torch.zeros((b, t), dtype=torch.long)
    lab = torch.full((b, t), -100, dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        att[i, :n] = 1
        lab[i, len(p):n] = torch.tensor(r, dtype=torch.long)
    resp = torch.zeros((b, t), dtype=torch.bool)
    resp[:, :-1] = lab[:, 1:] != -100
    return ResponseBatch(ids, att, lab, resp)


def iterate_batches(pairs, batch_size: int, pad_token_id: int, *, generator: torch.Generator | None = None):
    """Yield :class:`ResponseBatch` es over ``pairs`` in chunks of ``batch_size`` (shuffled with
    ``generator`` when given; one pass = one epoch)."""
    order = (torch.randperm(len(pairs), generator=generator).tolist() if generator is not None
             else list(range(len(pairs))))
    for i in range(0, len(order), batch_size):
        yield collate([pairs[j] for j in order[i:i + batch_size]], pad_token_id)

"""Cheaper supervised steps for the tiny chat LMs: packed batches and a last layer computed only where
the loss looks.

:func:`packed_sft_batch` tokenises a batch of problems in one call and packs the conversations into
rows of a fixed width (first-fit decreasing), with ``position_ids`` restarting at 0 for each one.
Given ``position_ids`` and no ``attention_mask`` (and ``use_cache=False``), transformers' mask builder
(``transformers.masking_utils.find_packed_sequence_indices``) makes the attention block-diagonal, so
each conversation sees only itself: the loss and its gradients equal those of the right-padded batch
(up to float rounding) while the padding drops from about 20% of the tokens to a few percent.

:func:`last_mlp_on_loss_positions` runs the last decoder layer's MLP only at the positions whose
logits enter the loss (about one in ten: the answer and its end token). The last layer's output at a
position feeds only that position's logits, so the loss and every gradient are unchanged; the MLP is
the largest block of a layer, so this removes most of a layer's cost from each step.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["packed_sft_batch", "loss_positions", "last_mlp_on_loss_positions"]


def _tokenise(tokenizer, problems) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids (prompt + answer + ``<|im_end|>``) and labels (-100 on the prompt) per problem."""
    prompts = tokenizer.apply_chat_template([[{"role": "user", "content": p.prompt}] for p in problems],
                                            tokenize=False, add_generation_prompt=True)
    pids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    aids = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    rows = [p + a + [eos] for p, a in zip(pids, aids)]
    labels = [[-100] * len(p) + a + [eos] for p, a in zip(pids, aids)]
    return rows, labels


def packed_sft_batch(tokenizer, problems, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch with several conversations packed into each row.

    Args:
        tokenizer: a chat tokenizer (chat template, pad and eos tokens).
        problems: :class:`treadle.data.Problem` s (``prompt``, ``answer``), at least one.
        width: row width in tokens, >= 1; a conversation longer than ``width`` widens every row to its
            length (conversations are never split).

    Returns:
        ``input_ids (R, W)``, ``labels (R, W)`` (-100 except on answer tokens and their ``<|im_end|>``)
        and ``position_ids (R, W)`` (0, 1, ... within each conversation and again within the padding
        that ends a row), all int64, ``W = max(width, longest conversation)``. Pass them as
        ``model(input_ids=..., labels=..., position_ids=..., use_cache=False)`` with no attention mask.

    Raises:
        ValueError: no problems, or ``width < 1``.
    """
    if not problems:
        raise ValueError("problems must be a non-empty list")
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    rows, labels = _tokenise(tokenizer, problems)
    w = max(width, max(len(r) for r in rows))
    bins: list[list] = []  # [used, [row indices]]
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i])):  # stable: ties keep their order
        for b in bins:
            if b[0] + len(rows[i]) <= w:
                b[0] += len(rows[i])
                b[1].append(i)
                break
        else:
            bins.append([len(rows[i]), [i]])
    ids = torch.full((len(bins), w), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(bins), w), -100, dtype=torch.long)
    pos = torch.empty((len(bins), w), dtype=torch.long)
    for r, (used, members) in enumerate(bins):
        c = 0
        for i in members:
            n = len(rows[i])
            ids[r, c:c + n] = torch.tensor(rows[i])
            lab[r, c:c + n] = torch.tensor(labels[i])
            pos[r, c:c + n] = torch.arange(n)
            c += n
        pos[r, c:] = torch.arange(w - c)
    return ids, lab, pos


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: the positions whose logits enter the causal-LM loss (``labels[:, t + 1] != -100``,
    transformers' shifted loss)."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != -100
    return keep


@contextlib.contextmanager
def last_mlp_on_loss_positions(model, labels: torch.Tensor):
    """Within the block, the last decoder layer's MLP of ``model`` (a ``*ForCausalLM`` with
    ``model.model.layers[i].mlp``) runs only at :func:`loss_positions` ``(labels)`` and outputs 0
    elsewhere. Exact for the loss and all gradients (only the discarded logits change).

    Raises:
        TypeError: ``model`` has no ``model.layers[-1].mlp``.
    """
    try:
        mlp = model.model.layers[-1].mlp
    except (AttributeError, IndexError, TypeError):
        raise TypeError(f"{type(model).__name__} has no model.layers[-1].mlp (a decoder-only HF causal LM)") from None
    keep = loss_positions(labels)
    full = mlp.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape)
        out[keep] = full(x[keep])
        return out

    mlp.forward = forward
    try:
        yield
    finally:
        del mlp.forward

"""Trajectories -> training samples that are right at the token level.

- :func:`sft_rows` / :func:`write_sft`: the conversational format TRL's ``SFTTrainer`` takes
  (``{"messages": [...], "tools": [...]}`` per line); ``SFTTrainer`` renders it with the chat template.
- :func:`tokenize_conversation`: the sample with its loss mask, built from the chat template with
  the tools: only the policy's own tokens are trainable (system, user and tool text masked; each
  assistant turn's end-of-turn token trainable, what the template puts after it masked). A turn in
  ``truncated`` (``finish_reason="length"``) or longer than ``max_turn_tokens`` is masked and
  flagged; a conversation over ``max_tokens`` ends at the last whole turn that fits (flagged).
  Each piece is tokenised once and ids are concatenated (a prefix is never re-tokenised). When the
  template renders an earlier prefix differently once later messages exist (Qwen3 drops thinking
  blocks of turns before the last user message), the sample is SPLIT there, not merged: each
  segment holds exactly the text the model saw when it wrote its turns.

Not done: reusing token ids returned by the endpoint (``PolicyOutput.token_ids``) in place of the
re-rendered assistant span.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.rollouts.records import Trajectory

IGNORE = -100


class TokenSample(BaseModel):
    """One training sequence: ids, labels (``-100`` = masked) and what was flagged."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    segment: int = Field(0, description="Index of this segment when a conversation was split.")
    flags: tuple[str, ...] = Field((), description="'truncated_turn:i', 'over_turn_budget:i', 'over_budget:i', "
                                                   "'split_at:i' (message indices).")

    @property
    def trainable(self) -> int:
        return sum(x != IGNORE for x in self.labels)


def sft_rows(trajs: Iterable[Trajectory]) -> list[dict[str, Any]]:
    """``{"messages", "tools"}`` rows (TRL conversational format) of accepted trajectories."""
    return [{"messages": [dict(m) for m in t.messages], "tools": [dict(x) for x in t.tools]}
            for t in trajs if t.accepted]


def write_sft(trajs: Iterable[Trajectory], path: str | Path) -> int:
    """Write :func:`sft_rows` as JSONL (atomically); returns the number of rows."""
    rows = sft_rows(trajs)
    p = Path(path)
    tmp = p.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(p)
    return len(rows)


def tokenize_conversation(messages: Sequence[dict], tools: Sequence[dict] | None, tokenizer: Any, *,
                          truncated: Iterable[int] = (), max_turn_tokens: int | None = None,
                          max_tokens: int | None = None, eot: str | None = None) -> list[TokenSample]:
    """Render ``messages`` with ``tokenizer``'s chat template and ``tools``; one sample per segment.

    Args:
        messages: OpenAI-style chat messages (system / user / assistant with optional tool_calls / tool).
        tools: OpenAI tool specs passed to the template.
        tokenizer: a Hugging Face tokenizer with a chat template.
        truncated: indices of assistant messages cut by ``finish_reason="length"`` (masked, flagged).
        max_turn_tokens / max_tokens: per-turn and per-sample token budgets (None: none).
        eot: end-of-turn string (default: ``tokenizer.eos_token``).

    Raises:
        ValueError: no chat template, no end-of-turn string, no assistant message, bad budgets.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; samples are rendered with the model's chat template")
    eot = eot or tokenizer.eos_token
    if not eot:
        raise ValueError("no end-of-turn string: pass eot= (e.g. '<|im_end|>')")
    for name, v in (("max_turn_tokens", max_turn_tokens), ("max_tokens", max_tokens)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
    idx = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not idx:
        raise ValueError("the conversation has no assistant message: nothing to train on")
    truncated = set(truncated)

    def render(msgs: Sequence[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(list(msgs), tools=list(tools) if tools else None, tokenize=False,
                                             add_generation_prompt=gen)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    out: list[TokenSample] = []
    seen = ""  # text of the current segment so far
    inp: list[int] = []
    lab: list[int] = []
    flags: list[str] = []

    def flush() -> None:
        if inp:
            out.append(TokenSample(input_ids=tuple(inp), labels=tuple(lab), segment=len(out), flags=tuple(flags)))

    for j in idx:
        before = render(messages[:j], True)
        after = render(messages[: j + 1], False)
        if not after.startswith(before):
            raise ValueError(f"chat template: message {j} does not continue the generation prompt")
        if not before.startswith(seen):  # the template re-rendered history differently: split
            flush()
            inp, lab, flags, seen = [], [], [f"split_at:{j}"], ""
        ctx = ids(before[len(seen):])
        span = after[len(before):]
        cut = span.rfind(eot)
        own, tail = (span[: cut + len(eot)], span[cut + len(eot):]) if cut >= 0 else (span, "")
        own_ids, tail_ids = ids(own), ids(tail)
        if max_tokens is not None and len(inp) + len(ctx) + len(own_ids) + len(tail_ids) > max_tokens:
            flags.append(f"over_budget:{j}")
            break
        masked = j in truncated or (max_turn_tokens is not None and len(own_ids) > max_turn_tokens)
        if j in truncated:
            flags.append(f"truncated_turn:{j}")
        elif masked:
            flags.append(f"over_turn_budget:{j}")
        inp += ctx + own_ids + tail_ids
        lab += [IGNORE] * len(ctx) + ([IGNORE] * len(own_ids) if masked else own_ids) + [IGNORE] * len(tail_ids)
        seen = after
    flush()
    return out


def tokenize_trajectory(t: Trajectory, tokenizer: Any, **kw: Any) -> list[TokenSample]:
    """:func:`tokenize_conversation` of a trajectory's accepted messages and tools."""
    return tokenize_conversation(t.messages, t.tools, tokenizer, **kw)

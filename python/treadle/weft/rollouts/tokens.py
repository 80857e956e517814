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
- Where the policy's own token ids are known (``PolicyOutput.token_ids``: the in-process ``hf``
  policy, endpoints that return them), :func:`tokenize_trajectory` passes them as ``policy_ids`` and
  the sample keeps them as the turn's ids (never re-tokenised from text). If the template renders
  that turn as text other than the decoded ids (thinking reformatted, whitespace stripped, a tool
  call re-serialised), the conversation is SPLIT after the turn (``ids_differ:j``): the next segment
  starts from the template's re-rendering, which is what the model saw on its next call.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
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
                                                   "'split_at:i', 'ids_differ:i' (message indices).")

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
                          max_tokens: int | None = None, eot: str | None = None,
                          policy_ids: Mapping[int, Sequence[int]] | None = None) -> list[TokenSample]:
    """Render ``messages`` with ``tokenizer``'s chat template and ``tools``; one sample per segment.

    Args:
        messages: OpenAI-style chat messages (system / user / assistant with optional tool_calls / tool).
        tools: OpenAI tool specs passed to the template.
        tokenizer: a Hugging Face tokenizer with a chat template.
        truncated: indices of assistant messages cut by ``finish_reason="length"`` (masked, flagged).
        max_turn_tokens / max_tokens: per-turn and per-sample token budgets (None: none).
        eot: end-of-turn string (default: ``tokenizer.eos_token``).
        policy_ids: ``{assistant message index: generated token ids}`` where the policy's ids are known:
            kept as that turn's ids. When they do not end with ``eot`` (a cut or a stop string), the
            template's ``eot`` is appended masked (the model did not write it).

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
    policy_ids = {int(k): [int(x) for x in v] for k, v in (policy_ids or {}).items()}
    bad = sorted(k for k in policy_ids if k not in idx)
    if bad:
        raise ValueError(f"policy_ids names message(s) {bad} that are not assistant messages (those are {idx})")

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

    pending_split = False
    for j in idx:
        if pending_split:
            flags, pending_split = [f"split_at:{j}"], False
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
        unwritten = 0  # trailing own ids the model did not generate (the template's eot after a cut)
        differs = False
        if j in policy_ids:
            g = policy_ids[j]
            text_g = tokenizer.decode(g, skip_special_tokens=False)
            if text_g == own:
                own_ids = list(g)
            elif text_g + eot == own:
                own_ids, unwritten = list(g) + ids(eot), len(ids(eot))
            else:  # the template re-renders this turn differently: keep the model's ids, split after it
                own_ids, tail_ids, differs = list(g), [], True
        if max_tokens is not None and len(inp) + len(ctx) + len(own_ids) + len(tail_ids) > max_tokens:
            flags.append(f"over_budget:{j}")
            break
        masked = j in truncated or (max_turn_tokens is not None and len(own_ids) > max_turn_tokens)
        if j in truncated:
            flags.append(f"truncated_turn:{j}")
        elif masked:
            flags.append(f"over_turn_budget:{j}")
        inp += ctx + own_ids + tail_ids
        own_lab = [IGNORE] * len(own_ids) if masked else own_ids[:len(own_ids) - unwritten] + [IGNORE] * unwritten
        lab += [IGNORE] * len(ctx) + own_lab + [IGNORE] * len(tail_ids)
        seen = after
        if differs:
            flags.append(f"ids_differ:{j}")
            flush()
            inp, lab, flags, seen, pending_split = [], [], [], "", True
    flush()
    return out


def policy_turns(t: Trajectory) -> tuple[dict[int, tuple[int, ...]], list[int]]:
    """``({message index: generated token ids}, [indices of turns cut by finish_reason='length'])`` of the
    assistant messages of ``t.messages``, read from the steps of the selected attempts (each step with
    output added one assistant message, in order)."""
    ids: dict[int, tuple[int, ...]] = {}
    cut: list[int] = []
    pos = 1 if t.messages and t.messages[0].get("role") == "system" else 0
    for i in t.selected:
        a = t.attempts[i]
        steps = iter([st for st in a.steps if st.output.finish_reason != "error"])
        for m in a.messages:
            if m.get("role") == "assistant":
                st = next(steps, None)
                if st is not None and st.output.token_ids is not None:
                    ids[pos] = st.output.token_ids
                if st is not None and st.output.finish_reason == "length":
                    cut.append(pos)
            pos += 1
    if pos != len(t.messages):
        raise ValueError(f"trajectory {t.key}: selected attempts hold {pos} messages, the trajectory {len(t.messages)}")
    return ids, cut


def tokenize_trajectory(t: Trajectory, tokenizer: Any, **kw: Any) -> list[TokenSample]:
    """:func:`tokenize_conversation` of a trajectory's accepted messages and tools, with the policy's own
    token ids (where its outputs carry them) and its cut turns (``finish_reason='length'``) masked."""
    ids, cut = policy_turns(t)
    kw.setdefault("policy_ids", ids)
    kw["truncated"] = sorted(set(kw.get("truncated", ())) | set(cut))
    return tokenize_conversation(t.messages, t.tools, tokenizer, **kw)

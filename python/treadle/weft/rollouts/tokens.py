"""Trajectories -> training samples that are exactly the tokens the model saw and produced.

- :func:`sft_rows` / :func:`write_sft`: the conversational format TRL's ``SFTTrainer`` takes
  (``{"messages": [...], "tools": [...]}`` per line); ``SFTTrainer`` renders it with the chat template.
- :func:`tokenize_conversation`: the samples with their loss masks, built from the chat template with the
  tools. A sample's ids are the tokenisation of the template's rendering of the messages it holds (what
  ``apply_chat_template(messages[:k + 1], tools=..., tokenize=True)`` gives), tokenised once as a whole;
  each assistant turn's tokens are located by checking that the tokenisation of its prompt (the rendering
  up to its generation prompt) and of the rendering up to its end are prefixes of the whole
  (:mod:`~treadle.weft.rollouts.token_spans`). Only the policy's own tokens are trainable: system, user
  and tool text masked, each assistant turn's end-of-turn token trainable, what the template puts after it
  masked. This holds for every tokeniser family (byte-level BPE, SentencePiece layouts that prepend ``▁``
  with or without byte fallback, tiktoken-style, WordPiece with added-token templates): no piece is
  tokenised on its own and concatenated.
- Where the template renders an earlier prefix differently once later messages exist (Qwen3 drops the
  thinking of turns before the last user message), the conversation is SPLIT there (``split_at:j``): each
  sample holds exactly the text the model saw when it wrote its turns.
- Where the policy's own token ids are known (``PolicyOutput.token_ids``: the in-process ``hf`` policy,
  endpoints that return them), :func:`tokenize_trajectory` passes them as ``policy_ids`` and the sample
  keeps them as the turn's ids. When they spell the rendered text but the whole rendering tokenises it
  differently, they are kept in place (``ids_kept:j``). When the template renders that turn as other text
  (thinking reformatted, a tool call re-serialised), or the rendering merges a token across the turn's
  start, the sample ends with the model's prompt and its ids (``ids_differ:j`` / ``merged_boundary:j``)
  and the next turn starts a new sample from the template's re-rendering, which is what the model saw on
  its next call.
- Without ids, a turn whose rendering is not the message's text (the template wrote tool calls, thinking
  or whitespace the model may not have written) is trained as rendered and flagged ``text_rewritten:j``;
  ``rewritten="mask"`` keeps such turns as context only, ``rewritten="drop"`` leaves out the samples that
  hold one (an empty sample flagged ``dropped:j`` stays as the record).
- Budgets: a turn in ``truncated`` (``finish_reason="length"``) or longer than ``max_turn_tokens`` is
  masked and flagged; a sample over ``max_tokens`` ends at the last whole turn that fits and names every
  turn it left out (``over_budget:j`` each). No assistant turn leaves the data without a flag saying why:
  a run of turns whose first turn does not fit gives an empty sample (no ids) that carries the flags.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.rollouts.records import Trajectory
from treadle.weft.rollouts.token_spans import Encoder, Rendering, Turn, common_prefix, render_turns

IGNORE = -100
REWRITTEN = ("train", "mask", "drop")


class TokenSample(BaseModel):
    """One training sequence: ids, labels (``-100`` = masked) and what was flagged."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    segment: int = Field(0, description="Index of this sample among the conversation's samples.")
    flags: tuple[str, ...] = Field((), description="'<kind>:i' (i: assistant message index): truncated_turn, "
                                                   "over_turn_budget, over_budget, split_at, ids_differ, "
                                                   "ids_kept, merged_boundary, text_rewritten, dropped.")
    turns: tuple[int, ...] = Field((), description="Indices of the assistant messages whose tokens it holds.")

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
                          policy_ids: Mapping[int, Sequence[int]] | None = None,
                          rewritten: Literal["train", "mask", "drop"] = "train") -> list[TokenSample]:
    """Render ``messages`` with ``tokenizer``'s chat template and ``tools``; one sample per run of turns.

    Args:
        messages: OpenAI-style chat messages (system / user / assistant with optional tool_calls / tool).
        tools: OpenAI tool specs passed to the template.
        tokenizer: a Hugging Face tokenizer with a chat template.
        truncated: indices of assistant messages cut by ``finish_reason="length"`` (masked, flagged).
        max_turn_tokens / max_tokens: per-turn and per-sample token budgets (None: none). A turn of exactly
            ``max_turn_tokens`` tokens and a sample of exactly ``max_tokens`` tokens fit.
        eot: end-of-turn string (default: ``tokenizer.eos_token``).
        policy_ids: ``{assistant message index: generated token ids}`` where the policy's ids are known:
            kept as that turn's ids. When they do not end with ``eot`` (a cut or a stop string), the
            template's ``eot`` tokens are appended masked (the model did not write them).
        rewritten: ``"train"`` (default) trains a turn without ids whose rendering is not its message
            text as rendered, flagged ``text_rewritten:j``; ``"mask"`` keeps it as context only (still
            flagged), so that only turns whose tokens are known to be the model's are trained; ``"drop"``
            leaves out every sample that trains such a turn: what remains of it is an empty sample whose
            flags name its turns (``dropped:j``).

    Returns:
        The samples in conversation order; a sample with no ids is the record of turns left out (its flags
        name them: ``over_budget:j``, ``dropped:j``).

    Raises:
        ValueError: no chat template, no end-of-turn string, no assistant message, bad budgets, policy ids
            that are not token ids of ``tokenizer`` or name non-assistant messages, a template whose
            rendering of a turn does not continue its generation prompt.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; samples are rendered with the model's chat template")
    eot = eot or tokenizer.eos_token
    if not eot:
        raise ValueError("no end-of-turn string: pass eot= (e.g. '<|im_end|>')")
    for name, v in (("max_turn_tokens", max_turn_tokens), ("max_tokens", max_tokens)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
    if rewritten not in REWRITTEN:
        raise ValueError(f"rewritten must be one of {REWRITTEN}, got {rewritten!r}")
    idx = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not idx:
        raise ValueError("the conversation has no assistant message: nothing to train on")
    pids = _policy_ids(policy_ids, idx, len(tokenizer))
    turns = render_turns(messages, tools, tokenizer, idx, eot)
    run = _Run(Encoder(tokenizer, eot), pids, set(truncated), max_turn_tokens, max_tokens, rewritten)
    starts = [n for n, t in enumerate(turns) if t.first] + [len(turns)]
    out: list[TokenSample] = []
    n, lead = 0, []
    while n < len(turns):
        stop = next(s for s in starts if s > n)
        sample, used = run.build(turns[n:stop], lead, len(out))
        out.append(sample)
        n += used
        lead = [f"split_at:{turns[n].j}"] if n < len(turns) else []
    if rewritten == "drop":
        out = [TokenSample(input_ids=(), labels=(), segment=s.segment,
                           flags=s.flags + tuple(f"dropped:{j}" for j in s.turns))
               if any(f.startswith("text_rewritten:") for f in s.flags) else s for s in out]
    return out


def _policy_ids(policy_ids: Mapping[int, Sequence[int]] | None, idx: list[int], vocab: int) -> dict[int, list[int]]:
    try:
        pids = {int(k): [int(x) for x in v] for k, v in (policy_ids or {}).items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"policy_ids must map message indices to token id lists: {err}") from None
    bad = sorted(k for k in pids if k not in idx)
    if bad:
        raise ValueError(f"policy_ids names message(s) {bad} that are not assistant messages (those are {idx})")
    for k, v in pids.items():
        out = [x for x in v if not 0 <= x < vocab]
        if out:
            raise ValueError(f"policy_ids[{k}] holds ids outside the tokenizer's vocabulary (0..{vocab - 1}): "
                             f"{out[:5]}")
    return pids


class _Run:
    """Builds the sample of one run of turns whose renderings continue each other."""

    def __init__(self, enc: Encoder, pids: dict[int, list[int]], truncated: set[int], max_turn: int | None,
                 max_tokens: int | None, rewritten: str) -> None:
        self.enc, self.pids, self.truncated = enc, pids, truncated
        self.max_turn, self.max_tokens, self.rewritten = max_turn, max_tokens, rewritten

    def build(self, turns: Sequence[Turn], lead: list[str], segment: int) -> tuple[TokenSample, int]:
        """The sample of ``turns`` (starting with flags ``lead``) and how many of them it used up (the rest
        start a new sample)."""
        enc = self.enc
        r = enc.rendering(turns[0].text)  # the whole rendering of the run, tokenised once
        ids = r.ids
        inp: list[int] = []
        lab: list[int] = []
        flags, held = list(lead), []
        pos = 0  # ids[:pos] are in inp (with the policy's ids in place of their turns' tokens)

        def done(used: int) -> tuple[TokenSample, int]:
            return TokenSample(input_ids=tuple(inp), labels=tuple(lab), segment=segment, flags=tuple(flags),
                               turns=tuple(held)), used

        def fits(n_more: int) -> bool:
            return self.max_tokens is None or len(inp) + n_more <= self.max_tokens

        for n, t in enumerate(turns):
            k_a, k_t = r.at(t.start), r.at(t.end)  # None: no token boundary there
            k_b = r.own_end(t, k_a, k_t) if k_a is not None and k_t is not None else None
            g = self.pids.get(t.j)
            placed = self._place(r, t, k_a, k_b, g) if g is not None and k_b is not None else None
            if g is not None and placed is None:
                prompt = ids[:k_a] if k_a is not None else enc(t.prompt)  # the model's prompt
                if (k_a if k_a is not None else common_prefix(prompt, ids)) >= pos:
                    # the model's ids cannot stand in the rendering: the sample ends with its prompt and its ids
                    ctx = prompt[pos:]
                    if not fits(len(ctx) + len(g)):
                        flags.append(f"over_budget:{t.j}")
                        return done(n + 1)
                    masked = self._turn_flags(t, len(g), flags)
                    flags.append(f"{'ids_differ' if k_b is not None else 'merged_boundary'}:{t.j}")
                    inp += ctx + g
                    lab += [IGNORE] * len(ctx) + ([IGNORE] * len(g) if masked else list(g))
                    held.append(t.j)
                    return done(n + 1)
            if k_b is not None and (g is None or placed is not None):
                piece, unwritten, kept = placed if placed is not None else (ids[k_a:k_b], 0, False)
            else:  # a token of the rendering spans the turn's start or end: its own tokens found by offsets
                flags.append(f"merged_boundary:{t.j}")
                k_a, k_b = r.own_by_offsets(t, pos, len(ids) if k_t is None else k_t, k_t is not None)
                k_t = k_b if k_t is None else k_t
                piece, unwritten, kept = ids[k_a:k_b], 0, False
            if not fits((k_a - pos) + len(piece) + (k_t - k_b)):
                flags.extend(f"over_budget:{tt.j}" for tt in turns[n:])
                return done(len(turns))
            masked = self._turn_flags(t, len(piece), flags)
            if kept:
                flags.append(f"ids_kept:{t.j}")
            elif g is None and t.rewritten and not masked:
                flags.append(f"text_rewritten:{t.j}")
                masked = self.rewritten != "train"
            own = [IGNORE] * len(piece) if masked else piece[:len(piece) - unwritten] + [IGNORE] * unwritten
            inp += ids[pos:k_a] + piece + ids[k_b:k_t]
            lab += [IGNORE] * (k_a - pos) + own + [IGNORE] * (k_t - k_b)
            held.append(t.j)
            pos = k_t
        return done(len(turns))

    def _turn_flags(self, t: Turn, n_tokens: int, flags: list[str]) -> bool:
        """Flag a cut or over-long turn; True when it is masked for that."""
        if t.j in self.truncated:
            flags.append(f"truncated_turn:{t.j}")
            return True
        if self.max_turn is not None and n_tokens > self.max_turn:
            flags.append(f"over_turn_budget:{t.j}")
            return True
        return False

    def _place(self, r: Rendering, t: Turn, k_a: int, k_b: int, g: list[int]) -> tuple[list[int], int, bool] | None:
        """``(turn ids, trailing ids the model did not write, ids differ from the rendering's)`` with the
        policy's ids ``g`` standing for the rendering's own tokens ``ids[k_a:k_b]``, or None when ``g`` does not
        spell the rendered text. Text is compared with one token of left context, so that decoders that
        drop a leading word-boundary marker treat both sides alike."""
        enc, ids = self.enc, r.ids
        own = ids[k_a:k_b]
        k_e = r.eot_start(t, k_a, k_b)
        eot = ids[k_e:k_b] if k_e is not None else []
        if g == own:
            return g, 0, False
        if k_e is not None and g == ids[k_a:k_e]:
            return g + eot, len(eot), False
        left = ids[k_a - 1:k_a]
        text = enc.decode(left + g)
        if text == enc.decode(left + own):
            return g, 0, True
        if k_e is not None and text == enc.decode(left + ids[k_a:k_e]):
            return g + eot, len(eot), True
        return None


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

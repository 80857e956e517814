"""G candidate segments of one atomic turn, sampled from the same history and the same forked state.

Seed: WEFT 4.1, atomic-turn GRPO. For a :class:`~treadle.weft.rl.gold.TurnStart`, one base session is
created from the turn-start snapshot and forked G times; every candidate starts from the same
prefix token ids (the history rendered with the policy's chat template) and the same state (the
state hash is recorded per candidate and checked equal). The policy writes one assistant step at a
time (Hermes harness: ``<tool_call>`` blocks); calls are dispatched in the candidate's fork and
their results appended as tool messages; a reply without a call ends the segment, which the runtime
then judges with the atomic task's checkpoint (binary verdict ``r``).

Deterministic flags (set even on successful segments): ``repetition`` (a call identical in name and
arguments to an earlier call of the segment: no progress), ``malformed_call`` (a ``<tool_call>``
block that does not parse), ``interface_violation`` (unknown tool or arguments outside the tool's
schema), ``truncated`` (a step hit ``max_new_tokens`` without ending), ``step_cap`` (no reply within
``max_steps`` steps). An environment failure (a tool crash, timeout or infrastructure error, an
exception from the runtime, a checkpoint failing for non-policy reasons) marks the candidate
``env_failure``: it is recorded and left out of the group statistics, never scored as a policy 0.

The segment's tokens are kept exactly as generated (``response_ids``), with ``policy_mask`` 1 on the
policy's own tokens and 0 on tool outputs and chat-template glue: the row a trainer consumes.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.rl.gold import REPLY, NoAtomicTurnsError, TurnStart, tool_text
from treadle.weft.rollouts.harnesses import Harness
from treadle.weft.rollouts.records import CallRecord, ParsedCall, PolicyOutput
from treadle.untrusted import clip

__all__ = ["FLAGS", "ENV_ERROR_KINDS", "Candidate", "TurnGroup", "Sampler", "HFSampler", "ReplaySampler", "sample_segments",
           "sample_groups", "prefix_ids", "GroupSizeError", "NoAtomicTurnsError"]

FLAGS = ("repetition", "malformed_call", "interface_violation", "truncated", "step_cap")
ENV_ERROR_KINDS = frozenset({"crash", "timeout", "infrastructure"})
_INTERFACE = frozenset({"invalid_args", "unknown_tool"})


class GroupSizeError(ValueError):
    """G (candidates per group) is not an int >= 2: a group of one has no baseline."""


class Candidate(BaseModel):
    """One sampled segment of an atomic turn."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int = Field(description="Position in the group (0..G-1).")
    response_ids: tuple[int, ...] = Field(description="Segment token ids after the shared prefix, as generated.")
    policy_mask: tuple[int, ...] = Field(description="1 on the policy's own tokens of this turn, 0 on tool "
                                                     "outputs and template glue; same length as response_ids.")
    steps: tuple[str, ...] = Field(description="Text of each generated step.")
    calls: tuple[CallRecord, ...] = Field(description="Dispatched calls and their outcomes.")
    r: int = Field(description="The atomic task's binary verdict (0 when env_failure is set: not used).")
    reasons: tuple[str, ...] = Field((), description="Checkpoint failure reasons.")
    flags: tuple[str, ...] = Field((), description=f"Deterministic flags, some of {FLAGS}.")
    env_failure: str | None = Field(None, description="Environment failure: the row is left out of the statistics.")
    state_hash: str = Field(description="Hash of the forked state the candidate started from.")


class TurnGroup(BaseModel):
    """G candidates of one atomic turn from one history and one state."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: str = Field(description="Group key: hash of (task id, turn, prefix-token hash, state hash).")
    task_id: str = Field(description="Episode key (task + world).")
    task: str
    template: str
    split: str
    turn: int
    atomic: str
    prefix_ids: tuple[int, ...] = Field(description="Shared prefix (history + request + generation prompt).")
    prefix_hash: str
    state_hash: str
    candidates: tuple[Candidate, ...]

    @property
    def rewards(self) -> list[int]:
        return [c.r for c in self.candidates]


def _h(x: Any) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, default=str).encode()).hexdigest()[:16]


def group_key(task_id: str, turn: int, prefix_hash: str, state_hash: str) -> str:
    """The group key: hash of ``(task id, turn, prefix-token hash, state hash)``."""
    return _h([task_id, turn, prefix_hash, state_hash])


def prefix_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and a generation prompt."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Sampler(Protocol):
    """Writes one assistant step for each row: ``rows`` are ``(turn start, step index, context ids)``;
    returns the generated ids per row (ending with the EOS id unless the budget ran out)."""

    eos_id: int

    def generate(self, rows: Sequence[tuple[TurnStart, int, list[int]]], seed: int) -> list[list[int]]: ...


def left_padded(rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``(len(rows), width)`` int64: each row's context (``rows[i][2]``,
    token ids) right-aligned (left padding with ``pad_id``), as HF ``generate`` expects."""
    width = max(len(r[2]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (_, _, ctx) in enumerate(rows):
        ids[i, width - len(ctx):] = torch.tensor(ctx)
        mask[i, width - len(ctx):] = 1
    return ids, mask


def kv_cache_of(out):
    """The K/V cache a HF forward returned (transformers 5.x: ``out.cache``; 4.57: ``out.past_key_values``)."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def kv_cache_arg(model) -> str:
    """The name ``model.forward`` takes a K/V cache under: ``"cache"`` (transformers 5.x, where
    ``past_key_values`` is deprecated) or ``"past_key_values"`` (4.57)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFSampler:
    """A HF causal LM sampled with ``model.generate`` (left padding, KV cache, multinomial at
    ``temperature``; greedy when ``temperature == 0``); seeded by ``seed`` per call."""

    def __init__(self, model, tokenizer, *, temperature: float = 1.0, max_new_tokens: int = 64):
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.max_new_tokens = float(temperature), max_new_tokens
        self.eos_id = tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, rows, seed):
        torch.manual_seed(seed)
        kw = (dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0) if self.temperature > 0
              else dict(do_sample=False))
        return self._decode(rows, **kw)

    def _decode(self, rows, **generate_kwargs) -> list[list[int]]:
        """HF ``generate`` over the left-padded contexts of ``rows`` (eval mode, the model's device), each
        completion cut after its first EOS."""
        pad = self.tokenizer.pad_token_id
        ids, mask = left_padded(rows, pad)
        was = self.model.training
        self.model.eval()
        dev = next(self.model.parameters()).device  # a policy on a GPU (torchrun --parallel ddp with NCCL)
        ids, mask = ids.to(dev), mask.to(dev)
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                  pad_token_id=pad, eos_token_id=self.eos_id, **generate_kwargs,
                                  **self._shared_prefill(rows, ids, mask))
        self.model.train(was)
        res = []
        for row in out[:, ids.shape[1]:].tolist():
            cut = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            res.append(row[:cut])
        return res


    def _shared_prefill(self, rows, ids: torch.Tensor, mask: torch.Tensor) -> dict:
        """``generate`` keyword arguments with the K/V of every context but its last token computed once per
        distinct context (the G candidates of a group start from one context; the prefill was ~60% of a
        sampling call here) and gathered to the rows (``Cache.batch_select_indices``); ``{}`` when every
        context differs. ``generate`` then runs from the last context token as it would after its own
        prefill: same positions (from the attention mask, as ``generate`` computes them), same masks, same
        sampling draws."""
        first: dict[tuple, int] = {}
        index = [first.setdefault(tuple(r[2]), i) for i, r in enumerate(rows)]
        if len(first) == len(rows) or ids.shape[1] < 2:
            return {}
        uniq = sorted(first.values())
        at = {row: j for j, row in enumerate(uniq)}
        u_ids, u_mask = ids[uniq, :-1], mask[uniq, :-1]
        pos = (u_mask.cumsum(-1) - 1).masked_fill(u_mask == 0, 1)
        out = self.model(input_ids=u_ids, attention_mask=u_mask, position_ids=pos, use_cache=True)
        cache = kv_cache_of(out)
        cache.batch_select_indices(torch.tensor([at[i] for i in index], device=ids.device))
        return {kv_cache_arg(self.model): cache}


class ReplaySampler:
    """The gold calls, one per step, then the closing reply, through the harness (no perturbation):
    every candidate of every group passes (the tests' all-ones groups)."""

    def __init__(self, tokenizer, harness: Harness):
        self.tokenizer, self.harness, self.eos_id = tokenizer, harness, tokenizer.eos_token_id

    def generate(self, rows, seed):
        out = []
        for ts, step, _ in rows:
            gold = ts.atomic.checkpoint.gold_calls or []
            text = self.harness.render([gold[step]]).text if step < len(gold) else REPLY
            out.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_id])
        return out


@dataclass
class _Row:
    ts: TurnStart
    index: int
    sid: str | None
    state_hash: str
    ids: list[int]
    msgs: list[dict]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    outcomes: list = field(default_factory=list)
    seen: set = field(default_factory=set)
    flags: set = field(default_factory=set)
    env_failure: str | None = None
    done: bool = False
    truncated: bool = False


def _append(row: _Row, tokenizer, new_msgs: list[dict]) -> None:
    """Append messages (tool results) and the next generation prompt as masked tokens."""
    before = tokenizer.apply_chat_template(row.msgs, tokenize=False, add_generation_prompt=False)
    row.msgs.extend(new_msgs)
    after = tokenizer.apply_chat_template(row.msgs, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("chat template: tool messages do not continue the conversation")
    eot = tokenizer.eos_token
    glue = before[before.rfind(eot) + len(eot):] if eot in before else ""  # what the template puts after the turn
    ids = tokenizer(glue + after[len(before):], add_special_tokens=False)["input_ids"]
    row.ids += ids
    row.response += ids
    row.mask += [0] * len(ids)


async def _step(rt, row: _Row, gen: list[int], tokenizer, harness: Harness, eos_id: int) -> None:
    ended = bool(gen) and gen[-1] == eos_id
    row.ids += gen
    row.response += gen
    row.mask += [1] * len(gen)
    text = tokenizer.decode(gen[:-1] if ended else gen, skip_special_tokens=True)
    row.steps.append(text)
    out = PolicyOutput(text=text, finish_reason="stop" if ended else "length")
    row.msgs.append(harness.assistant_message(out))
    if not ended:
        row.flags.add("truncated")
        row.truncated = row.done = True
        return
    parsed = harness.parse(out)
    texts, answered = [], []
    for c in parsed.calls:
        sig = (c.name, json.dumps(c.arguments, sort_keys=True, default=str))
        if sig in row.seen:
            row.flags.add("repetition")
        row.seen.add(sig)
        o = await rt.call_tool(row.sid, c.name, c.arguments)
        row.outcomes.append(o)
        kind = o.error_kind.value if o.error_kind else None
        if kind in _INTERFACE:
            row.flags.add("interface_violation")
        if kind in ENV_ERROR_KINDS:
            row.env_failure = f"{c.name}: {kind}: {o.text[:300]}"
        row.calls.append(CallRecord(name=c.name, arguments=c.arguments, ok=o.ok, error_kind=kind, text=o.text[:2000]))
        texts.append(tool_text(o))
        answered.append(c)
    for i, f in enumerate(parsed.failures):
        row.flags.add("malformed_call")
        row.calls.append(CallRecord(name="<unparsed>", arguments={"raw": f.raw}, ok=False, error_kind="unparseable",
                                    text=f.message))
        texts.append(f"Error (unparseable tool call): {f.message}")
        answered.append(ParsedCall(id=f"bad_{i}", name="<unparsed>"))
    if row.env_failure:
        row.done = True
    elif answered:
        _append(row, tokenizer, harness.tool_messages(answered, texts))
    else:
        row.done = True


def _end(rt, r: _Row):
    """(messages, state) after a segment, or None when its session is gone (fork failed or crashed)."""
    if r.sid is None:
        return None
    try:
        return list(r.msgs), rt.snapshot(r.sid)
    except Exception:  # noqa: BLE001  (a crashed session has no state to continue from)
        return None


async def sample_groups(rt, server_hash: str, starts: Sequence[TurnStart], G: int, sampler: Sampler, tokenizer,
                        harness: Harness, *, seed: int, max_steps: int = 4,
                        replay_check: bool = True) -> list[TurnGroup]:
    """Sample one group of ``G`` candidates for each turn start (all rows batched in each model call).

    Args:
        rt: an open :class:`~treadle.weft.runtime.Runtime` with the shop server registered as ``server_hash``.
        starts: the turn starts (history + request + start state).
        G: candidates per group, >= 2.
        sampler: the policy (:class:`HFSampler`, :class:`ReplaySampler`).
        seed: seeds every model call of this batch (same seed, same starts -> same groups).
        max_steps: model calls per candidate.
        replay_check: passed to :meth:`Runtime.verify_turn` (False: the gold is replayed once, not twice;
            the shop is deterministic).

    Returns:
        One :class:`TurnGroup` per start, in order.

    Raises:
        GroupSizeError: ``G`` is not an int >= 2 (before any work).
        ValueError: ``max_steps < 1``; TypeError: a start is not a TurnStart.
    """
    if not isinstance(G, int) or isinstance(G, bool) or G < 2:
        raise GroupSizeError(f"G (candidates per group) must be an int >= 2, got {G!r}: a group of one has no "
                             f"baseline to compare against")
    groups, _ = await sample_segments(rt, server_hash, starts, G, sampler, tokenizer, harness, seed=seed,
                                      max_steps=max_steps, replay_check=replay_check)
    return groups


async def sample_segments(rt, server_hash: str, starts: Sequence[TurnStart], n: int, sampler: Sampler, tokenizer,
                          harness: Harness, *, seed: int, max_steps: int = 4, replay_check: bool = True,
                          keep_ends: bool = False) -> tuple[list[TurnGroup], list[list[tuple]]]:
    """:func:`sample_groups` without the group-size check (``n >= 1`` segments per start: a trajectory
    rollout continues each candidate alone). With ``keep_ends``, also returns per start and candidate
    ``(messages after the segment, state snapshot after it)`` (None when its session is gone)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n (segments per start) must be an int >= 1, got {n!r}")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    for ts in starts:
        if not isinstance(ts, TurnStart):
            raise TypeError(f"starts must be TurnStart objects, got {type(ts).__name__}")
    G = n
    ends: list[list[tuple]] = []
    rows: list[_Row] = []
    bases: list[str] = []
    heads: list[tuple[list[int], str]] = []
    try:
        for ts in starts:
            base = await rt.create_session(server_hash, ts.snapshot)
            bases.append(base)
            pids = prefix_ids(tokenizer, ts.messages)
            heads.append((pids, _h(pids)))
            for g in range(G):
                sid, state_hash, failure = None, "", None
                try:
                    sid = await rt.fork(base)
                    state_hash = rt.snapshot(sid).digest
                except Exception as err:  # noqa: BLE001  (an environment failure of this candidate)
                    failure = clip(f"fork: {type(err).__name__}: {err}", 500)
                rows.append(_Row(ts, g, sid, state_hash, list(pids), list(ts.messages), env_failure=failure,
                                 done=failure is not None))
        for step in range(max_steps):
            active = [r for r in rows if not r.done]
            if not active:
                break
            gens = sampler.generate([(r.ts, step, r.ids) for r in active], seed * 1_000_003 + step)
            for r, gen in zip(active, gens):
                try:
                    await _step(rt, r, gen, tokenizer, harness, sampler.eos_id)
                except Exception as err:  # noqa: BLE001  (the environment failed, not the policy)
                    r.env_failure, r.done = clip(f"{type(err).__name__}: {err}", 500), True
        groups = []
        for i, ts in enumerate(starts):
            cands = []
            for r in rows[i * G:(i + 1) * G]:
                if not r.done:
                    r.flags.add("step_cap")
                reasons: tuple[str, ...] = ()
                rr = 0
                if r.env_failure is None:
                    try:
                        v = await rt.verify_turn(r.sid, ts.snapshot, ts.atomic.checkpoint, r.outcomes,
                                                 replay_check=replay_check)
                        reasons = tuple(x.value for x in v.reasons)
                        if v.r == 0 and not v.policy_failure:
                            r.env_failure = "checkpoint: " + "; ".join(v.details)[:500]
                        rr = 0 if r.truncated else v.r
                    except Exception as err:  # noqa: BLE001
                        r.env_failure = clip(f"verify: {type(err).__name__}: {err}", 500)
                if r.env_failure is not None:
                    rr = 0
                cands.append(Candidate(index=r.index, response_ids=tuple(r.response), policy_mask=tuple(r.mask),
                                       steps=tuple(r.steps), calls=tuple(r.calls), r=rr, reasons=reasons,
                                       flags=tuple(f for f in FLAGS if f in r.flags), env_failure=r.env_failure,
                                       state_hash=r.state_hash))
            pids, ph = heads[i]
            ok_states = {c.state_hash for c in cands if c.env_failure is None}
            sh = next(iter(ok_states)) if len(ok_states) == 1 else ts.snapshot.digest
            if keep_ends:
                ends.append([_end(rt, r) for r in rows[i * G:(i + 1) * G]])
            groups.append(TurnGroup(key=group_key(ts.episode.key, ts.turn, ph, sh), task_id=ts.episode.key,
                                    task=ts.episode.task.name, template=ts.episode.template, split=ts.episode.split,
                                    turn=ts.turn, atomic=ts.atomic.name, prefix_ids=tuple(pids), prefix_hash=ph,
                                    state_hash=sh, candidates=tuple(cands)))
        return groups, ends
    finally:
        for r in rows:
            if r.sid is not None:
                try:
                    await rt.close(r.sid)
                except Exception:  # noqa: BLE001,S110  (closing a crashed fork)
                    pass
        for b in bases:
            try:
                await rt.close(b)
            except Exception:  # noqa: BLE001,S110
                pass

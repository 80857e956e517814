"""Frozen records of rollouts: policy outputs, parsed calls, steps, turn attempts, trajectories.

Every record is a pydantic model with ``extra="forbid"``; a trajectory is one JSONL line of a run
folder and carries the labels a reader needs (view, harness + parser + tolerance, policy +
perturbations, method, k) without looking anything up.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.llm.records import ToolCall as NativeCall

SCHEMA_VERSION = 1


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyOutput(_Record):
    """What a policy produced for one step (one model call), before the harness parses it."""

    text: str = Field("", description="Generated text ('' when the model only called tools natively).")
    tool_calls: tuple[NativeCall, ...] = Field((), description="Native tool calls (native harness only).")
    finish_reason: str = Field("stop", description="'stop', 'length', 'tool_calls', or 'error' (no output).")
    token_ids: tuple[int, ...] | None = Field(None, description="Generated token ids when the policy knows them.")
    perturbations: tuple[str, ...] = Field((), description="Replay policy: perturbations applied in this step.")
    error: str | None = Field(None, description="Endpoint failure (kind: message) when no output came back.")


class ParsedCall(_Record):
    """One call the harness parser found: id (echoed in the tool message), tool name and arguments."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ParseFailure(_Record):
    """A span the parser recognised as a call attempt but could not parse (a policy error)."""

    raw: str
    message: str
    id: str = Field("", description="Native tool-call id of the failed call ('' for text harnesses).")


class ParsedStep(_Record):
    """The parser's reading of one policy output: calls to dispatch, failures, and the visible reply."""

    calls: tuple[ParsedCall, ...] = ()
    failures: tuple[ParseFailure, ...] = ()
    reply: str = Field("", description="Text addressed to the user (final answer / question), may be ''.")


class CallRecord(_Record):
    """One dispatched call and its outcome (``error_kind`` from the runtime, or ``unparseable``)."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    ok: bool
    error_kind: str | None = None
    text: str = ""


class Step(_Record):
    """One model call inside a turn and what came of it."""

    output: PolicyOutput
    calls: tuple[CallRecord, ...] = ()
    parse_failures: tuple[ParseFailure, ...] = ()


class TurnAttempt(_Record):
    """One attempt at one atomic task, from its start state."""

    atomic: str = Field(description="Atomic task (checkpoint) name.")
    attempt: int = Field(description="0-based attempt index at this turn.")
    messages: tuple[dict[str, Any], ...] = Field(description="Messages this attempt added (user, assistant, tool).")
    steps: tuple[Step, ...]
    r: int = Field(description="Checkpoint verdict (1 pass, 0 fail).")
    reasons: tuple[str, ...] = ()
    stalled: bool = Field(False, description="Hit the step or exchange cap without completing.")
    policy_calls: int = Field(description="Model calls spent in this attempt.")
    tools: tuple[str, ...] | None = Field(None, description="Tool names offered on this turn (None: every tool).")
    truncated: bool = Field(False, description="A step ended with finish_reason='length'.")


class Trajectory(_Record):
    """One rollout of one task with one method; ``messages`` is the SFT conversation (TRL chat format)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    key: str = Field(description="Run-folder key: hash of task key, method, k, seed and component configs.")
    task: str
    task_key: str
    env: str
    method: Literal["prefix", "end_to_end"]
    k: int
    seed: int
    view: dict[str, Any] = Field(description="{name, args}.")
    harness: dict[str, Any] = Field(description="{name, parser, tolerance}.")
    policy: dict[str, Any] = Field(description="{name, args} (replay: perturbation rates).")
    tools: tuple[dict[str, Any], ...] = Field(description="OpenAI tool specs given to the model: every tool offered "
                                                          "on some turn (per-turn offers: ``attempts[i].tools``).")
    messages: tuple[dict[str, Any], ...] = Field(description="Accepted conversation (system, user, assistant, tool).")
    attempts: tuple[TurnAttempt, ...] = Field(description="Every attempt, accepted or discarded, in order.")
    selected: tuple[int, ...] = Field(description="Indices into ``attempts`` of the path ``messages`` holds.")
    rewards: tuple[int, ...] = Field(description="Checkpoint verdict per atomic task of the accepted path.")
    reward: float = Field(description="R = mean_k r_k of the accepted path.")
    accepted: bool = Field(description="Every checkpoint passed (a usable SFT trajectory).")
    policy_calls: int
    failure: str | None = Field(None, description="Infrastructure/endpoint failure that ended the rollout.")

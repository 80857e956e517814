"""The execute layer: one turn, one prefix-preserving rollout, one end-to-end rollout (no files).

Seed: WEFT 4.1, prefix-preserving rejection sampling. The unit of rejection is one atomic-task
turn. Turns run in dependency order. Each attempt runs in a fork of the turn-start session (a
copy of the runtime's state at the turn start, no replay of earlier calls); an accepted attempt's
session and messages become the new prefix, a failed one is closed and discarded, and only that
turn is re-sampled, at most ``k`` times. End-to-end rejection sampling (for comparison) reruns
the whole task from the initial snapshot up to ``k`` times and keeps a run only if every
checkpoint passes. An attempt that ends on a policy-endpoint failure (:func:`endpoint_failure`) is no
sample of the policy: either method stops there and returns the trajectory with ``failure`` set, so
the batch redoes it on a rerun.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from treadle.weft.rollouts.harnesses import Harness, harness_args, harness_label, openai_tools
from treadle.weft.rollouts.policies import Policy, PolicyContext
from treadle.weft.rollouts.records import CallRecord, ParsedCall, Step, Trajectory, TurnAttempt
from treadle.weft.rollouts.sessions import Env, SessionGroup
from treadle.weft.rollouts.tasks import AtomicTask, RolloutTask
from treadle.weft.rollouts.views import View
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.state import Snapshot

__all__ = ["Env", "Setup", "METHODS", "ROLLOUTS", "run_turn", "prefix_rollout", "end_to_end_rollout",
           "system_message", "trajectory_key", "BASE_INSTRUCTIONS", "endpoint_failure", "task_tools"]

Method = Literal["prefix", "end_to_end"]
METHODS: tuple[Method, ...] = ("prefix", "end_to_end")



@dataclass(frozen=True)
class Setup:
    """Already-built components of a rollout."""

    view: View
    harness: Harness
    policy: Policy
    max_steps: int = 8
    seed: int = 0


BASE_INSTRUCTIONS = "You are a support agent. Use the tools to do what the user asks."


def system_message(env: Env, harness: Harness, tools: Sequence[dict] | None = None) -> dict[str, Any]:
    """The system message: the harness's own system prompt when it has one (OpenClaw), else the task's
    instructions plus the harness's calling instructions (the tools themselves go to the chat template).
    ``tools``: the runtime tool definitions offered at the start (default: every tool of ``env``)."""
    tools = env.all_tools if tools is None else tools
    own = getattr(harness, "system_prompt", None)
    if callable(own):
        return {"role": "system", "content": own(BASE_INSTRUCTIONS, tools)}
    extra = harness.instructions(tools)
    return {"role": "system", "content": BASE_INSTRUCTIONS + ("\n" + extra if extra else "")}


async def _maybe_await(x: Any) -> Any:
    """A view hook's result: views may be sync (rule-based) or async (an LLM user simulator)."""
    return await x if inspect.isawaitable(x) else x


async def run_turn(rt: Runtime, ws: SessionGroup, start: list[Snapshot], env: Env, task: RolloutTask,
                   atomic: AtomicTask, index: int, attempt: int, history: Sequence[dict], s: Setup) -> TurnAttempt:
    """Run one attempt of one atomic task in the sessions ``ws`` (whose states are ``start``) and judge it.

    The model is offered the turn's tools (``atomic.tools``; None: all), and so are the sessions: a call
    to a withheld tool is answered ``unknown_tool`` by the runtime."""
    ws.set_available_tools(atomic.tools)
    msgs: list[dict[str, Any]] = list(await _maybe_await(s.view.turn_start(task, atomic, index)))
    steps: list[Step] = []
    outcomes: list[tuple[int, Any]] = []
    tools = openai_tools(env.offered(atomic.tools))
    exchange, done, verdict, truncated, ended, capped = 0, False, None, False, False, False
    for step in range(s.max_steps):
        ctx = PolicyContext(task=task, atomic=atomic, index=index, attempt=attempt, step=step, seed=s.seed)
        out = await s.policy.act([*history, *msgs], tools, s.harness, ctx)
        if out.finish_reason == "error":
            steps.append(Step(output=out))
            ended = True
            break
        msgs.append(s.harness.assistant_message(out))
        if out.finish_reason == "length":  # cut turn: masked and flagged, nothing dispatched
            steps.append(Step(output=out))
            truncated = ended = True
            break
        parsed = s.harness.parse(out)
        records, texts, answered = [], [], []
        for c in parsed.calls:
            where, o = await ws.call_tool(c.name, c.arguments)
            outcomes.append((where, o))
            records.append(CallRecord(name=c.name, arguments=c.arguments, ok=o.ok,
                                      error_kind=o.error_kind.value if o.error_kind else None, text=o.text[:2000]))
            texts.append(o.text if o.ok else f"Error ({o.error_kind.value}): {o.text}")
            answered.append(c)
        for i, f in enumerate(parsed.failures):
            records.append(CallRecord(name="<unparsed>", arguments={"raw": f.raw}, ok=False,
                                      error_kind="unparseable", text=f.message))
            texts.append(f"Error (unparseable tool call): {f.message}")
            answered.append(ParsedCall(id=f.id or f"bad_{i}", name="<unparsed>"))
        steps.append(Step(output=out, calls=tuple(records), parse_failures=parsed.failures))
        if answered:
            msgs.extend(s.harness.tool_messages(answered, texts))
            continue
        verdict = await ws.verify_turn(start, atomic.checkpoint, outcomes)
        done = verdict.r == 1
        follow = await _maybe_await(s.view.after_reply(task, atomic, parsed.reply, done, exchange))
        if follow is None:
            ended = True
            capped = not done and exchange + 1 >= getattr(s.view, "max_exchanges", float("inf"))
            break
        msgs.extend(follow)
        exchange += 1
    if verdict is None or not ended:
        verdict = await ws.verify_turn(start, atomic.checkpoint, outcomes)
    r = verdict.r if not truncated and not (steps and steps[-1].output.finish_reason == "error") else 0
    reasons = tuple(x.value for x in verdict.reasons)
    if steps and steps[-1].output.finish_reason == "error":
        reasons += ("policy_endpoint_error",)
    if truncated:
        reasons += ("finish_reason_length",)
    return TurnAttempt(atomic=atomic.name, attempt=attempt, messages=tuple(msgs), steps=tuple(steps), r=r,
                       reasons=reasons, stalled=capped or not ended, policy_calls=len(steps), truncated=truncated,
                       tools=None if atomic.tools is None else tuple(t["name"] for t in env.offered(atomic.tools)))


def trajectory_key(task: RolloutTask, method: str, k: int, s: Setup) -> str:
    doc = {"task": task.key, "method": method, "k": k, "seed": s.seed, "max_steps": s.max_steps,
           "view": [s.view.name, s.view.args()],
           "harness": [s.harness.name, harness_args(s.harness)] if harness_args(s.harness) else s.harness.name, "policy": [s.policy.name, s.policy.args()]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _trajectory(task, env, method, k, s, messages, attempts, selected, rewards, accepted, failure=None) -> Trajectory:
    return Trajectory(key=trajectory_key(task, method, k, s), task=task.name, task_key=task.key, env=task.env,
                      method=method, k=k, seed=s.seed, view={"name": s.view.name, "args": s.view.args()},
                      harness=harness_label(s.harness), policy={"name": s.policy.name, "args": s.policy.args()},
                      tools=tuple(openai_tools(task_tools(env, task))), messages=tuple(messages),
                      attempts=tuple(attempts),
                      selected=tuple(selected),
                      rewards=tuple(rewards), reward=trajectory_reward_of(rewards, len(task.atomic)),
                      accepted=accepted, policy_calls=sum(a.policy_calls for a in attempts), failure=failure)


def task_tools(env: Env, task: RolloutTask) -> tuple[dict[str, Any], ...]:
    """Every tool of ``env`` offered on some turn of ``task`` (runtime form, the environment's order)."""
    if not task.atomic or any(a.tools is None for a in task.atomic):
        return env.all_tools
    return env.offered(sorted({n for a in task.atomic for n in a.tools}))


def _first_offer(env: Env, order: Sequence[AtomicTask]) -> tuple[dict[str, Any], ...]:
    return env.offered(order[0].tools) if order else env.all_tools


def endpoint_failure(ta: TurnAttempt) -> str | None:
    """Why the attempt ended on a policy-endpoint failure (timeout, HTTP error, garbage reply), else None.
    Such an attempt is no sample of the policy: the rollout stops and is recorded as failed, and a rerun
    of the batch redoes it."""
    if ta.steps and ta.steps[-1].output.finish_reason == "error":
        return f"policy endpoint failed on {ta.atomic} (attempt {ta.attempt}): {ta.steps[-1].output.error}"[:1000]
    return None


def trajectory_reward_of(rewards: Sequence[int], n: int) -> float:
    """``R = mean_k r_k`` over all ``n`` atomic tasks (a turn never reached counts 0)."""
    return float(sum(rewards)) / n if n else 0.0


async def prefix_rollout(rt: Runtime, env: Env, task: RolloutTask, k: int, s: Setup) -> Trajectory:
    """Prefix-preserving rejection sampling of one task (at most ``k`` attempts per turn)."""
    order = task.ordered()
    history: list[dict[str, Any]] = [system_message(env, s.harness, _first_offer(env, order))]
    attempts: list[TurnAttempt] = []
    rewards: list[int] = []
    selected: list[int] = []
    failure = None
    ws = await SessionGroup.open(rt, env)
    try:
        for idx, atomic in enumerate(order):
            start = ws.snapshot()
            for a in range(k):
                trial = await ws.fork()
                try:
                    ta = await run_turn(rt, trial, start, env, task, atomic, idx, a, history, s)
                except BaseException:
                    await trial.close()
                    raise
                attempts.append(ta)
                failure = endpoint_failure(ta)
                if failure is not None:  # not a policy sample: no retry on it, the rollout is redone later
                    await trial.close()
                    break
                if ta.r == 1:
                    selected.append(len(attempts) - 1)
                    await ws.close()
                    ws = trial
                    history.extend(ta.messages)
                    break
                await trial.close()
            else:
                rewards.append(0)
                break
            if failure is not None:
                rewards.append(0)
                break
            rewards.append(1)
    finally:
        await ws.close()
    ok = failure is None and len(rewards) == len(order) and all(rewards)
    return _trajectory(task, env, "prefix", k, s, history, attempts, selected, rewards, ok, failure=failure)


async def end_to_end_rollout(rt: Runtime, env: Env, task: RolloutTask, k: int, s: Setup) -> Trajectory:
    """End-to-end rejection sampling: up to ``k`` whole runs from the initial snapshot; keep the first
    whose checkpoints all pass (else the last run, not accepted)."""
    order = task.ordered()
    attempts: list[TurnAttempt] = []
    history: list[dict[str, Any]] = []
    rewards: list[int] = []
    failure = None
    for a in range(k):
        history = [system_message(env, s.harness, _first_offer(env, order))]
        rewards = []
        ws = await SessionGroup.open(rt, env)
        try:
            for idx, atomic in enumerate(order):
                ta = await run_turn(rt, ws, ws.snapshot(), env, task, atomic, idx, a, history, s)
                attempts.append(ta)
                history.extend(ta.messages)
                rewards.append(ta.r)
                failure = endpoint_failure(ta)
                if failure is not None:
                    break
        finally:
            await ws.close()
        if failure is not None or all(rewards):
            break
    selected = list(range(len(attempts) - len(rewards), len(attempts)))
    return _trajectory(task, env, "end_to_end", k, s, history, attempts, selected, rewards,
                       failure is None and bool(rewards) and all(rewards), failure=failure)


ROLLOUTS = {"prefix": prefix_rollout, "end_to_end": end_to_end_rollout}

"""Per-task rubrics and the rubric-guided LLM judge (seed: WEFT 5.1, verifier generation and RL task filtering).

- :func:`rubric_of` writes a task's rubric deterministically from the task itself (its request, its
  reference calls and whether they may be left out): criteria a grader checks on a transcript, weighted.
  It is built from the certified task, never from a trajectory, so it is the same for every rollout.
- :func:`judge` asks an LLM role (``treadle.llm``, any OpenAI-compatible endpoint) to grade one transcript
  against a rubric, *without* the executable verdict: the answer must be ``{"scores": [one number in
  [0, 1] per criterion], "reason": str}``; the score is the weighted mean. A failed call or an answer of
  any other shape is a recorded :class:`JudgeScore` with ``score=None`` and the problem, never an
  exception.
- :func:`pilot_scores` judges pilot rollouts (``(task, transcript, executable r)``) and returns the
  ``{task: (judge scores, executable scores)}`` that :func:`~treadle.weft.evolve.filtering.filter_tasks`
  takes; a task with a malformed judge answer is dropped there with its reason ("malformed scores"), the
  other tasks are filtered normally. :func:`pilots_of` reads the pilots out of rollout trajectories.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.rollouts.tasks import AtomicTask
from treadle.untrusted import loads_json

__all__ = ["Criterion", "JudgeScore", "Pilot", "Rubric", "atomic_tasks_of", "judge", "pilot_scores", "pilots_of",
           "rubric_of"]


class Criterion(BaseModel):
    """One thing the grader checks, with its weight (> 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    text: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0)


class Rubric(BaseModel):
    """The rubric of one atomic task."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    task: str
    request: str
    criteria: tuple[Criterion, ...] = Field(min_length=1)


def rubric_of(task: AtomicTask) -> Rubric:
    """The task's rubric, from its request and reference (gold) calls.

    Criteria: the request is done as asked (weight 2); per reference call, that the agent makes it (or one with
    the same effect) with those arguments; with no reference call, that the agent changes nothing and says
    why (a turn to decline or ask); always, that the reply to the user reports what was done truthfully.

    Raises:
        TypeError: ``task`` is not an :class:`AtomicTask`.
    """
    if not isinstance(task, AtomicTask):
        raise TypeError(f"task must be an AtomicTask, got {type(task).__name__}")
    items = [Criterion(text=f"The agent does what the user asked, exactly as asked: {task.request!r}", weight=2.0)]
    gold = list(task.checkpoint.gold_calls or [])
    for c in gold:
        args = ", ".join(f"{k}={v!r}" for k, v in c.arguments.items())
        items.append(Criterion(text=f"The agent calls {c.name}({args}), or a call with the same effect, "
                                    "and it succeeds."))
    if not gold:
        items.append(Criterion(text="The agent makes no tool call that changes anything, and tells the user why it "
                                    "cannot act yet (or asks for what is missing)."))
    items.append(Criterion(text="The reply to the user reports what was done truthfully: no claimed action that the "
                                "tool results do not show, no invented values."))
    return Rubric(task=task.name, request=task.request, criteria=tuple(items))


class JudgeScore(BaseModel):
    """The judge's grade of one transcript: ``score`` (weighted mean in [0, 1], None when no usable answer),
    per-criterion ``scores``, its ``reason``, the raw ``answer`` and the ``error`` when unusable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    task: str
    score: float | None
    scores: tuple[float, ...] = ()
    reason: str = ""
    answer: str = ""
    error: str | None = None


_SYSTEM = ("You grade one transcript of a tool-using assistant against a rubric. Judge only what the transcript "
           "shows (tool calls, tool results, replies). Answer with one JSON object "
           '{"scores": [one number from 0 to 1 per rubric criterion, in order], "reason": "<one sentence>"}.')


def _transcript(messages: Sequence[dict]) -> list[dict[str, Any]]:
    """The transcript as the judge sees it: roles, texts and tool calls; system text left out."""
    out = []
    for m in messages:
        if m.get("role") == "system":
            continue
        item: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("tool_calls"):
            item["tool_calls"] = [{"name": (c.get("function") or {}).get("name"),
                                   "arguments": (c.get("function") or {}).get("arguments")} for c in m["tool_calls"]]
        out.append(item)
    return out


def _parse(text: str, n: int) -> tuple[list[float], str]:
    doc = loads_json(re.sub(r"^```(?:json)?|```$", "", text.strip()).strip(), duplicates=True)
    if not isinstance(doc, dict) or not isinstance(doc.get("scores"), list):
        raise ValueError('expected a JSON object with a "scores" list')
    scores = doc["scores"]
    if len(scores) != n:
        raise ValueError(f"{len(scores)} scores for {n} criteria")
    for i, v in enumerate(scores):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
            raise ValueError(f"score #{i} is {v!r}; expected a number in [0, 1]")
    return [float(v) for v in scores], str(doc.get("reason", ""))[:500]


async def judge(client: Any, rubric: Rubric, messages: Sequence[dict], *, role: str = "judge",
                sample_index: int = 0) -> JudgeScore:
    """Grade one transcript (chat ``messages`` of a rollout turn) against ``rubric`` with the LLM ``role``.

    The judge never sees the executable verdict. Returns a :class:`JudgeScore`; an endpoint failure or an
    answer that is not the JSON asked for gives ``score=None`` with ``error`` set (recorded, not raised).

    Raises:
        TypeError: ``rubric`` is not a :class:`Rubric`; ValueError: ``role`` is not in the client's config
            (before any call).
    """
    from treadle.llm import LLMCallError

    if not isinstance(rubric, Rubric):
        raise TypeError(f"rubric must be a Rubric, got {type(rubric).__name__}")
    roles = getattr(getattr(client, "config", None), "roles", None)
    if roles is not None and role not in roles:
        raise ValueError(f"role {role!r} is not in the LLM config; expected one of {sorted(roles)}")
    body = {"request": rubric.request, "rubric": [c.text for c in rubric.criteria], "transcript": _transcript(messages)}
    prompt = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": json.dumps(body, default=str)}]
    try:
        r = await client.chat(prompt, role=role, tag="weft-judge", sample_index=sample_index)
    except LLMCallError as err:
        return JudgeScore(task=rubric.task, score=None, error=f"judge call failed: {err.failure.kind.value}: "
                                                              f"{err.failure.message}"[:500])
    try:
        scores, reason = _parse(r.text, len(rubric.criteria))
    except (ValueError, TypeError) as err:
        return JudgeScore(task=rubric.task, score=None, answer=r.text[:2000],
                          error=f"malformed judge answer: {str(err).splitlines()[0][:200]}")
    w = [c.weight for c in rubric.criteria]
    score = sum(s * x for s, x in zip(scores, w)) / sum(w)
    return JudgeScore(task=rubric.task, score=score, scores=tuple(scores), reason=reason, answer=r.text[:2000])


class Pilot(BaseModel):
    """One pilot rollout of one atomic task: its transcript and its executable verdict ``r``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    task: str
    messages: tuple[dict[str, Any], ...]
    r: float = Field(ge=0, le=1)


def pilots_of(trajectories: Iterable[Any]) -> list[Pilot]:
    """Every attempt of every rollout trajectory as a pilot (discarded attempts too: the filter needs failures);
    attempts that ended on an endpoint failure are left out (no sample of the policy)."""
    from treadle.weft.rollouts.rollout import endpoint_failure

    return [Pilot(task=a.atomic, messages=a.messages, r=a.r) for t in trajectories for a in t.attempts
            if endpoint_failure(a) is None]


def atomic_tasks_of(trajectories: Iterable[Any]) -> dict[str, AtomicTask]:
    """``{atomic task name: AtomicTask}`` of the tasks the trajectories ran, rebuilt from their environment names:
    ``shop`` (:func:`~treadle.weft.rollouts.tasks.from_shop`) and ``bfcl:<category>:<entry id>``
    (:func:`~treadle.weft.rollouts.bfcl_tasks.from_bfcl`); other environments' tasks are not known here (left out).

    Raises:
        ValueError: a BFCL entry that no longer exists; ModuleNotFoundError: ``bfcl-eval`` missing for a BFCL run.
    """
    from treadle.weft.rollouts.tasks import from_shop

    out: dict[str, AtomicTask] = {}
    bfcl: dict[str, set[str]] = {}
    envs = {t.env for t in trajectories}
    if "shop" in envs:
        out.update({a.name: a for t in from_shop() for a in t.atomic})
    for env in envs:
        if env.startswith("bfcl:"):
            category, _, entry = env[len("bfcl:"):].partition(":")
            bfcl.setdefault(category, set()).add(entry)
    if bfcl:
        from treadle.weft.rollouts.bfcl_tasks import from_bfcl

        for category, ids in sorted(bfcl.items()):
            out.update({a.name: a for t in from_bfcl(category, ids=sorted(ids)) for a in t.atomic})
    return out


async def pilot_scores(client: Any, rubrics: Iterable[Rubric], pilots: Iterable[Pilot], *, role: str = "judge"
                       ) -> tuple[dict[str, tuple[list[float | None], list[float]]], list[JudgeScore]]:
    """Judge every pilot with its task's rubric.

    Returns:
        ``({task: (judge scores, executable scores)}, every JudgeScore)``: the first is what
        :func:`~treadle.weft.evolve.filtering.filter_tasks` takes (a None judge score there drops the task as
        "malformed scores"); the second keeps each answer and error for the report.

    Raises:
        ValueError: a pilot's task has no rubric (before any call).
    """
    by_task = {r.task: r for r in rubrics}
    pilots = list(pilots)
    missing = sorted({p.task for p in pilots} - set(by_task))
    if missing:
        raise ValueError(f"no rubric for task(s) {missing}")
    out: dict[str, tuple[list[float | None], list[float]]] = {}
    graded: list[JudgeScore] = []
    seen: dict[str, int] = {}
    for p in pilots:
        k = seen[p.task] = seen.get(p.task, -1) + 1
        js = await judge(client, by_task[p.task], p.messages, role=role, sample_index=k)
        graded.append(js)
        judged, executable = out.setdefault(p.task, ([], []))
        judged.append(js.score)
        executable.append(float(p.r))
    return out, graded

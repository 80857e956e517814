"""LLM roles of the RSI loop besides the Director and solver (:mod:`treadle.rsi.agents`): the generator
(Extend: rewrite a task so that it needs a skill), the Meta agent's online skill induction (a solver
failure on a valid task -> a reusable construction skill, never the answer), and the paraphrase judge of
decontamination. Every call goes through :class:`treadle.llm.LLMClient` (content-hash cache and ledger);
malformed output and endpoint failures come back as :class:`treadle.llm.Failure`, never raised.

Ledger tags are ``rsi:<round>:<operator>:<seed id>`` (:func:`tag`), so the per-operator / per-seed
token and money ledger is rebuilt from the model-call ledger (:func:`cost_from_llm_ledger`).
"""
from __future__ import annotations

import json
import re

from pydantic import BaseModel, ConfigDict, Field

from treadle.llm import Failure, FailureKind, LLMClient
from treadle.rsi.harness import Harness, Provenance, Skill
from treadle.rsi.ledger import OPERATORS, CostEntry, CostLedger

__all__ = ["CodeGeneration", "InducedSkill", "JudgeVerdict", "MathGeneration", "cost_from_llm_ledger",
           "llm_generate", "llm_induce_skill", "llm_paraphrase_judge", "tag"]


class MathGeneration(BaseModel):
    """Generator output for a math task: the new problem and its reference answer."""

    model_config = ConfigDict(extra="forbid")
    problem: str = Field(min_length=1)
    answer: str = Field(min_length=1)


class CodeGeneration(BaseModel):
    """Generator output for a coding task in HumanEval's layout."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, description="signature + docstring the solver completes")
    entry_point: str = Field(min_length=1)
    tests: str = Field(min_length=1, description="defines check(candidate)")
    reference: str = Field(min_length=1, description="reference solution (body or full def)")


class InducedSkill(BaseModel):
    """Meta agent's answer: a construction skill in the four fields (``method`` as free-text steps)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    intent: str = Field(min_length=1)
    method: list[str] = Field(min_length=1, max_length=8)
    tool_hint: str = ""


class JudgeVerdict(BaseModel):
    """Paraphrase judge: whether the candidate restates the benchmark item."""

    model_config = ConfigDict(extra="forbid")
    paraphrase: bool
    reason: str = ""


def tag(rnd: int, operator: str, seed_id: str | None) -> str:
    """Ledger tag of one RSI call (``operator`` in :data:`treadle.rsi.ledger.OPERATORS`)."""
    if operator not in OPERATORS:
        raise ValueError(f"operator must be one of {OPERATORS}, got {operator!r}")
    return f"rsi:{rnd}:{operator}:{seed_id or '-'}"


async def llm_generate(client: LLMClient, h: Harness, task_view: dict, skill: Skill, schema: type[BaseModel], *,
                       rnd: int, seed_id: str, role: str = "generator",
                       max_repairs: int | None = None) -> BaseModel | Failure:
    """Extend: ask the generator to rewrite ``task_view`` (the task *with* its reference, which only the
    generator sees) so that solving it needs ``skill``; returns a ``schema`` instance or a Failure."""
    skill_view = {"name": skill.name, "intent": skill.intent, "method": list(skill.method),
                  "tool_hint": skill.tool_hint}
    messages = [{"role": "system", "content": h.prompts.generator},
                {"role": "user", "content": json.dumps({"task": task_view, "skill": skill_view}, sort_keys=True)}]
    r = await client.structured(messages, schema, role=role, tag=tag(rnd, "extend", seed_id), max_repairs=max_repairs)
    return r if isinstance(r, Failure) else r.value


async def llm_induce_skill(client: LLMClient, h: Harness, task_text: str, answers: list[str], accuracy: float, *,
                           rnd: int, seed_id: str, failure_task: str, role: str = "meta",
                           max_repairs: int | None = None) -> Skill | Failure:
    """Online skill induction from a solver failure on a *valid* task: the Meta agent names the reasoning
    weakness as a construction skill. A skill whose text contains the task's answer-bearing lines is not
    asked for (the reference is never shown); a name already in ``h`` is an ``invalid_output`` failure."""
    messages = [{"role": "system", "content": h.prompts.meta},
                {"role": "user", "content": json.dumps({
                    "failed_task": task_text, "solver_answers": answers, "solver_accuracy": accuracy,
                    "library": [s.name for s in h.skills],
                    "instruction": "Name the reasoning weakness these answers show as a reusable way of constructing "
                                   "harder tasks (never the answer of this task)."}, sort_keys=True)}]
    r = await client.structured(messages, InducedSkill, role=role, tag=tag(rnd, "skill_update", seed_id),
                                max_repairs=max_repairs)
    if isinstance(r, Failure):
        return r
    v: InducedSkill = r.value
    if any(s.name == v.name for s in h.skills):
        return Failure.of(FailureKind.invalid_output, f"skill name {v.name!r} is already in the library", role,
                          last_output=r.result.text)
    return Skill(name=v.name, intent=v.intent, method=tuple(v.method), tool_hint=v.tool_hint,
                 difficulty_effect=-max(0.0, 1.0 - accuracy),
                 provenance=Provenance(source="online_failure", failure_task=failure_task, round=rnd,
                                       evidence={"solver_accuracy": accuracy}))


async def llm_paraphrase_judge(client: LLMClient, candidate: str, benchmark_item: str, *, role: str = "judge",
                               max_repairs: int | None = None) -> bool | Failure:
    """Whether ``candidate`` restates ``benchmark_item`` (the optional third decontamination check, after
    13-grams and embeddings; call it on the embedding index's nearest item)."""
    messages = [{"role": "system", "content": "Decide whether the candidate problem is a paraphrase of the benchmark "
                                              "problem (same task, reworded). Reply in JSON."},
                {"role": "user", "content": json.dumps({"candidate": candidate, "benchmark": benchmark_item})}]
    r = await client.structured(messages, JudgeVerdict, role=role, tag="rsi:-1:init:decontam",
                                max_repairs=max_repairs)
    return r if isinstance(r, Failure) else bool(r.value.paraphrase)


_TAG = re.compile(r"^rsi:(-?\d+):([a-z_]+):(.*)$")


def cost_from_llm_ledger(records, phase: str = "online") -> CostLedger:
    """RSI cost ledger from :mod:`treadle.llm` ledger records with ``rsi:`` tags: one entry per model call,
    ``units`` = 1 call, tokens in + out, money. Records of other tags are ignored."""
    entries = []
    for r in records:
        m = _TAG.match(r.tag)
        if m is None or m.group(2) not in OPERATORS:
            continue
        rnd, op, sid = int(m.group(1)), m.group(2), m.group(3)
        entries.append(CostEntry(round=rnd, phase="init" if op == "init" else phase, operator=op,
                                 seed_id=None if sid == "-" else sid, units=1.0,
                                 tokens=r.tokens_in + r.tokens_out, cost_usd=r.cost_usd))
    return CostLedger(entries)

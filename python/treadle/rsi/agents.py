"""LLM roles of the RSI loop through :mod:`treadle.llm` (every call cached and in the ledger):
the Director (structured decision) and the solver (``n`` samples per task).

The offline :class:`~treadle.rsi.loop.RSILoop` runs the rule-based Director and a synchronous solver;
:class:`~treadle.rsi.llm_loop.LLMRound` runs these agents with the LLM generator and Meta of
:mod:`treadle.rsi.llm_roles` inside a round (bounded concurrency; a rerun is served from the cache).
Malformed output and endpoint failures come back as :class:`treadle.llm.Failure` records, never raised.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from treadle.llm import Failure, FailureKind, LLMClient
from treadle.rsi.harness import Harness

__all__ = ["DirectorDecision", "SolveResult", "llm_director_decide", "llm_solve"]


class DirectorDecision(BaseModel):
    """The Director's next step."""

    model_config = ConfigDict(extra="forbid")
    step: Literal["extend", "revise", "verify", "finish"]
    skill: str | None = None
    """Library skill to apply (``extend`` only)."""
    reason: str = ""


async def llm_director_decide(client: LLMClient, h: Harness, state: dict, *, role: str = "director",
                              max_repairs: int | None = None, tag: str = "rsi.director") -> DirectorDecision | Failure:
    """Ask the ``role`` model for the next step given the library *as it is now* and the chain ``state``
    (e.g. steps used, extends, last accuracy). An ``extend`` naming a skill that is not in ``h`` is an
    ``invalid_output`` failure (blame: model), like output that never validates."""
    library = [{"name": s.name, "intent": s.intent, "difficulty_effect": round(s.difficulty_effect, 3)}
               for s in h.skills]
    messages = [{"role": "system", "content": h.prompts.director},
                {"role": "user", "content": json.dumps({"library": library, "workflow": h.workflow.model_dump(),
                                                        "state": state}, sort_keys=True)
                 + '\nAnswer with JSON {"step": ..., "skill": ..., "reason": ...}.'}]
    r = await client.structured(messages, DirectorDecision, role=role, tag=tag, max_repairs=max_repairs)
    if isinstance(r, Failure):
        return r
    d = r.value
    if d.step == "extend" and d.skill not in {s.name for s in h.skills}:
        return Failure.of(FailureKind.invalid_output, f"extend with unknown skill {d.skill!r}; library: "
                          f"{[s.name for s in h.skills]}", role, last_output=r.result.text)
    return d


@dataclass
class SolveResult:
    """Answers of one task (failed samples are left out) and the failures, in sample order."""

    answers: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)


async def llm_solve(client: LLMClient, h: Harness, texts: list[str], n: int = 4, *,
                    role: str = "solver", tags: list[str] | None = None) -> list[SolveResult]:
    """``n`` samples per task (distinct cache entries); one result per text, in order, even when calls fail.
    ``tags``: ledger tag per text (default ``rsi.solver``). An empty ``h.prompts.solver`` sends no system
    message (small models trained on bare user turns, like the embedded tiny model, answer better)."""
    if tags is not None and len(tags) != len(texts):
        raise ValueError(f"tags must have one entry per text: {len(tags)} tags for {len(texts)} texts")
    out = []
    for i, t in enumerate(texts):
        system = [{"role": "system", "content": h.prompts.solver}] if h.prompts.solver else []
        rs = await client.sample([*system, {"role": "user", "content": t}], n, role=role,
                                 tag="rsi.solver" if tags is None else tags[i])
        res = SolveResult()
        for r in rs:
            if isinstance(r, Failure):
                res.failures.append(r)
            else:
                res.answers.append(r.text or "")
        out.append(res)
    return out

"""Post-batch harness edits with an LLM Meta agent, judged by the Critic.

At the batch boundary the online harness ``H_o`` is frozen. The Meta agent proposes one edit ``dH`` at a
time (add / delete / modify a skill, edit a role prompt, edit the workflow or the Verify/Revise
positions), reading the rejection reports of earlier proposals. Each candidate and the baseline
synthesise one round from the same frozen queue with online admission off (:class:`LLMRound`), and the
:class:`~treadle.rsi.critic.PostBatchGate` accepts the first candidate whose validity, difficulty and cost
pass the Critic; after ``max_rejections`` rejections the edits are dropped and ``H_o`` is kept. A proposal
that does not validate or cannot be applied counts as a rejection (with its reason), so a Meta agent
that only emits garbage ends in the rollback.

Cost of a round = model calls asked for (:attr:`ChainRecord.calls`, cache hits included, structured-output
re-asks not), so a candidate's requests served from the cache are not free in the comparison.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict

from treadle.llm import Failure, LLMClient
from treadle.rsi.critic import Critic, Evaluation, PostBatchGate
from treadle.rsi.harness import Harness, Provenance, Skill, Workflow, diff
from treadle.rsi.llm_loop import LLMLoopConfig, LLMRound
from treadle.rsi.llm_roles import InducedSkill, tag

__all__ = ["HarnessEdit", "apply_edit", "llm_evaluate", "llm_post_batch", "llm_propose"]


class HarnessEdit(BaseModel):
    """One proposed ``dH`` (Meta agent's JSON)."""

    model_config = ConfigDict(extra="forbid")
    op: Literal["add_skill", "delete_skill", "modify_skill", "edit_prompt", "edit_workflow"]
    skill: InducedSkill | None = None
    """add_skill / modify_skill: the skill (modify: replaces the skill called ``skill.name``)."""
    name: str | None = None
    """delete_skill: the skill to delete."""
    prompt_role: Literal["generator", "director", "meta", "solver"] | None = None
    prompt: str | None = None
    workflow: dict[str, int | float | bool] | None = None
    """edit_workflow: fields of :class:`~treadle.rsi.harness.Workflow` to change."""
    rationale: str = ""


def apply_edit(h: Harness, e: HarnessEdit, rnd: int) -> Harness:
    """``h`` with the edit applied (a new version). Raises ValueError naming what is wrong (missing fields,
    unknown or duplicated skill, an empty library, an invalid workflow value)."""
    if e.op in ("add_skill", "modify_skill"):
        if e.skill is None:
            raise ValueError(f"{e.op} needs 'skill'")
        s = Skill(name=e.skill.name, intent=e.skill.intent, method=tuple(e.skill.method), tool_hint=e.skill.tool_hint,
                  provenance=Provenance(source="llm", round=rnd))
        names = [x.name for x in h.skills]
        if e.op == "add_skill":
            return h.with_skill(s)
        if s.name not in names:
            raise ValueError(f"modify_skill: no skill {s.name!r} in the library {names}")
        return h.evolve(skills=tuple(s if x.name == s.name else x for x in h.skills))
    if e.op == "delete_skill":
        kept = tuple(x for x in h.skills if x.name != e.name)
        if len(kept) == len(h.skills):
            raise ValueError(f"delete_skill: no skill {e.name!r} in the library {[x.name for x in h.skills]}")
        if not kept:
            raise ValueError("delete_skill would leave the library empty")
        return h.evolve(skills=kept)
    if e.op == "edit_prompt":
        if e.prompt_role is None or not e.prompt:
            raise ValueError("edit_prompt needs 'prompt_role' and a non-empty 'prompt'")
        return h.evolve(prompts=h.prompts.model_copy(update={e.prompt_role: e.prompt}))
    if not e.workflow:
        raise ValueError("edit_workflow needs 'workflow' with at least one field")
    unknown = sorted(set(e.workflow) - set(Workflow.model_fields))
    if unknown:
        raise ValueError(f"edit_workflow: unknown workflow fields {unknown}; known {sorted(Workflow.model_fields)}")
    return h.evolve(workflow=Workflow.model_validate({**h.workflow.model_dump(), **e.workflow}))


async def llm_propose(client: LLMClient, h: Harness, reports: list[str], *, rnd: int, attempt: int,
                      role: str = "meta", max_repairs: int | None = None) -> HarnessEdit | Failure:
    """One ``dH`` proposal for ``h`` given earlier rejection ``reports`` (sample ``attempt``: distinct cache entry)."""
    view = {"skills": [{"name": s.name, "intent": s.intent, "method": list(s.method),
                        "difficulty_effect": round(s.difficulty_effect, 3)} for s in h.skills],
            "prompts": h.prompts.model_dump(), "workflow": h.workflow.model_dump(),
            "earlier_rejections": reports}
    messages = [{"role": "system", "content": h.prompts.meta},
                {"role": "user", "content": json.dumps({"harness": view, "instruction": "Propose one edit (op: "
                                                        "add_skill, delete_skill, modify_skill, edit_prompt, "
                                                        "edit_workflow)."}, sort_keys=True)}]
    r = await client.structured(messages, HarnessEdit, role=role, tag=tag(rnd, "skill_update", None),
                                sample_index=attempt, max_repairs=max_repairs)
    return r if isinstance(r, Failure) else r.value


async def llm_evaluate(client: LLMClient, domain, h: Harness, queue: list, rnd: int,
                       config: LLMLoopConfig) -> tuple[Evaluation, list]:
    """Q, A and cost of ``h`` synthesising one round from the frozen ``queue`` (online admission off).
    Q = share of queue tasks with a new valid task (missing outputs count as invalid); A = mean solver
    accuracy over them (0 when none); cost = model calls asked for."""
    loop = LLMRound(client, domain, h, config.model_copy(update={"online": False}))
    recs = await loop.run(queue, rnd)
    valid = [r for r in recs if r.new_valid]
    acc = [r.accuracy for r in valid]
    ev = Evaluation(validity=len(valid) / len(queue), accuracy=sum(acc) / len(acc) if acc else 0.0,
                    cost=float(sum(r.calls for r in recs)), n_tasks=len(queue))
    return ev, recs


async def llm_post_batch(client: LLMClient, domain, online: Harness, queue: list, rnd: int,
                         config: LLMLoopConfig | None = None, *, margin: float = 0.02, max_rejections: int = 3,
                         reports: list[str] | None = None) -> tuple[Harness, list[dict]]:
    """Post-batch stage for one batch: returns the next harness (the accepted candidate, or ``online`` after
    ``max_rejections`` rejections) and the log (every proposal with its diff, evaluation and verdict).
    ``reports``: rejection reasons of earlier batches the Meta agent may read (extended in place)."""
    config = config or LLMLoopConfig()
    reports = reports if reports is not None else []
    base, _ = await llm_evaluate(client, domain, online, queue, rnd, config)
    gate = PostBatchGate(online, base, Critic(margin), max_rejections)
    log: list[dict] = [{"event": "baseline", "round": rnd, "evaluation": base.model_dump()}]
    attempt = 0
    while not gate.done:
        e = await llm_propose(client, online, reports, rnd=rnd, attempt=attempt, role=config.roles["meta"],
                              max_repairs=config.max_repairs)
        attempt += 1
        try:
            if isinstance(e, Failure):
                raise ValueError(f"proposal failed: [{e.kind.value}] {e.message}")
            cand = apply_edit(online, e, rnd)
        except ValueError as err:  # counts as a rejection: the Meta agent cannot stall the gate
            gate.rejections += 1
            reports.append(str(err))
            log.append({"event": "candidate", "round": rnd, "accepted": False, "reason": str(err), "stage": "proposal"})
            if gate.rolled_back:
                log.append({"event": "rollback", "round": rnd, "kept_version": online.version})
            continue
        ev, _ = await llm_evaluate(client, domain, cand, queue, rnd, config)
        v = gate.offer(cand, ev, e.op)
        if not v.accepted:
            reports.append(f"{e.op}: {v.reason}")
        log.append({"event": "candidate", "round": rnd, "proposal": e.model_dump(mode="json"),
                    "diff": diff(online, cand), "accepted": v.accepted, "reason": v.reason, "verdict": v.model_dump()})
        if gate.rolled_back:
            log.append({"event": "rollback", "round": rnd, "kept_version": online.version})
    return gate.result, log

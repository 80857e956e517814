"""The evolution loop: roll out, attribute each failure, revise only the blamed component, re-validate, repeat.

Seed: WEFT 5.1 (the system that produces training data is repaired where the fault lies, not by
punishing the policy). One round:

1. every task is attempted up to ``k`` times by the rollouts' replay policy (seeded perturbations, the
   same draws every round, so that a change of the metric comes from the revisions and not from the
   policy's noise) from its current initial state on the current server; the first passing attempt is selected
   (else the last one); the round's metric is the **tool-call error rate of the selected
   trajectories** (failed calls / calls);
2. each task with no passing attempt is attributed (:func:`attribute_failure`: the task's request and
   forbidden tools, the harness its calls went through, and the verdicts of the same attempt under every
   harness of :attr:`EvolvingSystem.harnesses`, Hermes, ReAct and native calls by default); each passing task
   is audited (:func:`audit_passing`: its server's tool contracts on the reference calls, the verifier's
   negative controls), since a born-broken server or a lenient verifier fails no checkpoint; a failure blamed
   on the policy is checked against the tools' documentation (:mod:`~treadle.weft.evolve.doc_judge`: the
   reviser's role ``doc_judge``, its claims accepted only when execution confirms them; offline, a unit
   confusion on a tool whose units only its prose states is undecided); what stays undecided goes to the
   reviser's LLM role ``attributor`` when its config has one;
3. each blamed component, and only it, is revised: **environment** -> the server's backend, **task** ->
   the task's initial state, **evaluator** -> the verifier (offline: regenerated from the evidence, comparing
   free text by meaning unless the request quotes it), **harness** -> the faulty harness's view
   (:mod:`~treadle.weft.evolve.harness_revise`: the harness whose own check fails on the blamed task's reference
   calls is restored to the system's certified harness of that name, or quarantined when there is none; the
   affected trajectories are re-run under the healthy harness and only what still fails there with a policy
   verdict is counted against the policy, :attr:`Round.against_policy`); **policy** failures revise nothing
   (they are training signal). Offline (no ``reviser``): the backend is restored to the last certified source, the
   initial state to the certified snapshot, the verifier regenerated from the reference evidence. With an
   :class:`~treadle.weft.evolve.revise.LLMReviser`, an LLM role proposes the revised component from its
   evidence and it is accepted only if it passes its validation (backend: the synthesis validation in the
   sandbox, for synthesised environments; a native environment's trusted source is restored instead; task:
   the three certification baselines; verifier: the reference evidence); a rejected proposal leaves the
   component as it was, every answer is in :attr:`Round.revisions`. Backends are revised first, so that a task or verifier revised in the same round is validated on the
   repaired server;
4. what depends on a revised component is re-validated (the reference plan of every task on a revised
   server, or of a revised task, must pass its verifier).

Composed cross-server tasks (:class:`ComposedSlot`) are played by a correct agent (the certified composed
task's calls, node by node) and judged by their nodes' checks as they are now and by the structural checks (a
run that passes with a wrong binding or edge still fails: execution alone accepts a call on an unbound object
that also satisfies the check); a failed one is attributed
by :func:`~treadle.weft.evolve.composed_revise.attribute_composed` (a wrong entity binding or DAG edge:
``task``), only the blamed binding argument or node edges are revised
(:func:`~treadle.weft.evolve.composed_revise.revise_composed`), and the revision is kept only if the
composed task re-certifies by execution (its components are ``composed:<task>/<part>``); what the certified
task cannot decide (a cycle among nodes it does not know, a wrong binding with no single bound value) goes to
the reviser's ``composer`` role when one is given, validated the same way (offline it is left as it is).

Rounds continue until the error rate stops falling (or ``max_rounds``). Every component carries a
version and a digest; a round records which it revised, and :attr:`Round.untouched_ok` checks that no
unblamed component changed.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.evolve.attribute import Attribution, Blame, ReferenceEvidence, attribute, generate_verifier
from treadle.weft.evolve.certify import play
from treadle.weft.evolve.harness_revise import HarnessRerun, counted_against_policy, harness_digest, revise_harnesses
from treadle.weft.evolve.revise import RevisionAttempt, SynthEnv
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointSpec


@dataclass
class TaskSlot:
    """One task of the system: its environment, current initial state and verifier, and what was certified."""

    env: str
    task: AtomicTask
    start: Snapshot
    spec: CheckpointSpec
    evidence: ReferenceEvidence
    certified_start: Snapshot
    versions: dict[str, int] = field(default_factory=lambda: {"task": 1, "verifier": 1})


@dataclass
class ComposedSlot:
    """A composed cross-server task of the system: as it is now, and as it was certified (its servers are
    environments of the system, by name)."""

    task: Any
    certified: Any
    version: int = 1


@dataclass
class EvolvingSystem:
    """Server sources per environment (current and certified), the task slots, and the artefacts of the
    synthesised environments among them (``synth``: env -> :class:`~treadle.weft.evolve.revise.SynthEnv`;
    their ``sources`` are the served modules of those artefacts). ``harnesses``: the harnesses tasks are played
    under (the first is the primary one, the others give the cross-harness verdicts); ``certified_harnesses``:
    the trusted harness of each name, that a blamed harness is restored to."""

    sources: dict[str, str]
    certified: dict[str, str]
    tasks: list[TaskSlot]
    backend_versions: dict[str, int] = field(default_factory=dict)
    synth: dict[str, SynthEnv] = field(default_factory=dict)
    composed: list[ComposedSlot] = field(default_factory=list)
    harnesses: dict[str, Any] = field(default_factory=lambda: default_harnesses())
    certified_harnesses: dict[str, Any] = field(default_factory=lambda: default_harnesses())

    def digests(self) -> dict[str, str]:
        """``{component: digest}`` for every backend, harness, task initial state and verifier."""
        out = {f"backend:{e}": hashlib.sha256(s.encode()).hexdigest()[:16] for e, s in self.sources.items()}
        out.update({f"harness:{n}": harness_digest(h) for n, h in self.harnesses.items()})
        for t in self.tasks:
            out[f"task:{t.task.name}"] = t.start.digest
            out[f"verifier:{t.task.name}"] = hashlib.sha256(t.spec.model_dump_json(exclude={"predicates"})
                                                            .encode()).hexdigest()[:16]
        if self.composed:
            from treadle.weft.evolve.composed_revise import component_digests

            for c in self.composed:
                out.update({f"composed:{c.task.name}/{k}": v for k, v in component_digests(c.task).items()})
        return out


class Round(BaseModel):
    """One round: the metric, the attributions, the blamed and revised components, re-validation."""

    model_config = ConfigDict(extra="forbid")

    round: int
    tool_calls: int
    tool_errors: int
    error_rate: float
    passed: int
    tasks: int
    attributions: list[Attribution] = Field(default_factory=list)
    blamed: list[str] = Field(default_factory=list)
    revised: list[str] = Field(default_factory=list)
    revalidated: dict[str, bool] = Field(default_factory=dict)
    revisions: list[RevisionAttempt] = Field(default_factory=list, description="every LLM reviser answer")
    quarantined: dict[str, str] = Field(default_factory=dict, description="harnesses removed, and why")
    harness_reruns: list[HarnessRerun] = Field(default_factory=list,
                                               description="harness-blamed tasks played again under a healthy harness")
    against_policy: list[str] = Field(default_factory=list,
                                      description="checkpoints whose failure counts against the policy")

    @property
    def untouched_ok(self) -> bool:
        return set(self.revised) <= set(self.blamed)


def default_harnesses() -> dict[str, Any]:
    """The harnesses every task is played under: Hermes (the one the round's metric uses), ReAct and native calls."""
    from treadle.weft.rollouts.harnesses import HermesHarness, NativeHarness, ReActHarness

    return {"hermes": HermesHarness(), "react": ReActHarness(), "native": NativeHarness()}


async def attribute_failure(rt: Any, slot: TaskSlot, server_hash: str, outcomes: Sequence[Any], verdict: Any, *,
                            harness: Any = None, harness_verdicts: dict[str, int] | None = None,
                            doc_client: Any = None) -> Attribution:
    """The loop's attribution of a failed slot: :func:`~treadle.weft.evolve.attribute.attribute` with the task's
    request and forbidden tools, the harness the calls went through and the cross-harness verdicts (one policy
    behind every harness: failing under all of them is no signal, so that rule is off). A policy verdict then goes
    through the documentation/behaviour step (:func:`~treadle.weft.evolve.doc_judge.doc_behaviour`): with
    ``doc_client`` (an LLM client whose config has the role ``doc_judge``) its claims validated by execution may
    make it ``environment``; without one, a unit confusion on a tool whose units only its prose states is
    ``undecided``."""
    att = await attribute(rt, server_hash, slot.start, slot.spec, slot.evidence, outcomes, verdict,
                          harness_verdicts=harness_verdicts, request=slot.task.request, harness=harness,
                          forbidden=list(slot.task.checkpoint.forbidden_tools), every_harness_rule=False)
    if att.blame != Blame.policy:
        return att
    from treadle.weft.evolve.doc_judge import doc_behaviour

    tools = {t["name"]: t for t in rt.registry.spec(server_hash).tools}
    v = await doc_behaviour(rt, server_hash, slot.start, slot.evidence, outcomes, tools, client=doc_client,
                            request=slot.task.request)
    if v is None:
        return att
    update: dict[str, Any] = {"llm": v.llm} if v.llm is not None else {}
    if v.blame is not None:
        update.update(blame=Blame(v.blame), rule=v.rule, detail=v.detail[:500])
    return att.model_copy(update=update)


async def audit_passing(rt: Any, slot: TaskSlot, server_hash: str) -> Attribution | None:
    """A passing slot's audit (:func:`~treadle.weft.evolve.attribute_more.audit_slot`): a born-broken server or a
    lenient verifier, as an attribution; None when neither shows."""
    from treadle.weft.evolve.attribute_more import audit_slot

    found = await audit_slot(rt, server_hash, slot.start, slot.spec, slot.evidence, request=slot.task.request,
                             forbidden=list(slot.task.checkpoint.forbidden_tools))
    if found is None:
        return None
    blame, rule, detail = found
    return Attribution(checkpoint=slot.spec.name, blame=Blame(blame), rule=rule, detail=detail[:500])


def _attempt_calls(task: AtomicTask, rates: dict[str, float], seed: int, attempt: int,
                   harness: Any = None) -> list[ToolCall]:
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.rollouts.policies import PolicyContext, ReplayPolicy
    from treadle.weft.rollouts.tasks import RolloutTask

    h = harness if harness is not None else HermesHarness()
    ctx = PolicyContext(task=RolloutTask(name=task.name, env="evolve", atomic=(task,)), atomic=task, index=0,
                        attempt=attempt, step=0, seed=seed)
    return [ToolCall(name=c.name, arguments=dict(c.arguments))
            for step in ReplayPolicy(rates, seed=seed).plan(h, ctx) for c in h.parse(step).calls]


async def run_round(rt: Any, system: EvolvingSystem, n: int, *, rates: dict[str, float], k: int = 2,
                    seed: int = 0, reviser: Any = None) -> Round:
    """One round of the loop (see the module docstring); revises ``system`` in place (``reviser``: an
    :class:`~treadle.weft.evolve.revise.LLMReviser`, or None for the offline revisions)."""
    hashes = {e: rt.register(src) for e, src in system.sources.items()}
    calls = errors = passed = 0
    failed: list[tuple[TaskSlot, Any, Any, dict[str, int], int]] = []
    passing: list[TaskSlot] = []
    primary_name, primary = next(iter(system.harnesses.items())) if system.harnesses else ("hermes", None)
    for slot in system.tasks:
        last = None
        for a in range(k):
            outs, verdict = await play(rt, hashes[slot.env], slot.start, slot.spec,
                                       _attempt_calls(slot.task, rates, seed, a, primary))
            last = (outs, verdict, a)
            if verdict.r == 1:
                break
        outs, verdict, a = last
        calls += len(outs)
        errors += sum(not o.ok for o in outs)
        if verdict.r == 1:
            passed += 1
            passing.append(slot)
        else:  # the same attempt under every harness: the cross-harness verdicts
            hv = {primary_name: 0}
            for name, h in system.harnesses.items():
                if name != primary_name:
                    hv[name] = (await play(rt, hashes[slot.env], slot.start, slot.spec,
                                           _attempt_calls(slot.task, rates, seed, a, h)))[1].r
            failed.append((slot, outs, verdict, hv, a))
    composed_failed = []
    for cslot in system.composed:
        outcome = await _play_composed(rt, cslot, hashes)
        calls += sum(len(o) for o in outcome.outcomes) if outcome is not None else 0
        errors += sum(not x.ok for o in outcome.outcomes for x in o) if outcome is not None else 0
        if outcome is not None and outcome.reward == 1.0 and not _structural_faults(rt, cslot, hashes):
            passed += 1
        else:
            composed_failed.append((cslot, outcome))
    rnd = Round(round=n, tool_calls=calls, tool_errors=errors, error_rate=errors / calls if calls else 0.0,
                passed=passed, tasks=len(system.tasks) + len(system.composed))
    before = system.digests()
    logged = len(reviser.log) if reviser is not None else 0
    env_evidence: dict[str, list[Attribution]] = {}
    blamed_slots: list[tuple[TaskSlot, Attribution]] = []
    audits = [(slot, await audit_passing(rt, slot, hashes[slot.env])) for slot in passing]
    attempt_of = {id(slot): a for slot, *_, a in failed}
    doc_client = _client_with(reviser, "doc_judge")
    verdicts = [(slot, await attribute_failure(rt, slot, hashes[slot.env], outs, verdict, harness=primary,
                                               harness_verdicts=hv, doc_client=doc_client))
                for slot, outs, verdict, hv, _ in failed]
    harness_blamed: list[tuple[TaskSlot, Attribution, int]] = []
    for slot, att in verdicts + [(s, a) for s, a in audits if a is not None]:
        att = await _llm_decides(reviser, slot, att)
        rnd.attributions.append(att)
        if att.blame == Blame.harness:  # revised after the other components (harness_revise)
            harness_blamed.append((slot, att, attempt_of.get(id(slot), 0)))
        elif att.blame == Blame.environment:
            rnd.blamed.append(f"backend:{slot.env}")
            env_evidence.setdefault(slot.env, []).append(att)
        elif att.blame in (Blame.task, Blame.evaluator):
            rnd.blamed.append(f"{'task' if att.blame == Blame.task else 'verifier'}:{slot.task.name}")
            blamed_slots.append((slot, att))
    revise_env: set[str] = set()
    for env in sorted(env_evidence):  # backends first: tasks and verifiers are validated on the repaired server
        if reviser is not None and env in system.synth:
            new = await reviser.backend(env, system.synth[env], env_evidence[env])
        else:  # offline, or a native environment (trusted code: restored, never rewritten by an LLM)
            new = system.certified[env]
            if env in system.synth and system.synth[env].certified is not None:  # the artefacts follow the source
                system.synth[env].result = system.synth[env].certified
        if new is not None and new != system.sources[env]:
            system.sources[env] = new
            system.backend_versions[env] = system.backend_versions.get(env, 1) + 1
            revise_env.add(env)
            hashes[env] = rt.register(new)
    for slot, att in blamed_slots:
        if att.blame == Blame.task:
            new = slot.certified_start if reviser is None else await reviser.task(rt, hashes[slot.env], slot, att)
            if new is not None:
                slot.start = new
                slot.versions["task"] += 1
        else:
            new = (generate_verifier(slot.task.checkpoint, slot.start, slot.evidence, request=slot.task.request)
                   if reviser is None
                   else await reviser.verifier(rt, hashes[slot.env], slot, att))
            if new is not None:
                slot.spec = new
                slot.versions["verifier"] += 1
    for cslot, outcome in composed_failed:
        await _revise_composed(rt, cslot, hashes, outcome, rnd, reviser)
    await revise_harnesses(rt, system, harness_blamed, hashes, rnd, attribute=attribute_failure,
                           replay=lambda s, a, h: _attempt_calls(s.task, rates, seed, a, h))
    rnd.against_policy = counted_against_policy(rnd.attributions, rnd.harness_reruns)
    if reviser is not None:
        rnd.revisions = list(reviser.log[logged:])
    after = system.digests()
    rnd.revised = sorted({c for c in after if after[c] != before.get(c)} | {c for c in before if c not in after})
    rnd.blamed = sorted(set(rnd.blamed))
    touched_tasks = {c.split(":", 1)[1] for c in rnd.revised
                     if not c.startswith(("backend:", "composed:", "harness:"))}
    for slot in system.tasks:  # re-validate what depends on a revised component
        if slot.env in revise_env or slot.task.name in touched_tasks:
            _, v = await play(rt, hashes[slot.env], slot.start, slot.spec, list(slot.evidence.calls))
            rnd.revalidated[slot.task.name] = v.r == 1
    for cslot in system.composed:
        if set(cslot.task.snapshots) & revise_env or any(c.startswith(f"composed:{cslot.task.name}/")
                                                         for c in rnd.revised):
            from treadle.weft.evolve.composed_revise import recertify_composed

            cert = await recertify_composed(rt, cslot.task, {s: hashes[s] for s in cslot.task.snapshots})
            rnd.revalidated[f"composed:{cslot.task.name}"] = cert.certified
    return rnd


def _client_with(reviser: Any, role: str) -> Any:
    """The reviser's LLM client when its config has ``role``, else None (offline)."""
    client = getattr(reviser, "client", None)
    roles = getattr(getattr(client, "config", None), "roles", {}) or {}
    return client if client is not None and role in roles else None


async def _llm_decides(reviser: Any, slot: TaskSlot, att: Attribution) -> Attribution:
    """An undecided attribution goes to the reviser's LLM role ``attributor`` when its config has one
    (:func:`~treadle.weft.evolve.attribute.llm_attribute`); offline, or without that role, it stays undecided
    (never a silent policy failure)."""
    client = getattr(reviser, "client", None)
    roles = getattr(getattr(client, "config", None), "roles", {}) or {}
    if att.blame != Blame.undecided or client is None or "attributor" not in roles:
        return att
    from treadle.weft.evolve.attribute import llm_attribute

    return await llm_attribute(client, att, request=slot.task.request)


def _structural_faults(rt: Any, cslot: ComposedSlot, hashes: dict[str, str]) -> list:
    """The slot's wrong bindings and DAG edges (a run can pass with them: a call on an unbound object that also
    satisfies the check, an edge whose loss changes no outcome)."""
    from treadle.weft.evolve.composed_revise import binding_faults, edge_faults, server_tools

    tools = server_tools(rt, {s: hashes[s] for s in cslot.task.snapshots})
    return edge_faults(cslot.task, cslot.certified) + binding_faults(cslot.task, tools)


async def _play_composed(rt: Any, cslot: ComposedSlot, hashes: dict[str, str]) -> Any:
    """The correct agent's run of a composed slot (None when the task cannot run: a dependency cycle)."""
    from treadle.weft.evolve.compose import run_composed
    from treadle.weft.evolve.composed_revise import plan_policy
    from treadle.weft.rollouts.tasks import DependencyCycleError

    try:
        return await run_composed(rt, cslot.task, {s: hashes[s] for s in cslot.task.snapshots},
                                  plan_policy(cslot.certified))
    except DependencyCycleError:
        return None


async def _revise_composed(rt: Any, cslot: ComposedSlot, hashes: dict[str, str], outcome: Any, rnd: Round,
                           reviser: Any = None) -> None:
    """Attribute a failed composed slot; revise only its blamed bindings / edges from the certified task, kept only
    if it re-certifies; what that leaves undecided goes to ``reviser``'s composer role (when given)."""
    from treadle.weft.evolve.composed_revise import attribute_composed, recertify_composed, revise_composed
    from treadle.weft.evolve.revise import undecided_parts

    h = {s: hashes[s] for s in cslot.task.snapshots}
    verdicts = await attribute_composed(rt, cslot.task, cslot.certified, h, outcome)
    for v in verdicts:  # checkpoint named <composed task>/<node>, as in the components
        cp = v.attribution.checkpoint
        rnd.attributions.append(v.attribution.model_copy(
            update={"checkpoint": cp if cp == cslot.task.name else f"{cslot.task.name}/{cp}"}))
        if v.fault is not None:
            rnd.blamed.append(f"composed:{cslot.task.name}/{'calls' if v.fault.kind == 'binding' else 'edges'}:"
                              f"{v.fault.node}")
    parts = undecided_parts(cslot.task, cslot.certified, verdicts)
    rnd.blamed.extend(f"composed:{cslot.task.name}/{p}" for p in parts)
    faults = [v.fault for v in verdicts if v.fault is not None]
    base = cslot.task
    if faults:
        new = revise_composed(cslot.task, cslot.certified, faults)
        cert = await recertify_composed(rt, new, h)
        if cert.certified:
            cslot.task = new
            cslot.version += 1
            return
        base = new  # an LLM revision starts from what the certified task could repair
    if reviser is not None and parts:
        new = await reviser.composed(rt, h, base, cslot.certified, verdicts)
        if new is not None:
            cslot.task = new
            cslot.version += 1
            return
    if faults or parts:  # kept as it was; the reasons are the certificate's / the reviser's log
        rnd.revalidated[f"composed:{cslot.task.name}"] = False


async def evolve(rt: Any, system: EvolvingSystem, *, rates: dict[str, float], max_rounds: int = 5, k: int = 2,
                 seed: int = 0, reviser: Any = None) -> list[Round]:
    """Rounds until the tool-call error rate of the selected trajectories stops falling (at most ``max_rounds``);
    ``reviser`` as in :func:`run_round`.

    Raises:
        ValueError: ``max_rounds`` or ``k`` < 1.
    """
    if max_rounds < 1 or k < 1:
        raise ValueError(f"max_rounds and k must be >= 1, got {max_rounds}, {k}")
    rounds: list[Round] = []
    for n in range(1, max_rounds + 1):
        rounds.append(await run_round(rt, system, n, rates=rates, k=k, seed=seed, reviser=reviser))
        if len(rounds) >= 2 and rounds[-1].error_rate >= rounds[-2].error_rate:
            break
    return rounds


def plot_rounds(rounds: Sequence[Round], path: Any) -> None:
    """PNG: tool-call error rate per round, and failed tasks per blamed component kind."""
    from treadle.figures import png_figure

    xs = [r.round for r in rounds]
    with png_figure(path, figsize=(9, 3.4), ncols=2) as (_, (a, b)):
        a.plot(xs, [r.error_rate for r in rounds], marker="o")
        a.set_xlabel("round")
        a.set_ylabel("tool-call error rate (selected)")
        a.set_xticks(xs)
        bottom = [0] * len(rounds)
        for blame in (Blame.environment, Blame.task, Blame.evaluator, Blame.harness, Blame.policy):
            ys = [sum(x.blame == blame for x in r.attributions) for r in rounds]
            b.bar(xs, ys, bottom=bottom, label=blame.value)
            bottom = [p + q for p, q in zip(bottom, ys)]
        b.set_xlabel("round")
        b.set_ylabel("failed tasks by attribution")
        b.set_xticks(xs)
        b.legend(fontsize=8)

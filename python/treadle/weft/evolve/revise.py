"""Revision of a blamed component by LLM roles, accepted only when it passes its own validation (seed: WEFT 5.1).

The evolution loop (:mod:`~treadle.weft.evolve.loop`) blames each failed checkpoint on one component;
:class:`LLMReviser` asks one ``treadle.llm`` role (any OpenAI-compatible endpoint) for a revised
version of *that* component, given the component as it is now and the attribution's evidence (the
trajectory span, the reference's state diff, the failed check's details, the rule that decided):

========================  ============  =====================================================================
blamed component          role          validated by (the revision is accepted only if it passes)
========================  ============  =====================================================================
backend (environment)     ``backend``   the synthesis validation path in the sandbox
                                        (:func:`~treadle.weft.evolve.synth_validate.validate`: the
                                        environment's normal and boundary checks, state read-back)
task initial state        ``grounder``  the three certification baselines from the revised state
                                        (:func:`~treadle.weft.evolve.certify.certify_task`: the reference
                                        executes and passes, the initial state, a do-nothing agent and a
                                        read-only agent score 0)
verifier (evaluator)      ``verifier``  tested on the reference evidence first: the reference plan passes it,
                                        a do-nothing agent does not; its SQL must be read-only
composed task (what the   ``composer``  only the undecided part changes (:func:`~treadle.weft.evolve.
deterministic path                      composed_revise.component_digests`), then the composed task re-certifies
cannot decide)                          by execution with its bindings holding
                                        (:func:`~treadle.weft.evolve.composed_revise.recertify_composed`)
========================  ============  =====================================================================

Answers are JSON objects (:class:`~treadle.weft.evolve.synth_validate.Backend`, :class:`StateRevision`,
:class:`VerifierRevision`, :class:`ComposedRevision`). Each component gets at most ``attempts`` answers; a
failed call, an answer that is not the JSON asked for, or a revision that fails validation is recorded
(:class:`RevisionAttempt`) and fed back to the next attempt, never raised. A component whose revision is not accepted stays exactly as it
was (nothing accepted earlier is lost).

Only *synthesised* environments (:class:`SynthEnv`: their backend is generated code that runs in the
sandbox only) have their backend revised by an LLM; a native environment's source is trusted code, which
an LLM never rewrites (the loop restores its certified source instead).
"""
from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.evolve.attribute import Attribution
from treadle.weft.evolve.synth_validate import Backend
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointSpec, StateAssertion
from treadle.untrusted import clip, fenced_blocks, loads_json

__all__ = ["REVISE_ROLES", "ArgumentRevision", "ComposedRevision", "LLMReviser", "RevisionAttempt", "StateRevision",
           "SynthEnv", "VerifierRevision", "read_only_sql", "undecided_parts"]

REVISE_ROLES = {"backend": "backend", "task": "grounder", "verifier": "verifier", "composed": "composer"}
"""Component kind -> the ``treadle.llm`` role asked to revise it."""


@dataclass
class SynthEnv:
    """A synthesised environment of an evolving system: its artefacts (an accepted
    :class:`~treadle.weft.evolve.synth.SynthResult`), the server name and the sandbox limits it is served with;
    ``certified``: the artefacts its tasks were certified on, when known (an offline revision restores them)."""

    result: Any
    name: str
    limits: Any = None
    certified: Any = None

    def source(self) -> str:
        """The served module (:func:`~treadle.weft.evolve.synth_serve.server_source`) of the current artefacts."""
        from treadle.weft.evolve.synth_serve import server_source

        return server_source(self.result, self.name, limits=self.limits)


class StateRevision(BaseModel):
    """A revised task initial state: rows to insert into the current one (``{table: [[column values]]}``, every
    column in the table's order). Applied with parameters, never as SQL text."""

    model_config = ConfigDict(extra="forbid")
    insert: dict[str, list[list[Any]]] = Field(min_length=1)
    reason: str = ""


class VerifierRevision(BaseModel):
    """A revised verifier: the fields given replace the current check's (``None``: kept as it is)."""

    model_config = ConfigDict(extra="forbid")
    expected_returns: list[Any] | None = None
    assertions: list[StateAssertion] | None = None
    gold_calls: list[ToolCall] | None = None
    reason: str = ""


class ArgumentRevision(BaseModel):
    """One gold-call argument of a composed task's node set to ``value`` (``call``: the call's index in the node)."""

    model_config = ConfigDict(extra="forbid")
    node: str
    call: int = Field(ge=0)
    arg: str
    value: Any


class ComposedRevision(BaseModel):
    """A revised composed task: new dependencies for some nodes (``{node: [nodes it runs after]}``) and new values
    for some gold-call arguments; everything else stays as it is."""

    model_config = ConfigDict(extra="forbid")
    depends_on: dict[str, list[str]] = Field(default_factory=dict)
    arguments: list[ArgumentRevision] = Field(default_factory=list)
    reason: str = ""


def undecided_parts(task: Any, certified: Any, verdicts: Sequence[Any]) -> list[str]:
    """The parts of a composed ``task`` (names of :func:`~treadle.weft.evolve.composed_revise.component_digests`)
    that ``verdicts`` leave to an LLM: ``edges:<node>`` of the nodes the certified DAG does not know (every node
    when it knows them all) for an undecided verdict (a cycle the certified DAG cannot repair), and
    ``calls:<node>`` for a wrong binding with no single bound value. Empty: the deterministic path decides."""
    known = {n.name for n in certified.nodes}
    out: set[str] = set()
    for v in verdicts:
        f = v.fault
        if f is None and v.attribution.blame.value == "undecided":
            unknown = [n.name for n in task.nodes if n.name not in known]
            out.update(f"edges:{n}" for n in (unknown or [n.name for n in task.nodes]))
        elif f is not None and f.kind == "binding" and f.expected is None:
            out.add(f"calls:{f.node}")
    return sorted(out)


class RevisionAttempt(BaseModel):
    """One LLM answer for one component: accepted or not, and why (malformed, failed call, failed validation)."""

    model_config = ConfigDict(extra="forbid")
    component: str
    role: str
    attempt: int
    accepted: bool
    detail: str
    answer: str = ""


def _json_of(text: str) -> Any:
    """The JSON of a model's answer (its first fenced block, else the whole text): linear, bounded nesting;
    raises :class:`~treadle.untrusted.UntrustedInputError` (a ``ValueError``)."""
    blocks = fenced_blocks(text)
    return loads_json(blocks[0] if blocks else text, duplicates=True, what="the answer's JSON")


def read_only_sql(sql: str, snapshot: Snapshot) -> str:
    """'' when ``sql`` is one statement that only reads (prepared on a copy of ``snapshot`` under an SQLite
    authorizer allowing SELECT, reads and functions), else why not. Run before an LLM-written assertion is used."""
    from treadle.weft.evolve.grounding import open_copy

    if not isinstance(sql, str) or not sqlite3.complete_statement(sql.strip().rstrip(";") + ";") \
            or ";" in sql.strip().rstrip(";"):
        return f"not one SQL statement: {sql!r}"
    ok = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
    con = open_copy(snapshot)
    try:
        con.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in ok else sqlite3.SQLITE_DENY)
        con.execute(f"EXPLAIN {sql}")
    except sqlite3.Error as err:
        return f"not a read-only query ({err}): {sql!r}"
    finally:
        con.close()
    return ""


def _evidence(atts: Sequence[Attribution]) -> list[dict[str, Any]]:
    return [a.model_dump(mode="json", include={"checkpoint", "blame", "rule", "detail", "span", "reference_diff",
                                                "check"}) for a in atts]


class LLMReviser:
    """Revises blamed components with LLM roles (see the module docstring); :attr:`log` keeps every answer.

    Args:
        client: a :class:`treadle.llm.LLMClient` (or anything with its ``chat``) whose config has the roles
            of :data:`REVISE_ROLES` that will be asked.
        attempts: answers per component and round (>= 1). Each answer is a new sample (``sample_index`` counts
            the component's answers over all rounds), so a later round does not get a cached repeat.

    Raises:
        ValueError: ``attempts`` < 1. Its methods raise :class:`treadle.sandbox.SandboxUnavailableError` when a
            backend revision cannot be validated here (no sandbox); every other problem is recorded in :attr:`log`.
    """

    def __init__(self, client: Any, *, attempts: int = 2) -> None:
        if not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {attempts!r}")
        self.client = client
        self.attempts = attempts
        self.log: list[RevisionAttempt] = []
        self._asked: dict[str, int] = {}  # answers asked per component over all rounds: each is a new sample

    async def _propose(self, component: str, kind: str, ask: str, context: dict[str, Any], model: type[BaseModel],
                       check: Any) -> Any:
        """Up to ``attempts`` answers; the first that parses and for which ``await check(value)`` returns
        ``(result, '')`` is accepted (its result returned); otherwise None."""
        from treadle.llm import LLMCallError
        from treadle.sandbox import SandboxUnavailableError

        role = REVISE_ROLES[kind]
        failures: list[str] = []
        for k in range(self.attempts):
            body = {"task": ask, "component": component, "answer_json_schema": model.model_json_schema(), **context}
            if failures:
                body["previous_attempts_failed"] = failures
            messages = [{"role": "system", "content": "You repair one component of a tool-use training environment. "
                                                      "Answer with one JSON object only."},
                        {"role": "user", "content": json.dumps(body, sort_keys=True, default=str)}]
            try:
                n = self._asked[component] = self._asked.get(component, -1) + 1
                r = await self.client.chat(messages, role=role, tag="weft-revise", sample_index=n)
            except LLMCallError as err:
                why = f"{role} call failed: {err.failure.kind.value}: {err.failure.message}"[:500]
                self.log.append(RevisionAttempt(component=component, role=role, attempt=k, accepted=False, detail=why))
                failures.append(why)
                continue
            try:
                value = model.model_validate(_json_of(r.text))
            except (ValueError, ValidationError) as err:
                why = f"malformed answer (not the JSON asked for): {str(err).splitlines()[0][:200]}"
                self.log.append(RevisionAttempt(component=component, role=role, attempt=k, accepted=False, detail=why,
                                                answer=r.text[:2000]))
                failures.append(why)
                continue
            try:
                result, why = await check(value)
            except SandboxUnavailableError:
                raise  # no sandbox on this machine: nothing generated can be validated, say so
            except Exception as err:  # noqa: BLE001  (a proposal that breaks its validation is rejected, not fatal)
                result, why = None, f"validation raised {type(err).__name__}: {clip(err, 300)}"
            self.log.append(RevisionAttempt(component=component, role=role, attempt=k, accepted=not why,
                                            detail=why or "accepted: passed validation", answer=r.text[:2000]))
            if not why:
                return result
            failures.append(why)
        return None

    async def backend(self, env: str, synth: SynthEnv, atts: Sequence[Attribution]) -> str | None:
        """A revised backend for the synthesised environment ``env``, validated in the sandbox; the new served
        module's source when accepted, else None (``synth`` is then unchanged)."""
        from treadle.weft.evolve.synth_validate import validate

        res = synth.result
        current = res.backend.source

        async def check(new: Backend):
            if new.source == current:
                return None, "the answer is the current backend unchanged"
            failures, facts = validate(res.design, res.schema_, new, res.checks, limits=synth.limits)
            if failures:
                return None, "validation failed: " + "; ".join(f"[{f.stage.value}] {f.detail}" for f in failures)[:800]
            return new, ""

        ctx = {"design": res.design.model_dump(), "schema": res.schema_.model_dump(), "current": {"source": current},
               "evidence": _evidence(atts)}
        new = await self._propose(f"backend:{env}", "backend", "The environment's backend is blamed for these failed "
                                  "checkpoints. Write the whole revised backend (one function def <tool>(db, **params) "
                                  "per tool, db a sqlite3.Connection; raise ValueError for a request that must fail).",
                                  ctx, Backend, check)
        if new is None:
            return None
        revised = res.model_copy(update={"backend": new})
        old = synth.result
        synth.result = revised
        try:
            return synth.source()
        except ValueError:  # SynthServeError: not servable; keep what was accepted before
            synth.result = old
            self.log.append(RevisionAttempt(component=f"backend:{env}", role=REVISE_ROLES["backend"], attempt=-1,
                                            accepted=False, detail="validated but not servable; kept the old backend"))
            return None

    async def task(self, rt: Any, server_hash: str, slot: Any, att: Attribution) -> Snapshot | None:
        """A revised initial state of ``slot``'s task (rows inserted into its current one), accepted when the task
        certifies from it (the three baselines); the new snapshot, else None."""
        from treadle.weft.evolve.certify import certify_task
        from treadle.weft.evolve.grounding import columns_of, freeze, open_copy

        con = open_copy(slot.start)
        try:
            schema = {t: columns_of(con, t) for (t,) in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")}
            rows = {t: [list(r) for r in con.execute(f"SELECT * FROM {t} ORDER BY 1 LIMIT 20")] for t in schema}
        finally:
            con.close()

        async def check(rev: StateRevision):
            unknown = sorted(set(rev.insert) - set(schema))
            if unknown:
                return None, f"no table(s) {unknown}; tables: {sorted(schema)}"
            c = open_copy(slot.start)
            try:
                for table, new_rows in rev.insert.items():
                    cols = schema[table]
                    for row in new_rows:
                        if len(row) != len(cols):
                            return None, f"a {table} row has {len(row)} values for columns {cols}"
                        c.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                                  row)
                bad = c.execute("PRAGMA foreign_key_check").fetchall()
                if bad:
                    return None, f"foreign keys broken: {bad[:3]}"
                snap = freeze(c)
            except (sqlite3.Error, TypeError, ValueError) as err:
                return None, f"the rows do not insert: {type(err).__name__}: {err}"
            finally:
                c.close()
            cert = await certify_task(rt, server_hash, snap, slot.task.model_copy(update={"checkpoint": slot.spec}))
            if not cert.certified:
                return None, "the task does not certify from the revised state: " + "; ".join(cert.reasons)[:600]
            return snap, ""

        ctx = {"request": slot.task.request, "reference_calls": [str(c) for c in slot.evidence.calls],
               "tables": schema, "current_rows": rows, "evidence": _evidence([att])}
        return await self._propose(f"task:{slot.task.name}", "task", "The task's initial state is blamed: something "
                                   "the task needs is missing from it. Give the rows to insert.", ctx, StateRevision,
                                   check)

    async def verifier(self, rt: Any, server_hash: str, slot: Any, att: Attribution) -> CheckpointSpec | None:
        """A revised verifier of ``slot``, accepted when the reference plan passes it and a do-nothing agent does
        not (its SQL read-only); the new spec, else None."""
        from treadle.weft.evolve.certify import play

        async def check(rev: VerifierRevision):
            update = {k: v for k, v in rev.model_dump(exclude={"reason"}).items() if v is not None}
            if not update:
                return None, "the answer revises nothing"
            if rev.assertions is not None:
                update["assertions"] = list(rev.assertions)
                for a in rev.assertions:
                    why = read_only_sql(a.sql, slot.start)
                    if why:
                        return None, why
            if rev.gold_calls is not None:
                update["gold_calls"] = list(rev.gold_calls)
            spec = slot.spec.model_copy(update=update)
            if spec.model_dump_json(exclude={"predicates"}) == slot.spec.model_dump_json(exclude={"predicates"}):
                return None, "the answer is the current verifier unchanged"
            _, ref = await play(rt, server_hash, slot.start, spec, list(slot.evidence.calls))
            if ref.r != 1:
                return None, "the revised verifier fails the reference plan: " + "; ".join(ref.details)[:500]
            _, nothing = await play(rt, server_hash, slot.start, spec, [])
            if nothing.r != 0:
                return None, "the revised verifier passes an agent that does nothing"
            return spec, ""

        current = slot.spec.model_dump(mode="json", include={"name", "gold_calls", "assertions", "expected_returns"})
        ctx = {"request": slot.task.request, "current": current, "evidence": _evidence([att]),
               "reference": {"calls": [str(c) for c in slot.evidence.calls],
                             "results": json.loads(json.dumps(list(slot.evidence.results), default=str))}}
        return await self._propose(f"verifier:{slot.task.name}", "verifier", "The verifier is blamed: it fails what the "
                                   "reference plan does. Give the revised fields of the check.", ctx, VerifierRevision,
                                   check)

    async def composed(self, rt: Any, hashes: dict[str, str], task: Any, certified: Any,
                       verdicts: Sequence[Any]) -> Any:
        """A revision of the composed ``task`` for what ``verdicts`` leave undecided (:func:`undecided_parts`),
        accepted when it changes only those parts and the task re-certifies by execution with its bindings holding;
        the revised :class:`~treadle.weft.evolve.compose.ComposedTask`, else None. Without a ``composer`` role in
        the client's config the request is recorded as not made (never raised)."""
        from treadle.weft.runtime.callparse import ToolCall
        from treadle.weft.evolve.composed_revise import component_digests, recertify_composed
        from treadle.weft.rollouts.tasks import details_of

        parts = undecided_parts(task, certified, verdicts)
        if not parts:
            return None
        component, role = f"composed:{task.name}", REVISE_ROLES["composed"]
        roles = getattr(getattr(self.client, "config", None), "roles", None)
        if roles is not None and role not in roles:
            self.log.append(RevisionAttempt(component=component, role=role, attempt=-1, accepted=False,
                                            detail=f"not asked: no role {role!r} in the LLM config; left as it was"))
            return None
        before = component_digests(task)

        async def check(rev: ComposedRevision):
            by = {n.name: n for n in task.nodes}
            unknown = sorted({*rev.depends_on, *(a.node for a in rev.arguments)} - set(by))
            if unknown:
                return None, f"no node(s) {unknown}; nodes: {sorted(by)}"
            nodes = dict(by)
            for name, deps in rev.depends_on.items():
                d = tuple(deps)
                nodes[name] = nodes[name].model_copy(update={"depends_on": d, "atomic": nodes[name].atomic.model_copy(
                    update={"depends_on": d})})
            for a in rev.arguments:
                node = nodes[a.node]
                calls = list(node.atomic.checkpoint.gold_calls or [])
                if a.call >= len(calls) or a.arg not in calls[a.call].arguments:
                    return None, f"node {a.node!r} has no argument {a.arg!r} in call {a.call}"
                calls[a.call] = ToolCall(name=calls[a.call].name, arguments={**calls[a.call].arguments, a.arg: a.value})
                spec = node.atomic.checkpoint.model_copy(update={"gold_calls": calls})
                nodes[a.node] = node.model_copy(update={"atomic": node.atomic.model_copy(
                    update={"checkpoint": spec, "details": details_of(node.atomic.request, spec)})})
            new = task.model_copy(update={"nodes": tuple(nodes[n.name] for n in task.nodes)})
            after = component_digests(new)
            changed = sorted(k for k in after if after[k] != before.get(k))
            if not changed:
                return None, "the answer changes nothing"
            outside = [c for c in changed if c not in parts]
            if outside:
                return None, f"the answer changes {outside}, which are not blamed (only {parts} are)"
            cert = await recertify_composed(rt, new, hashes)
            if not cert.certified:
                return None, "the revised composed task does not certify: " + "; ".join(cert.reasons)[:600]
            return new, ""

        ctx = {"undecided_parts": parts, "evidence": [v.attribution.model_dump(mode="json", include={
                   "checkpoint", "blame", "rule", "detail", "span"}) for v in verdicts],
               "nodes": [{"name": n.name, "server": n.server, "depends_on": list(n.depends_on), "request":
                          n.atomic.request, "gold_calls": [str(c) for c in n.atomic.checkpoint.gold_calls or []]}
                         for n in task.nodes],
               "certified_dag": {n.name: list(n.depends_on) for n in certified.nodes},
               "bindings": [b.model_dump(mode="json") for b in task.bindings]}
        return await self._propose(component, "composed", "A composed cross-server task has a fault the certified "
                                   "DAG and bindings cannot repair. Revise only the undecided parts: node "
                                   "dependencies and/or gold-call arguments.", ctx, ComposedRevision, check)

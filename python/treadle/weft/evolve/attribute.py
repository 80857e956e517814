"""Deterministic failure attribution: policy, environment, task, harness or evaluator (seed: WEFT 5.1).

A failed checkpoint is blamed on the component that must be repaired, using every deterministic
signal before any model is asked (an LLM attributor, when one is configured, only sees what this
leaves :attr:`Blame.undecided`):

1. **task**: the entities the reference plan names (through the tool contracts and the server's
   entity map, or inside nested arguments by a table's primary-key name, e.g. an order line's ``sku``)
   do not exist in the turn's start state: the task's preconditions do not hold (rule ``precondition``);
2. **environment**: the reference plan fails to execute from the start state, or it executes but its
   results or state change differ from the *reference evidence* recorded when the task was
   certified on a healthy server (an update that no longer persists, a wrong return value) -- unless
   the start state is not the one the task was certified from and the reference fails or differs
   from it on the *certified* server too: then the start state is at fault, **task** (rule
   ``precondition_state``; any backend, e.g. BFCL object state, which has no entity map). From a start
   other than the certified one, "differs" compares the change the reference makes (start -> final)
   with the certified change, not the final states;
3. **evaluator**: the reference plan executes as certified but the verifier fails it (the check was
   not tested on the reference evidence) -- unless the start state is not the certified one and the verifier
   passes the reference played from the certified start: a check of the final state then fails only because the
   start lost something (an entity the reference names but does not need to act), **task** (``precondition_state``);
4. the checks off the reference's path, when the caller gives the task's request, the harness or the
   forbidden tools (the evolution loop always does; :mod:`~treadle.weft.evolve.attribute_more`): a
   forbidden tool called (**policy**), a harness that cannot carry the reference calls (**harness**), a
   policy call or a schema-allowed input the certified server treats otherwise than the current one, or a
   call that breaks its tool's contract (**environment**), a request that is inconsistent, names another
   party than the gold acts for, or does not give the gold's values (**task**), a state that differs from
   the reference's only in faithfully paraphrased free text (**evaluator**; undecided where the offline
   comparison cannot place the text);
5. **evaluator**: the policy did exactly what the reference did (same results, same state) and is still
   failed; a rubric judge and the executable check disagree on a trajectory that reproduces the reference;
6. cross-harness pattern: a task that fails under every one of at least ``min_harnesses`` harnesses
   while its reference passes points away from the policy but says nothing of where: **undecided**,
   left to :func:`llm_attribute` (only when different policies stand behind the harnesses); a failure under
   one harness only whose harness carries the reference calls is the policy's (``interaction_adaptation``);
7. otherwise **policy** (the task is valid and the policy is at fault).

Every verdict stores its evidence beside it: the turn's calls (trajectory span), the state diff of
the reference against the evidence, and the check results.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.evolve.entities import ENTITY_MAPS, EntityMap, contract_column, identity_of
from treadle.weft.runtime import ToolOutcome
from treadle.weft.runtime.sqlite_state import SqliteState
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointResult, CheckpointSpec, StateAssertion
from treadle.untrusted import loads_json


class Blame(str, Enum):
    """Where a failed checkpoint's fault lies."""

    policy = "policy"
    environment = "environment"
    task = "task"
    evaluator = "evaluator"
    harness = "harness"
    undecided = "undecided"


class ReferenceEvidence(BaseModel):
    """What the reference plan did when the task was certified on a healthy server.

    Attributes:
        task: atomic task name; calls: the reference plan (the certified gold calls; attribution replays
            these, never the verifier's possibly defective copy); results: their results, in order.
        final: the state after the gold calls (SQLite snapshot bytes are kept out of JSON: ``final_digest``).
        final_digest: digest of that state.
        start: the state the task was certified from (None when not recorded: the ``precondition_state``
            rule is then off); server_hash: the healthy server it was certified on.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    task: str
    calls: tuple[ToolCall, ...]
    results: tuple[Any, ...]
    final: Snapshot = Field(exclude=True)
    final_digest: str
    start: Snapshot | None = Field(None, exclude=True)
    server_hash: str | None = None


class Attribution(BaseModel):
    """The verdict on one failed checkpoint, with its evidence."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str
    blame: Blame
    rule: str
    detail: str = ""
    turn: int = 0
    span: list[str] = Field(default_factory=list, description="the turn's calls, as call strings")
    reference_diff: dict[str, dict[str, int]] = Field(default_factory=dict,
                                                      description="reference final state vs evidence, counts")
    check: list[str] = Field(default_factory=list, description="the failed check's details")
    llm: dict[str, Any] | None = Field(None, description="the LLM attributor's answer and role, when it decided")


def _public(diff: Any) -> Any:
    from treadle.weft.runtime.verify import filter_diff

    return filter_diff(diff, (), compare_private=False)


async def record_evidence(rt: Any, server_hash: str, start: Snapshot, name: str,
                          gold: Sequence[ToolCall]) -> ReferenceEvidence:
    """Run ``gold`` from ``start`` on a healthy server and keep what it did (raises ValueError when a call fails:
    a task whose reference does not execute is not certified)."""
    sid = await rt.create_session(server_hash, start)
    try:
        results = []
        for c in gold:
            o = await rt.call_tool(sid, c.name, c.arguments)
            if not o.ok:
                raise ValueError(f"{name}: reference call {c} failed: {o.text[:200]}")
            results.append(o.result)
        final = rt.snapshot(sid)
    finally:
        await rt.close(sid)
    return ReferenceEvidence(task=name, calls=tuple(gold), results=tuple(results), final=final,
                             final_digest=final.digest, start=start, server_hash=rt.registry.spec(server_hash).hash)


def generate_verifier(spec: CheckpointSpec, start: Snapshot, evidence: ReferenceEvidence,
                      request: str | None = None) -> CheckpointSpec:
    """The deterministic check of a task, made from its reference evidence (seed: WEFT 5.1 verifier generation):
    the spec's gold-replay checks plus, for every table the reference changed, an SQL assertion that its
    rows equal the evidence's, and the reference's results as expected returns. The generated check holds
    independently of the server it later runs against (an environment bug then fails it). For object state
    (BFCL classes) the state check is a predicate: public attributes equal the evidence's.

    With ``request`` (SQLite state), free text the reference wrote (a value with spaces) is compared by meaning
    unless the request quotes it (:func:`~treadle.weft.evolve.text_checks.text_verdict`): the state check is then
    one predicate, the final state equals the evidence's up to free text that says the same, instead of the gold
    replay's byte-for-byte comparison and the SQL assertions."""
    returns = [r for r in evidence.results if r not in (None, [], {})]
    if request is not None and start.kind == "sqlite":
        semantic = _semantic_state_check(start, evidence, request)
        if semantic is not None:
            return spec.model_copy(update={"compare_state": False, "predicates": [*spec.predicates, semantic],
                                           "expected_returns": [*spec.expected_returns, *returns]})
    if start.kind != "sqlite":
        def matches_reference(obj: Any) -> bool:
            from treadle.weft.runtime.object_state import ObjectState, snapshot_from_object

            ref = ObjectState(evidence.final, type(obj))
            try:
                return _public(ref.diff(snapshot_from_object(obj))).empty
            finally:
                ref.close()

        return spec.model_copy(update={"predicates": [*spec.predicates, matches_reference],
                                       "expected_returns": [*spec.expected_returns, *returns]})
    diff = SqliteState(start).diff(evidence.final)
    con = SqliteState(evidence.final)
    try:
        asserts = []
        for table in sorted(diff.tables):
            rows = [list(r) for r in con.handle.execute(f"SELECT * FROM {table} ORDER BY 1, 2")]
            asserts.append(StateAssertion(sql=f"SELECT * FROM {table} ORDER BY 1, 2", expected=rows,
                                          description=f"{table} as the reference left it"))
    finally:
        con.close()
    return spec.model_copy(update={"assertions": [*spec.assertions, *asserts],
                                   "expected_returns": [*spec.expected_returns, *returns]})


def _semantic_state_check(start: Snapshot, evidence: ReferenceEvidence, request: str) -> Any:
    """The predicate of :func:`generate_verifier`'s free-text mode, or None when the reference wrote no free text
    the request does not quote (the exact checks are then right)."""
    from treadle.weft.evolve.text_checks import free_text_only_diff, quoted, text_verdict
    from treadle.weft.runtime.sqlite_state import diff_connections

    st = SqliteState(start)
    try:
        diff = st.diff(evidence.final)
    finally:
        st.close()
    quotes = {q.strip().lower() for q in quoted(request)}
    texts = [v for td in diff.tables.values() for r in [*td.added.values(), *(c.after for c in td.changed.values())]
             for v in r.values() if isinstance(v, str) and " " in v.strip() and v.strip().lower() not in quotes]
    if not texts:
        return None
    final = evidence.final

    def matches_reference_up_to_paraphrase(con: Any) -> bool:
        ref = SqliteState(final)
        try:
            d = diff_connections(ref.handle, con)
        finally:
            ref.close()
        if d.empty:
            return True
        pairs = free_text_only_diff(d)
        return pairs is not None and all(text_verdict(a, b, request) == "same" for a, b in pairs)

    return matches_reference_up_to_paraphrase


def missing_entities(con: Any, emap: EntityMap, tools: dict[str, dict], gold: Sequence[ToolCall]) -> list[str]:
    """The entities named by ``gold``'s arguments (contract ``args_to_state`` columns of the entity map) that have
    no row in ``con``; references to entities the server does not store are not checked."""
    out = []
    for c in gold:
        a2s = ((tools.get(c.name) or {}).get("contract") or {}).get("args_to_state", {})
        for arg, value in c.arguments.items():
            col = contract_column(a2s, arg)
            hit = emap.attribute_of(col) if col else None
            if hit is None or value is None or emap.kinds[hit[0]].table is None:
                continue
            if col.split(".")[0] != emap.kinds[hit[0]].table and hit[1] != "id":
                continue
            if identity_of(con, emap, hit[0], hit[1], value) is None or not _exists(con, emap, hit[0], hit[1], value):
                out.append(f"{c.name}.{arg}={value!r} ({hit[0]})")
    return out + missing_nested(con, gold)


def missing_nested(con: Any, gold: Sequence[ToolCall]) -> list[str]:
    """References inside nested arguments (``items=[{"sku": "MUG"}]``) to rows that do not exist: a key that is
    the single-column primary key of a table (``products.sku``) names a row of that table."""
    keys: dict[str, str] = {}
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
        pk = [r[1] for r in con.execute(f"PRAGMA table_info({t})") if r[5]]
        if len(pk) == 1 and pk[0] != "id":
            keys.setdefault(pk[0], t)
    out = []
    for c in gold:
        for arg, value in c.arguments.items():
            for item in value if isinstance(value, list) else []:
                for k, v in (item.items() if isinstance(item, dict) else ()):
                    t = keys.get(k)
                    if t and con.execute(f"SELECT 1 FROM {t} WHERE {k} = ?", (v,)).fetchone() is None:
                        out.append(f"{c.name}.{arg}[].{k}={v!r} ({t})")
    return out


def _exists(con: Any, emap: EntityMap, kind: str, attr: str, value: Any) -> bool:
    k = emap.kinds[kind]
    col = next((c.split(".")[1] for c, a in k.columns.items() if a == attr and c.startswith(k.table + ".")), None)
    if col is None:
        return True
    return con.execute(f"SELECT 1 FROM {k.table} WHERE {col} = ?", (value,)).fetchone() is not None


async def _replay_reference(rt: Any, sid: str, gold: Sequence[ToolCall]) -> tuple[list[ToolOutcome], Any]:
    """The reference's outcomes in session ``sid``, and ``(call, outcome)`` of the first that failed (else None)."""
    ref = []
    for c in gold:
        o = await rt.call_tool(sid, c.name, c.arguments)
        ref.append(o)
        if not o.ok:
            return ref, (c, o)
    return ref, None


def _differs(rt: Any, sid: str, ref: Sequence[ToolOutcome], spec: CheckpointSpec, evidence: ReferenceEvidence,
             change: Any = None) -> tuple[str, Any]:
    """("results" | "state" | "", state diff) of a reference replayed in ``sid``. From the certified start
    (``change`` None) its final state must be the evidence's; from another start, the change it made must be
    ``change`` (the certified change: evidence start -> evidence final)."""
    diff = rt.diff(sid, evidence.final) if change is None else rt.diff(sid)
    if not spec.compare_private:  # BFCL: public attributes only, as upstream's checker
        diff = _public(diff)
    results = tuple(o.result for o in ref)
    bad = not diff.empty if change is None else diff != change
    return ("results" if results != evidence.results else "state" if bad else ""), diff


async def _certified_change(rt: Any, start: Snapshot, spec: CheckpointSpec, evidence: ReferenceEvidence) -> Any:
    """None when ``start`` is the certified start (or that is unknown here), else the certified change."""
    healthy = evidence.server_hash
    if evidence.start is None or evidence.start.digest == start.digest or healthy not in rt.registry:
        return None
    sid = await rt.create_session(healthy, evidence.start)
    try:
        d = rt.diff(sid, evidence.final)
    finally:
        await rt.close(sid)
    return d if spec.compare_private else _public(d)


async def _start_state_at_fault(rt: Any, server_hash: str, start: Snapshot, spec: CheckpointSpec,
                                evidence: ReferenceEvidence, change: Any, base: dict[str, Any]) -> Attribution | None:
    """A ``task`` verdict when ``start`` is not the certified start and the reference, failing or differing on the
    server as it is now, fails or differs from ``start`` on the certified server too (the initial state lost
    something the task needs); None otherwise (the server as it is now is at fault)."""
    if change is None:
        return None
    healthy = evidence.server_hash
    if healthy != rt.registry.spec(server_hash).hash:  # another server now: does the certified one reproduce?
        sid = await rt.create_session(healthy, start)
        try:
            ref, fails = await _replay_reference(rt, sid, evidence.calls)
            if fails is None and not _differs(rt, sid, ref, spec, evidence, change)[0]:
                return None
        finally:
            await rt.close(sid)
    sid = await rt.create_session(healthy, evidence.start)
    try:
        d = rt.diff(sid, start)
    finally:
        await rt.close(sid)
    if not spec.compare_private:
        d = _public(d)
    return Attribution(blame=Blame.task, rule="precondition_state", reference_diff=d.counts(),
                       detail="the reference fails or differs from this start state on the certified server too: the "
                              "start state is not the one the task was certified from (reference_diff: certified start "
                              "-> this start)", **base)


async def _passes_certified(rt: Any, spec: CheckpointSpec, evidence: ReferenceEvidence) -> bool:
    """The verifier passes the reference played from the certified start on the certified server."""
    sid = await rt.create_session(evidence.server_hash, evidence.start)
    try:
        ref, fails = await _replay_reference(rt, sid, evidence.calls)
        return fails is None and (await rt.verify_turn(sid, evidence.start, spec, ref)).r == 1
    finally:
        await rt.close(sid)


async def attribute(rt: Any, server_hash: str, start: Snapshot, spec: CheckpointSpec, evidence: ReferenceEvidence,
                    outcomes: Sequence[ToolOutcome], verdict: CheckpointResult, *, turn: int = 0,
                    rubric_pass: bool | None = None, harness_verdicts: dict[str, int] | None = None,
                    min_harnesses: int = 3, request: str | None = None, harness: Any = None,
                    forbidden: Sequence[str] = (), history: Sequence[Any] = (), healthy: str | None = None,
                    every_harness_rule: bool = True) -> Attribution:
    """Attribute one failed checkpoint (``verdict.r == 0``) deterministically (see the module docstring).

    Args:
        rt: open runtime; server_hash: the server as it is now (possibly broken).
        start: the turn's start state; spec: the verifier as it is now (possibly defective).
        evidence: the reference evidence recorded at certification.
        outcomes, verdict: the policy's calls in the turn and the verifier's verdict on them.
        rubric_pass: a rubric judge's pass/fail on the same trajectory, if any.
        harness_verdicts: ``{harness: r}`` of the same task under each harness, if known.
        request: the task's request: turns on the task checks (:mod:`~treadle.weft.evolve.task_checks`) and the
            free-text comparison (:mod:`~treadle.weft.evolve.text_checks`); None leaves them off.
        harness: the harness the policy's calls went through: checked by :func:`~treadle.weft.evolve.probes.
            harness_faults` (a harness that cannot carry the reference calls is blamed, ``harness``).
        forbidden: tools the task forbids besides the verifier's ``forbidden_tools``.
        history: earlier results the policy could read (a composed node's upstream results).
        healthy: the certified server (default ``evidence.server_hash``) for the off-path replays.
        every_harness_rule: a failure under every harness points away from the policy; off when one policy is
            behind every harness (the evolution loop), where it says nothing.

    Raises:
        ValueError: ``verdict`` passed (nothing to attribute).
    """
    if verdict.r != 0:
        raise ValueError(f"checkpoint {verdict.name!r} passed; only failed checkpoints are attributed")
    gold = list(evidence.calls)
    base = {"checkpoint": verdict.name, "turn": turn, "span": [str(o.call) for o in outcomes],
            "check": list(verdict.details)}
    reg = rt.registry.spec(server_hash)
    emap = ENTITY_MAPS.get(reg.name)
    if emap is not None and reg.backend == "sqlite":
        db = SqliteState(start)
        try:
            missing = missing_entities(db.handle, emap, {t["name"]: t for t in reg.tools}, gold)
        finally:
            db.close()
        if missing:
            return Attribution(blame=Blame.task, rule="precondition", detail=f"not in the start state: {missing}",
                               **base)
    change = await _certified_change(rt, start, spec, evidence)
    sid = await rt.create_session(server_hash, start)
    try:
        ref, fails = await _replay_reference(rt, sid, gold)
        if fails is not None:
            c, o = fails
            blamed = await _start_state_at_fault(rt, server_hash, start, spec, evidence, change, base)
            return blamed or Attribution(blame=Blame.environment, rule="reference_fails",
                                         detail=f"{c}: {o.error_kind.value if o.error_kind else '?'}: {o.text[:200]}",
                                         **base)
        what, diff = _differs(rt, sid, ref, spec, evidence, change)
        if what:
            blamed = await _start_state_at_fault(rt, server_hash, start, spec, evidence, change, base)
            return blamed or Attribution(blame=Blame.environment, rule="reference_differs",
                                         detail=f"the reference's {what} differ from the certified evidence",
                                         reference_diff=diff.counts(), **base)
        ref_verdict = await rt.verify_turn(sid, start, spec, ref)
    finally:
        await rt.close(sid)
    if ref_verdict.r == 0:
        if change is not None and await _passes_certified(rt, spec, evidence):
            return Attribution(blame=Blame.task, rule="precondition_state", detail=(
                "the reference makes the certified change from this start state and the verifier passes it from the "
                "certified start, not from this one: the start state is not the one the task was certified from"),
                **base)
        return Attribution(blame=Blame.evaluator, rule="reference_rejected",
                           detail="the verifier fails the reference plan: " + "; ".join(ref_verdict.details)[:300],
                           **base)
    if request is not None or harness is not None or forbidden:
        from treadle.weft.evolve.attribute_more import further_checks

        found = await further_checks(rt, server_hash, start, spec, evidence, outcomes, request=request,
                                     harness=harness, forbidden=forbidden, history=history, healthy=healthy,
                                     harness_verdicts=harness_verdicts)
        if found is not None:
            blame, rule, detail = found
            return Attribution(blame=blame, rule=rule, detail=detail[:500], **base)
    ok_results = [o.result for o in outcomes if o.ok]
    if all(any(r == x for x in ok_results) for r in evidence.results) and verdict.diff is not None \
            and verdict.diff.empty and all(o.ok for o in outcomes):
        return Attribution(blame=Blame.evaluator, rule="reproduces_reference",
                           detail="the policy reproduced the reference's results and state and was still failed",
                           **base)
    if rubric_pass:
        return Attribution(blame=Blame.evaluator, rule="rubric_disagrees",
                           detail="a rubric judge passes what the executable check fails", **base)
    hv = harness_verdicts or {}
    if every_harness_rule and len(hv) >= min_harnesses and not any(hv.values()):
        return Attribution(blame=Blame.undecided, rule="fails_every_harness",
                           detail=f"fails under every harness {sorted(hv)} while the reference passes: not the "
                                  "policy's, but no executable signal says whose (see llm_attribute)", **base)
    rule = "interaction_adaptation" if hv and sum(1 for v in hv.values() if not v) == 1 else "reference_passes"
    return Attribution(blame=Blame.policy, rule=rule, detail="the reference passes; the policy's calls do not", **base)


_LLM_BLAMES = (Blame.policy, Blame.environment, Blame.task, Blame.evaluator, Blame.harness)


async def llm_attribute(client: Any, att: Attribution, *, role: str = "attributor", request: str = "") -> Attribution:
    """Ask an LLM role to decide an :attr:`Blame.undecided` attribution from its recorded evidence (the
    trajectory span, the failed check, the reference diff, the deterministic rule that abstained).

    The answer must be a JSON object ``{"blame": "policy"|"environment"|"task"|"evaluator"|"harness",
    "reason": str}``;
    the raw answer is stored in :attr:`Attribution.llm`. A failed call or an answer of another shape leaves
    the attribution undecided with the problem recorded (never an exception). Decided attributions are
    returned unchanged (the deterministic path always comes first).
    """
    if att.blame != Blame.undecided:
        return att
    from treadle.llm import LLMCallError

    evidence = att.model_dump(mode="json", exclude={"llm", "blame"})
    messages = [{"role": "system", "content": "You attribute failed checkpoints of tool-use tasks to the component "
                                              "at fault: policy, environment, task, evaluator or harness (the "
                                              "prompt and parser between the policy and the tools). Answer with one "
                                              'JSON object {"blame": ..., "reason": ...}.'},
                {"role": "user", "content": json.dumps({"request": request, "evidence": evidence}, sort_keys=True)}]
    try:
        r = await client.chat(messages, role=role, tag="weft-attribution")
    except LLMCallError as err:
        return att.model_copy(update={"llm": {"role": role, "error": f"{err.failure.kind.value}: {err.failure.message}"}})
    try:
        doc = loads_json(re.sub(r"^```(?:json)?|```$", "", r.text.strip()).strip(), duplicates=True)
        blame = Blame(doc["blame"])
        reason = str(doc.get("reason", ""))
        if blame not in _LLM_BLAMES:
            raise ValueError(f"blame must be one of {[b.value for b in _LLM_BLAMES]}")
    except (ValueError, KeyError, TypeError) as err:
        return att.model_copy(update={"llm": {"role": role, "answer": r.text[:2000], "error": f"malformed: {err}"}})
    return att.model_copy(update={"blame": blame, "rule": f"llm({att.rule})", "detail": reason[:500],
                                  "llm": {"role": role, "answer": r.text[:2000]}})

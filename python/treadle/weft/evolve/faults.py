"""Fault-injection suite: how often deterministic attribution blames the component that was broken.

Built over certified atomic tasks of the native environments (and BFCL classes, see
:mod:`~treadle.weft.evolve.faults_bfcl`). Each case injects exactly one fault with a known label:

- **environment**: the server's source is patched (an update that does not persist, a wrong return
  value, a tool that raises) and registered as a server of its own;
- **task**: an entity the task names is deleted from its initial state (one the entity maps describe,
  and one named only inside a nested argument, e.g. an order line's product, which they do not);
- **evaluator**: the generated verifier is corrupted (a wrong expected value in a state assertion,
  a wrong expected return, a wrong gold argument);
- **policy**: healthy server, task and verifier; the rollouts' replay policy perturbs the reference
  calls (``wrong_argument``, ``skipped_call``, ``extra_call``) through a harness.

For the three non-policy kinds the agent plays the reference exactly (a correct policy). A case whose
checkpoint still passes is *unobserved* (the fault does not show in this task) and left out of the
accuracy; the rest are attributed by :func:`~treadle.weft.evolve.attribute.attribute` and counted in
a confusion matrix (label x blame).
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.evolve.attribute import (
    Attribution,
    Blame,
    ReferenceEvidence,
    attribute,
    generate_verifier,
    record_evidence,
)
from treadle.weft.evolve.certify import play
from treadle.weft.evolve.entities import ENTITY_MAPS, contract_column
from treadle.weft.evolve.grounding import freeze, open_copy
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointSpec

LABELS = (Blame.policy, Blame.environment, Blame.task, Blame.evaluator, Blame.harness)


class EnvBug(BaseModel):
    """A source patch of one tool: ``old`` (must occur exactly once) becomes ``new``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    tool: str
    old: str
    new: str


SHOP_BUGS = (
    EnvBug(name="ship_not_persisted", tool="ship_order",
           old="db.execute(\"UPDATE orders SET status = 'shipped' WHERE id = ?\", (order_id,))", new="pass"),
    EnvBug(name="order_total_wrong", tool="place_order", old='return {"order_id": oid, "total_cents": total}',
           new='return {"order_id": oid, "total_cents": total + 100}'),
    EnvBug(name="cancel_no_restock", tool="cancel_order",
           old='db.execute("UPDATE products SET stock = stock + ? WHERE sku = ?", (it["qty"], it["sku"]))', new="pass"),
    EnvBug(name="ticket_id_wrong", tool="open_ticket", old='return {"ticket_id": cur.lastrowid}',
           new='return {"ticket_id": cur.lastrowid + 1}'),
    EnvBug(name="get_order_crashes", tool="get_order", old="    return _order(db, order_id)\n",
           new="    raise RuntimeError('backend down')\n"),
)
CRM_BUGS = (
    EnvBug(name="tier_not_persisted", tool="set_tier",
           old='db.execute("UPDATE contacts SET tier = ? WHERE id = ?", (tier, contact_id))', new="pass"),
    EnvBug(name="escalate_writes_low", tool="escalate_case", old="UPDATE cases SET priority = 'high'",
           new="UPDATE cases SET priority = 'low'"),
    EnvBug(name="credit_amount_wrong", tool="issue_credit",
           old='return {"credit_id": cur.lastrowid, "amount_cents": amount_cents}',
           new='return {"credit_id": cur.lastrowid, "amount_cents": amount_cents // 2}'),
    EnvBug(name="note_not_persisted", tool="add_note",
           old='db.execute("INSERT INTO notes (case_id, body) VALUES (?, ?)", (case_id, body))', new="pass"),
    EnvBug(name="case_id_wrong", tool="open_case", old='return {"case_id": cur.lastrowid}',
           new='return {"case_id": cur.lastrowid + 10}'),
    EnvBug(name="resolve_crashes", tool="resolve_case", old="    _open_case(db, case_id)\n    db.execute(\"UPDATE cases SET status = 'resolved'",
           new="    raise RuntimeError('backend down')\n    db.execute(\"UPDATE cases SET status = 'resolved'"),
)
BUGS = {"shop": SHOP_BUGS, "crm": CRM_BUGS}

POLICY_PERTURBATIONS = ("wrong_argument", "skipped_call", "extra_call")


def patch_source(source: str, bug: EnvBug) -> str:
    """``source`` with ``bug`` applied. Raises ValueError when ``bug.old`` does not occur exactly once."""
    n = source.count(bug.old)
    if n != 1:
        raise ValueError(f"bug {bug.name!r}: its target occurs {n} times in the source (expected exactly once)")
    return source.replace(bug.old, bug.new)


class CaseResult(BaseModel):
    """One injected fault: its label, whether the checkpoint failed, and the attribution."""

    model_config = ConfigDict(extra="forbid")

    id: str
    env: str
    task: str
    label: Blame
    fault: str
    observed: bool
    attribution: Attribution | None = None

    @property
    def correct(self) -> bool:
        return self.observed and self.attribution is not None and self.attribution.blame == self.label


class SuiteReport(BaseModel):
    """The cases, the confusion matrix ``{label: {blame: count}}`` over observed cases, and the accuracy."""

    model_config = ConfigDict(extra="forbid")

    cases: list[CaseResult]
    confusion: dict[str, dict[str, int]] = Field(default_factory=dict)

    @property
    def observed(self) -> list[CaseResult]:
        return [c for c in self.cases if c.observed]

    @property
    def accuracy(self) -> float:
        obs = self.observed
        return sum(c.correct for c in obs) / len(obs) if obs else 0.0

    def table(self) -> list[list[str]]:
        """Rows of the confusion matrix with a header (label, then one column per blame, then accuracy)."""
        cols = [b.value for b in (*LABELS, Blame.undecided)]
        rows = [["injected \\ attributed", *cols, "n", "correct"]]
        for lab in LABELS:
            counts = self.confusion.get(lab.value, {})
            n = sum(counts.values())
            rows.append([lab.value, *(str(counts.get(c, 0)) for c in cols), str(n),
                         f"{counts.get(lab.value, 0) / n:.0%}" if n else "-"])
        return rows


def confusion(cases: Sequence[CaseResult]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for c in cases:
        if c.observed and c.attribution is not None:
            row = out.setdefault(c.label.value, {})
            row[c.attribution.blame.value] = row.get(c.attribution.blame.value, 0) + 1
    return out


async def run_case(rt: Any, *, case_id: str, env: str, task: AtomicTask, label: Blame, fault: str,
                   server_hash: str, start: Snapshot, spec: CheckpointSpec, calls: Sequence[ToolCall],
                   evidence: ReferenceEvidence, as_loop: bool = False) -> CaseResult:
    """Play ``calls`` on ``server_hash`` from ``start``, judge with ``spec``; attribute if the checkpoint fails
    (``as_loop``: with what the evolution loop passes, :func:`~treadle.weft.evolve.loop.attribute_failure`)."""
    outs, verdict = await play(rt, server_hash, start, spec, calls)
    if verdict.r == 1:
        return CaseResult(id=case_id, env=env, task=task.name, label=label, fault=fault, observed=False)
    if as_loop:
        from treadle.weft.evolve.loop import TaskSlot, attribute_failure
        from treadle.weft.rollouts.harnesses import HermesHarness

        slot = TaskSlot(env=env, task=task, start=start, spec=spec, evidence=evidence, certified_start=start)
        att = await attribute_failure(rt, slot, server_hash, outs, verdict, harness=HermesHarness())
    else:
        att = await attribute(rt, server_hash, start, spec, evidence, outs, verdict)
    return CaseResult(id=case_id, env=env, task=task.name, label=label, fault=fault, observed=True, attribution=att)


def delete_entity(start: Snapshot, env: str, tools: dict[str, dict], gold: Sequence[ToolCall]) -> tuple[Snapshot, str] | None:
    """``start`` without the first entity row the gold calls name (a task defect), or None when they name none."""
    emap = ENTITY_MAPS[env]
    for c in gold:
        a2s = ((tools.get(c.name) or {}).get("contract") or {}).get("args_to_state", {})
        for arg, value in c.arguments.items():
            col = contract_column(a2s, arg)
            hit = emap.attribute_of(col) if col else None
            if hit is None or emap.kinds[hit[0]].table is None:
                continue
            k = emap.kinds[hit[0]]
            column = next((x.split(".")[1] for x, a in k.columns.items() if a == hit[1] and x.startswith(k.table + ".")),
                          None)
            if column is None:
                continue
            con = open_copy(start)
            try:
                if con.execute(f"DELETE FROM {k.table} WHERE {column} = ?", (value,)).rowcount:
                    return freeze(con), f"deleted {k.table}.{column}={value!r}"
            finally:
                con.close()
    return None


def delete_nested(start: Snapshot, gold: Sequence[ToolCall]) -> tuple[Snapshot, str] | None:
    """``start`` without the row a *nested* argument names (``items=[{"sku": "MUG"}]`` -> the ``products`` row whose
    ``sku`` is ``MUG``): a task defect on an entity the entity maps do not describe, or None when there is none."""
    con = open_copy(start)
    try:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        for c in gold:
            for value in c.arguments.values():
                for item in value if isinstance(value, list) else []:
                    for key, v in (item.items() if isinstance(item, dict) else ()):
                        for t in tables:
                            cols = [r[1] for r in con.execute(f"PRAGMA table_info({t})")]
                            pk = [r[1] for r in con.execute(f"PRAGMA table_info({t})") if r[5]]
                            if pk == [key] and key in cols and con.execute(
                                    f"DELETE FROM {t} WHERE {key} = ?", (v,)).rowcount:
                                return freeze(con), f"deleted {t}.{key}={v!r}"
        return None
    finally:
        con.close()


def corrupt_verifier(spec: CheckpointSpec, how: str) -> CheckpointSpec | None:
    """A defective copy of a generated verifier (``how`` in ``wrong_expected_value``, ``wrong_expected_return``,
    ``wrong_gold_argument``), or None when the spec has nothing of that kind to corrupt."""
    from treadle.weft.rollouts.policies import mutate_call

    if how == "wrong_expected_value":
        for i, a in enumerate(spec.assertions):
            for r, row in enumerate(a.expected):
                for j, v in enumerate(row):
                    if isinstance(v, int) and not isinstance(v, bool):
                        rows = [list(x) for x in a.expected]
                        rows[r][j] = v + 1
                        new = a.model_copy(update={"expected": rows})
                        return spec.model_copy(update={"assertions": [*spec.assertions[:i], new,
                                                                      *spec.assertions[i + 1:]]})
        return None
    if how == "wrong_expected_return":
        for i, e in enumerate(spec.expected_returns):
            if isinstance(e, dict) and e:
                key = sorted(e)[0]
                v = e[key]
                w = v + 1 if isinstance(v, int) and not isinstance(v, bool) else f"{v}-wrong"
                return spec.model_copy(update={"expected_returns": [*spec.expected_returns[:i], {**e, key: w},
                                                                    *spec.expected_returns[i + 1:]]})
        return None
    if how == "wrong_gold_argument":
        gold = list(spec.gold_calls or [])
        if not gold:
            return None
        return spec.model_copy(update={"gold_calls": [*gold[:-1], mutate_call(gold[-1])]})
    raise ValueError(f"unknown verifier corruption {how!r}")


def perturbed_calls(task: AtomicTask, perturbation: str, seed: int, harness: Any = None) -> list[ToolCall]:
    """The reference calls as the rollouts' replay policy plays them with ``perturbation`` at rate 1, parsed
    back through ``harness`` (Hermes by default): what a policy making that mistake sends."""
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.rollouts.policies import PolicyContext, ReplayPolicy
    from treadle.weft.rollouts.tasks import RolloutTask

    harness = harness or HermesHarness()
    policy = ReplayPolicy({perturbation: 1.0}, seed=seed)
    ctx = PolicyContext(task=RolloutTask(name=task.name, env="fault-suite", atomic=(task,)), atomic=task, index=0,
                        attempt=0, step=0, seed=seed)
    calls = []
    for step in policy.plan(harness, ctx):
        calls.extend(ToolCall(name=c.name, arguments=dict(c.arguments)) for c in harness.parse(step).calls)
    return calls


async def native_suite(rt: Any, envs: Sequence[tuple[Any, Sequence[AtomicTask]]], *, seeds: Sequence[int] = (0,),
                       as_loop: bool = False) -> list[CaseResult]:
    """Every fault kind over every certified task of each ``(server module, certified tasks)`` in ``envs``
    (``as_loop``: attributed with the task's request and harness, as the evolution loop does)."""
    cases: list[CaseResult] = []
    for module, tasks in envs:
        env = module.server.name
        h = rt.register(module)
        tools = {t["name"]: t for t in rt.registry.spec(h).tools}
        start = module.initial_snapshot()
        source = inspect.getsource(module)
        broken = {b.name: (b, rt.register(patch_source(source, b))) for b in BUGS.get(env, ())}
        for task in tasks:
            gold = list(task.checkpoint.gold_calls or [])
            ev = await record_evidence(rt, h, start, task.name, gold)
            spec = generate_verifier(task.checkpoint, start, ev)
            common = {"env": env, "task": task, "start": start, "evidence": ev, "as_loop": as_loop}
            for name, (bug, bh) in broken.items():
                if bug.tool in {c.name for c in gold}:
                    cases.append(await run_case(rt, case_id=f"{env}/{task.name}/env:{name}", label=Blame.environment,
                                                fault=name, server_hash=bh, spec=spec, calls=gold, **common))
            defect = delete_entity(start, env, tools, gold)
            if defect is not None:
                snap, what = defect
                cases.append(await run_case(rt, case_id=f"{env}/{task.name}/task:missing", label=Blame.task,
                                            fault=what, server_hash=h, spec=spec, calls=gold,
                                            **{**common, "start": snap}))
            nested = delete_nested(start, gold)
            if nested is not None:
                snap, what = nested
                cases.append(await run_case(rt, case_id=f"{env}/{task.name}/task:missing-nested", label=Blame.task,
                                            fault=what, server_hash=h, spec=spec, calls=gold,
                                            **{**common, "start": snap}))
            for how in ("wrong_expected_value", "wrong_expected_return", "wrong_gold_argument"):
                bad = corrupt_verifier(spec, how)
                if bad is not None:
                    cases.append(await run_case(rt, case_id=f"{env}/{task.name}/evaluator:{how}",
                                                label=Blame.evaluator, fault=how, server_hash=h, spec=bad,
                                                calls=gold, **common))
            for p in POLICY_PERTURBATIONS:
                for seed in seeds:
                    cases.append(await run_case(rt, case_id=f"{env}/{task.name}/policy:{p}:{seed}",
                                                label=Blame.policy, fault=p, server_hash=h, spec=spec,
                                                calls=perturbed_calls(task, p, seed), **common))
    return cases


def report(cases: Sequence[CaseResult]) -> SuiteReport:
    return SuiteReport(cases=list(cases), confusion=confusion(cases))

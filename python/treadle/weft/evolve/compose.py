"""Composition across servers: ranking, a DAG of certified atomic tasks with entity bindings, grounding.

Seed: WEFT 4.1 ("composition across servers"). From the certified atomic tasks of several servers:

- :func:`rank_combinations` scores server combinations by coverage: shared entity kinds, complementary
  operations (one server writes an entity the other reads or writes), composable certified tasks
  touching shared entities; tools that do the same thing on two servers (same contract shape over the
  same entity kinds) are penalised as redundancy.
- :func:`propose_groups` links tasks that concern the same business object (resolved through the tool
  contracts and the entity maps of :mod:`~treadle.weft.evolve.entities`): a group is coherent when
  it spans at least two servers and every task shares a bound entity with another one.
- :func:`compose` binds the group to a new business object (a new customer and copies of the rows the
  tasks were certified on), rewrites the gold calls and requests through the bindings, grounds the
  state in three rounds (:mod:`~treadle.weft.evolve.grounding`), links the tasks into a DAG (a task
  on the server that owns an entity precedes the tasks that refer to it there) and keeps a node only
  if the reference plan passes its checkpoint by execution, in order.
- :func:`run_composed` runs a composed task in the runtime: one session per server from the grounded
  snapshots, calls routed by tool name, each node judged on its own server (``verify_turn``);
  :mod:`~treadle.weft.evolve.composed_env` serves it to the rollouts layer (every view and harness).
"""
from __future__ import annotations

import graphlib
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from treadle.weft.runtime.callparse import ToolCall, parse_call
from treadle.weft.evolve import grounding as g
from treadle.weft.evolve.entities import ENTITY_MAPS, EntityMap, contract_column, identity_of
from treadle.weft.rollouts.tasks import AtomicTask, DependencyCycleError, details_of
from treadle.weft.runtime import ToolOutcome
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointResult, trajectory_reward


@dataclass
class ServerBundle:
    """A registered server with its initial snapshot, entity map and certified (kept) atomic tasks."""

    name: str
    server_hash: str
    snapshot: Snapshot
    tools: list[dict[str, Any]]
    kept: list[AtomicTask]
    emap: EntityMap = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.emap is None:
            if self.name not in ENTITY_MAPS:
                raise ValueError(f"server {self.name!r} has no entity map; expected one of {sorted(ENTITY_MAPS)}")
            self.emap = ENTITY_MAPS[self.name]

    def contract(self, tool: str) -> dict[str, Any]:
        t = next((t for t in self.tools if t["name"] == tool), None)
        return (t or {}).get("contract") or {}


class Binding(BaseModel):
    """One business object bound across servers: its kind, original identity and new identity, and per server
    the id it had and the id it has in the grounded state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    identity: Any
    new_identity: Any
    ids: dict[str, tuple[Any, Any]]


class Node(BaseModel):
    """One atomic task of a composed task, on one server."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    name: str
    server: str
    atomic: AtomicTask
    depends_on: tuple[str, ...] = ()
    entities: tuple[str, ...] = ()


class ComposedTask(BaseModel):
    """A DAG of atomic tasks across servers, its entity bindings and its grounded initial snapshots."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    name: str
    nodes: tuple[Node, ...]
    bindings: tuple[Binding, ...]
    snapshots: dict[str, Snapshot]
    rounds: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def ordered(self) -> list[Node]:
        """Nodes in dependency order (ties keep declaration order).

        Raises:
            DependencyCycleError: a cycle or a dependency on an unknown node.
        """
        by = {n.name: n for n in self.nodes}
        for n in self.nodes:
            missing = [d for d in n.depends_on if d not in by]
            if missing:
                raise DependencyCycleError(f"composed task {self.name!r}: {n.name!r} depends on unknown {missing}")
        ts = graphlib.TopologicalSorter({n.name: n.depends_on for n in self.nodes})
        try:
            ts.prepare()
        except graphlib.CycleError as err:
            raise DependencyCycleError(f"composed task {self.name!r}: dependency cycle {err.args[1]}") from None
        names = [n.name for n in self.nodes]
        out: list[Node] = []
        while ts.is_active():
            ready = sorted(ts.get_ready(), key=names.index)
            out.extend(by[r] for r in ready)
            ts.done(*ready)
        return out


# -- entities of a task -----------------------------------------------------------------------------
def rebindable(task: AtomicTask) -> bool:
    """Its check is gold replay only (SQL assertions, predicates or expected returns hold literal values the
    bindings cannot rewrite)."""
    c = task.checkpoint
    return bool(c.gold_calls) and not (c.assertions or c.predicates or c.expected_returns)


def task_entities(b: ServerBundle, con: Any, task: AtomicTask) -> dict[tuple[str, Any], str]:
    """``{(kind, identity): how}`` the entities ``task``'s gold calls name (through the contracts), plus those
    the named rows refer to (an order's customer, a case's contact and order). Local kinds use the
    server's id as identity."""
    found: dict[tuple[str, Any], str] = {}
    for call in task.checkpoint.gold_calls or []:
        a2s = b.contract(call.name).get("args_to_state", {})
        for arg, value in call.arguments.items():
            col = contract_column(a2s, arg)
            hit = b.emap.attribute_of(col) if col else None
            if hit is None or value is None:
                continue
            kind, attr = hit
            ident = identity_of(con, b.emap, kind, attr, value)
            if ident is not None:
                found.setdefault((kind, ident), f"{call.name}.{arg}")
    for (kind, ident) in list(found):  # one level of references out of the named rows
        k = b.emap.kinds[kind]
        if k.table is None:
            continue
        idc = next(c.split(".")[1] for c, a in k.columns.items() if a == k.identity and c.startswith(k.table + "."))
        cols = g.columns_of(con, k.table)
        row = con.execute(f"SELECT {', '.join(cols)} FROM {k.table} WHERE {idc} = ?", (ident,)).fetchone()
        for c, v in zip(cols, row or ()):
            hit = b.emap.attribute_of(f"{k.table}.{c}")
            if hit and hit[0] != kind and v is not None:
                rid = identity_of(con, b.emap, hit[0], hit[1], v)
                if rid is not None:
                    found.setdefault((hit[0], rid), f"{k.table}.{c}")
    return found


def _shared(bundles: Sequence[ServerBundle]) -> set[str]:
    kinds = [set(b.emap.kinds) - set(b.emap.local) for b in bundles]
    return set.intersection(*kinds) if kinds else set()


# -- ranking -------------------------------------------------------------------------------------------
class CombinationScore(BaseModel):
    """Coverage-aware score of one server combination (higher first)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    servers: tuple[str, ...]
    shared_entities: tuple[str, ...]
    complementary: int
    composable_tasks: int
    redundant_tools: int
    score: float


def _tool_kinds(b: ServerBundle, tool: dict[str, Any]) -> tuple[frozenset[str], bool]:
    c = tool.get("contract") or {}
    cols = [contract_column(c.get("args_to_state", {}), a) for a in c.get("args_to_state", {})]
    kinds = {h[0] for col in cols if col and (h := b.emap.attribute_of(col))}
    return frozenset(kinds), bool(c.get("writes"))


def rank_combinations(bundles: Sequence[ServerBundle], size: int = 2) -> list[CombinationScore]:
    """Score every combination of ``size`` servers: ``shared + 0.5 complementary + 0.25 composable - redundant``.

    - shared: entity kinds every server of the combination maps (not local ones);
    - complementary: (writer, other) server pairs where a tool of one writes a shared entity that a tool
      of the other touches;
    - composable: certified, rebindable tasks naming a shared entity;
    - redundant: tool pairs across servers with the same (entity kinds, writes) shape and the same name.

    Raises:
        ValueError: ``size`` < 2 or larger than the number of servers.
    """
    if not isinstance(size, int) or not 2 <= size <= len(bundles):
        raise ValueError(f"size must be an int in [2, {len(bundles)}] (servers per combination), got {size!r}")
    out = []
    for combo in itertools.combinations(bundles, size):
        shared = _shared(combo)
        comp = 0
        for a, b in itertools.permutations(combo, 2):
            writes = {k for t in a.tools for k in _tool_kinds(a, t)[0] if _tool_kinds(a, t)[1]} & shared
            touches = {k for t in b.tools for k in _tool_kinds(b, t)[0]} & shared
            comp += bool(writes & touches)
        composable = 0
        for b in combo:
            con = g.open_copy(b.snapshot)
            try:
                composable += sum(1 for t in b.kept if rebindable(t) and {k for k, _ in task_entities(b, con, t)} & shared)
            finally:
                con.close()
        redundant = sum(1 for a, b in itertools.combinations(combo, 2) for ta in a.tools for tb in b.tools
                        if ta["name"] == tb["name"] and _tool_kinds(a, ta) == _tool_kinds(b, tb))
        score = len(shared) + 0.5 * comp + 0.25 * composable - redundant
        out.append(CombinationScore(servers=tuple(b.name for b in combo), shared_entities=tuple(sorted(shared)),
                                    complementary=comp, composable_tasks=composable, redundant_tools=redundant,
                                    score=score))
    return sorted(out, key=lambda s: (-s.score, s.servers))


# -- grouping ------------------------------------------------------------------------------------------
def propose_groups(bundles: Sequence[ServerBundle], kind: str = "customer") -> dict[Any, list[tuple[str, AtomicTask]]]:
    """Rebindable certified tasks grouped by the ``kind`` object (identity) they concern; only coherent groups
    (spanning at least two servers) are returned, in the order of first appearance."""
    groups: dict[Any, list[tuple[str, AtomicTask]]] = {}
    for b in bundles:
        con = g.open_copy(b.snapshot)
        try:
            for t in b.kept:
                if not rebindable(t):
                    continue
                for (k, ident) in task_entities(b, con, t):
                    if k == kind:
                        groups.setdefault(ident, []).append((b.name, t))
        finally:
            con.close()
    return {i: ts for i, ts in groups.items() if len({s for s, _ in ts}) >= 2}


# -- composition ---------------------------------------------------------------------------------------
@dataclass
class _Plan:
    bindings: list[Binding]
    remap: dict[str, dict[str, dict[Any, Any]]]  # server -> column ("table.col") -> old -> new
    text: dict[str, list[tuple[str, str, str]]]  # server -> (noun, old, new) for request rewriting
    persona: tuple[str, str] = ("", "")


def _rewrite_call(b: ServerBundle, call: ToolCall, remap: dict[str, dict[Any, Any]],
                  subs: list[tuple[str, str, str]]) -> ToolCall:
    a2s = b.contract(call.name).get("args_to_state", {})
    args = dict(call.arguments)
    for arg, value in call.arguments.items():
        col = contract_column(a2s, arg)
        if col and col in remap and value in remap[col]:
            args[arg] = remap[col][value]
        elif isinstance(value, str) and not (col and b.emap.attribute_of(col)):  # free text ("Refund for order 2")
            args[arg] = rewrite_text(value, subs)
    return ToolCall(name=call.name, arguments=args)


def rewrite_text(text: str, subs: list[tuple[str, str, str]]) -> str:
    for noun, old, new in subs:
        if noun:
            text = re.sub(rf"(?i)(\b{re.escape(noun)}s?\s+#?){re.escape(old)}\b", lambda m: m.group(1) + new, text)
        else:
            text = re.sub(rf"(?<![\w@.-]){re.escape(old)}(?![\w@-])", new, text)
    return text


def _columns(b: ServerBundle, kind: str, attr: str) -> list[str]:
    return [c for c, a in b.emap.kinds[kind].columns.items() if a == attr]


def compose(bundles: Sequence[ServerBundle], members: Sequence[tuple[str, AtomicTask]], *, name: str,
            persona: tuple[str, str], lookalike: tuple[str, str] | None = None) -> ComposedTask:
    """Bind ``members`` (server name, certified atomic task) to a new customer ``persona = (name, email)``,
    ground the state in three rounds and link the tasks into a DAG. Nodes whose reference plan does not
    pass are not removed here (see :func:`certify_composed`).

    Raises:
        ValueError: a member names an unknown server, a task is not rebindable, or the group has no customer.
        GroundingError: a grounding round broke a constraint.
    """
    by = {b.name: b for b in bundles}
    for s, t in members:
        if s not in by:
            raise ValueError(f"member {t.name!r}: unknown server {s!r}; expected one of {sorted(by)}")
        if not rebindable(t):
            raise ValueError(f"member {t.name!r} is not rebindable (its check holds literal values)")
    cons = {s: g.open_copy(b.snapshot) for s, b in by.items()}
    try:
        ents: dict[str, dict[tuple[str, Any], str]] = {f"{s}:{t.name}": task_entities(by[s], cons[s], t)
                                                        for s, t in members}
        refs = sorted({e for d in ents.values() for e in d}, key=str)
        customers = {i for k, i in refs if k == "customer"}
        if len(customers) != 1:
            raise ValueError(f"a composed group concerns exactly one customer, got {sorted(customers)}")
        plan = _bind(by, cons, refs, persona)
        rounds = [_round_entities(by, cons, plan), _round_relations(by, cons, plan, refs)]
        rounds.append(_round_history(by, cons, plan, refs, lookalike))
        snaps = {s: g.freeze(c) for s, c in cons.items()}
    finally:
        for c in cons.values():
            c.close()
    nodes: list[Node] = []
    owner: dict[str, str] = {}
    for s, b in by.items():  # the first server storing an entity kind owns it (bundle order)
        for k, kk in b.emap.kinds.items():
            if kk.table and k not in b.emap.local:
                owner.setdefault(k, s)
    for s, t in members:
        b = by[s]
        calls = [_rewrite_call(b, c, plan.remap.get(s, {}), plan.text.get(s, [])) for c in t.checkpoint.gold_calls or []]
        request = rewrite_text(t.request, plan.text.get(s, []))
        spec = t.checkpoint.model_copy(update={"gold_calls": calls, "name": f"{s}:{t.name}"})
        keys = tuple(f"{k}:{i}" for k, i in sorted(ents[f"{s}:{t.name}"], key=str))
        deps = tuple(n.name for n in nodes if set(n.entities) & set(keys)
                     and (n.server == s or any(owner.get(k.split(":")[0]) == n.server for k in set(n.entities) & set(keys))))
        atomic = AtomicTask(name=f"{s}:{t.name}", request=request, details=details_of(request, spec),
                            depends_on=deps, checkpoint=spec)
        nodes.append(Node(name=atomic.name, server=s, atomic=atomic, depends_on=deps, entities=keys))
    return ComposedTask(name=name, nodes=tuple(nodes), bindings=tuple(plan.bindings), snapshots=snaps,
                        rounds=tuple(rounds))


def _bind(by: dict[str, ServerBundle], cons: dict[str, Any], refs: list[tuple[str, Any]],
          persona: tuple[str, str]) -> _Plan:
    remap: dict[str, dict[str, dict[Any, Any]]] = {s: {} for s in by}
    text: dict[str, list[tuple[str, str, str]]] = {s: [] for s in by}
    bindings: list[Binding] = []
    new_identity: dict[tuple[str, Any], Any] = {}
    for kind, ident in sorted(refs, key=lambda r: (r[0] != "customer", r[0] != "order", str(r))):
        ids: dict[str, tuple[Any, Any]] = {}
        if kind == "customer":
            new_identity[(kind, ident)] = persona[1]
        for s, b in by.items():
            k = b.emap.kinds.get(kind)
            if k is None or (kind in b.emap.local and not _local_here(b, cons[s], kind, ident)):
                continue
            if k.table is None:  # refers only: the identity is the owner's id
                continue
            idc = _columns(b, kind, k.identity)[0].split(".")[1]
            row = cons[s].execute(f"SELECT {k.id_column} FROM {k.table} WHERE {idc} = ?", (ident,)).fetchone()
            if row is None:
                raise g.GroundingError(f"{s}: no {kind} with {k.identity} {ident!r} to bind")
            old = row[0]
            new = g.new_id(cons[s], k.table, k.id_column)
            ids[s] = (old, new)
            if k.identity == "id":
                new_identity.setdefault((kind, ident), new)
            for col in _columns(b, kind, "id"):
                remap[s].setdefault(col, {})[old] = new
            text[s].append((k.noun, str(old), str(new)))
        if (kind, ident) not in new_identity:
            continue
        ni = new_identity[(kind, ident)]
        for s, b in by.items():  # the identity itself (e-mails; order numbers on servers that only refer)
            k = b.emap.kinds.get(kind)
            if k is None:
                continue
            for col in _columns(b, kind, k.identity):
                remap[s].setdefault(col, {})[ident] = ni
            if k.table is None:
                text[s].append((k.noun, str(ident), str(ni)))
            elif k.identity != "id":
                text[s].append(("", str(ident), str(ni)))
        bindings.append(Binding(kind=kind, identity=ident, new_identity=ni, ids=ids))
    return _Plan(bindings=bindings, remap=remap, text=text, persona=persona)


def _local_here(b: ServerBundle, con: Any, kind: str, ident: Any) -> bool:
    k = b.emap.kinds[kind]
    return con.execute(f"SELECT 1 FROM {k.table} WHERE {k.id_column} = ?", (ident,)).fetchone() is not None


def _round_entities(by, cons, plan: _Plan) -> str:
    made = []
    cust = next(x for x in plan.bindings if x.kind == "customer")
    for s, (old, new) in cust.ids.items():
        k = by[s].emap.kinds["customer"]
        over = {k.id_column: new}
        for c, a in k.columns.items():
            t, col = c.split(".")
            if t == k.table and a == "email":
                over[col] = cust.new_identity
            if t == k.table and a == "name":
                over[col] = plan.persona[0]
        g.copy_row(cons[s], k.table, {k.id_column: old}, over)
        made.append(f"{s}.{k.table}:{new}")
    return "entities: " + ", ".join(made)


def _round_relations(by, cons, plan: _Plan, refs) -> str:
    made = []
    for x in plan.bindings:
        if x.kind == "customer":
            continue
        for s, (old, new) in x.ids.items():
            b = by[s]
            k = b.emap.kinds[x.kind]
            colmap = {c.split(".")[1]: m for c, m in plan.remap[s].items() if c.startswith(k.table + ".")}
            g.copy_row(cons[s], k.table, {k.id_column: old}, {k.id_column: new}, colmap)
            for child, fkcol in g.owned_children(cons[s], b.emap, k.table):
                childmap = {c.split(".")[1]: m for c, m in plan.remap[s].items() if c.startswith(child + ".")}
                g.copy_row(cons[s], child, {fkcol: old}, {fkcol: new}, childmap)
            made.append(f"{s}.{k.table}:{new}")
    for s, con in cons.items():
        g.check_foreign_keys(con, s)
    _check_cross_server(by, cons)
    return "relations: " + ", ".join(made) + " (foreign keys and cross-server references hold)"


def _check_cross_server(by, cons) -> None:
    """Every reference to an entity a server does not store names an existing row on the server that does,
    and belongs to the same customer when the referring row names one."""
    homes = {k: s for s, b in by.items() for k, kk in b.emap.kinds.items() if kk.table and k not in b.emap.local}
    for s, b in by.items():
        for kind, k in b.emap.kinds.items():
            if k.table is not None or kind not in homes:
                continue
            hb, hcon = by[homes[kind]], cons[homes[kind]]
            hk = hb.emap.kinds[kind]
            for col in k.columns:
                table, c = col.split(".")
                cust_col = next((cc.split(".")[1] for cc, a in b.emap.kinds["customer"].columns.items()
                                 if cc.startswith(table + ".") and a == "id"), None)
                sel = f"SELECT {c}, {cust_col}" if cust_col else f"SELECT {c}"
                for row in cons[s].execute(f"{sel} FROM {table} WHERE {c} IS NOT NULL"):
                    home = hcon.execute(f"SELECT * FROM {hk.table} WHERE {hk.id_column} = ?", (row[0],)).fetchone()
                    if home is None:
                        raise g.GroundingError(f"{s}.{col} = {row[0]} names no {kind} on {homes[kind]}")
                    if cust_col:
                        mine = identity_of(cons[s], b.emap, "customer", "id", row[1])
                        owner_col = next(cc.split(".")[1] for cc, a in hb.emap.kinds["customer"].columns.items()
                                         if cc.startswith(hk.table + ".") and a == "id")
                        oid = hcon.execute(f"SELECT {owner_col} FROM {hk.table} WHERE {hk.id_column} = ?",
                                           (row[0],)).fetchone()[0]
                        theirs = identity_of(hcon, hb.emap, "customer", "id", oid)
                        if mine != theirs:
                            raise g.GroundingError(f"{s}.{col} = {row[0]} belongs to {theirs!r} on {homes[kind]}, "
                                                   f"but the referring row's customer is {mine!r}")


def _round_history(by, cons, plan: _Plan, refs, lookalike) -> str:
    made = []
    cust = next(x for x in plan.bindings if x.kind == "customer")
    for s, b in by.items():
        if s not in cust.ids:
            continue
        new_cust = cust.ids[s][1]
        for kind, k in b.emap.kinds.items():
            if kind == "customer" or k.table is None or not k.history:
                continue
            cust_col = next((c.split(".")[1] for c, a in b.emap.kinds["customer"].columns.items()
                             if c.startswith(k.table + ".") and a == "id"), None)
            row = cons[s].execute(f"SELECT {k.id_column} FROM {k.table} WHERE {k.history} ORDER BY {k.id_column} "
                                  "LIMIT 1").fetchone()
            if row is None or cust_col is None:
                continue
            nid = g.new_id(cons[s], k.table, k.id_column)
            nulls = {c.split(".")[1]: None for k2, kk in b.emap.kinds.items() if k2 not in (kind, "customer")
                     for c in kk.columns if c.startswith(k.table + ".")}  # no reference to others' records
            g.copy_row(cons[s], k.table, {k.id_column: row[0]}, {k.id_column: nid, cust_col: new_cust, **nulls})
            for child, fkcol in g.owned_children(cons[s], b.emap, k.table):
                g.copy_row(cons[s], child, {fkcol: row[0]}, {fkcol: nid})
            made.append(f"history {s}.{k.table}:{nid}")
        if lookalike is not None:
            kc = b.emap.kinds["customer"]
            nid = g.new_id(cons[s], kc.table, kc.id_column)
            over = {kc.id_column: nid}
            for c, a in kc.columns.items():
                t, col = c.split(".")
                if t == kc.table and a in ("email", "name"):
                    over[col] = lookalike[1] if a == "email" else lookalike[0]
            g.copy_row(cons[s], kc.table, {kc.id_column: new_cust}, over)
            made.append(f"distractor {s}.{kc.table}:{nid}")
    for s, con in cons.items():
        g.check_foreign_keys(con, s)
    return "history and distractors: " + ", ".join(made)


# -- running ---------------------------------------------------------------------------------------------
class ComposedResult(BaseModel):
    """Per-node outcomes and verdicts of one run of a composed task, ``R = mean_k r_k``."""

    model_config = ConfigDict(extra="forbid")

    task: str
    nodes: list[str]
    outcomes: list[list[ToolOutcome]]
    results: list[CheckpointResult]
    reward: float
    final: dict[str, Any] = {}


NodePolicy = Callable[[Node, list[list[ToolOutcome]]], Sequence[str | ToolCall]]


def reference_policy(node: Node, history: list[list[ToolOutcome]]) -> list[ToolCall]:
    """The node's gold calls (the reference plan)."""
    return list(node.atomic.checkpoint.gold_calls or [])


async def run_composed(rt: Any, task: ComposedTask, hashes: dict[str, str], policy: NodePolicy = reference_policy,
                       *, keep_final: bool = False) -> ComposedResult:
    """Run ``task`` in ``rt``: one session per server from the grounded snapshots, the policy's calls routed by
    tool name (a name no server has goes to the node's own server: ``unknown_tool``), each node judged by its
    server's ``verify_turn`` from that server's state at the node's start.

    Raises:
        ValueError: a server of the task has no hash in ``hashes``, or two servers share a tool name.
        DependencyCycleError: the DAG has a cycle.
    """
    order = task.ordered()
    missing = sorted(set(task.snapshots) - set(hashes))
    if missing:
        raise ValueError(f"no registered server hash for {missing}")
    owner: dict[str, str] = {}
    for s in task.snapshots:
        for t in rt.registry.spec(hashes[s]).tool_names:
            if t in owner:
                raise ValueError(f"tool {t!r} exists on both {owner[t]!r} and {s!r}; routing by name is ambiguous")
            owner[t] = s
    sessions = {s: await rt.create_session(hashes[s], snap) for s, snap in task.snapshots.items()}
    history: list[list[ToolOutcome]] = []
    results: list[CheckpointResult] = []
    final: dict[str, Any] = {}
    try:
        for node in order:
            start = rt.snapshot(sessions[node.server])
            outs: list[ToolOutcome] = []
            for c in policy(node, history):
                call = parse_call(c) if isinstance(c, str) else c
                outs.append(await rt.call_tool(sessions[owner.get(call.name, node.server)], call.name, call.arguments))
            history.append(outs)
            mine = [o for o in outs if o.session_id == sessions[node.server]]
            results.append(await rt.verify_turn(sessions[node.server], start, node.atomic.checkpoint, mine))
        if keep_final:
            final = {s: rt.snapshot(sid) for s, sid in sessions.items()}
    finally:
        for sid in sessions.values():
            await rt.close(sid)
    return ComposedResult(task=task.name, nodes=[n.name for n in order], outcomes=history, results=results,
                          reward=trajectory_reward(results), final=final)


async def certify_composed(rt: Any, task: ComposedTask, hashes: dict[str, str]) -> ComposedTask:
    """Keep the nodes whose reference plan passes, in order: a node that conflicts with the kept ones (e.g.
    shipping an order the plan cancelled) is dropped, named in ``dropped`` and removed from later nodes'
    dependencies (they are kept only if they pass without it)."""
    kept: list[Node] = []
    dropped: list[str] = []
    for node in task.ordered():
        node = node.model_copy(update={"depends_on": tuple(d for d in node.depends_on if d not in dropped)})
        node = node.model_copy(update={"atomic": node.atomic.model_copy(update={"depends_on": node.depends_on})})
        trial = task.model_copy(update={"nodes": (*kept, node)})
        res = await run_composed(rt, trial, hashes)
        if res.reward == 1.0:
            kept.append(node)
        else:
            dropped.append(node.name)
    return task.model_copy(update={"nodes": tuple(kept), "dropped": tuple(dropped)})

"""Attribution, revision and re-certification of composed cross-server tasks (seed: WEFT 4.1 and 5.1).

A composed task (:mod:`~treadle.weft.evolve.compose`) has parts of its own besides its atomic tasks: the
**entity bindings** (the same business object on every server: a node's calls must name the object the
composition bound, e.g. the CRM's ``order_ref`` the shop's new order number) and the **DAG edges** (a node
runs after the nodes it depends on). When one of them is wrong the task is at fault, not the policy:

- :func:`binding_faults`: a node's gold call names, through its tool contract and the server's entity map,
  an entity of a bound kind whose value is not the bound one (``order_ref=1`` where the binding made the
  order 3: the call acts on the original customer's object); or an argument the contract maps to no entity
  names a bound object's original id or identity: in free text (a note body, a credit reason: ``"Chipped mug
  of order 1"``, ``"contact C-001"``, ``ada@example.com``, matched the way the composition rewrites request
  texts), or as a value or nested key named like an entity column (``{"order_ref": 1}``);
- :func:`edge_faults`: a node's dependencies differ from those of the certified composed task (an edge
  dropped, so that the node may run before its prerequisite, or an edge added, possibly a cycle).

:func:`attribute_composed` applies both before executing anything (blame ``task``, rules
``composed_binding`` and ``composed_edge``); only when the structure holds does it replay the reference
plan (it fails to execute: ``environment``; it passes: ``policy``; a cycle the certified DAG cannot repair:
``undecided``, for the ``composer`` LLM role of :class:`~treadle.weft.evolve.revise.LLMReviser`).
:func:`revise_composed` revises only the blamed part (the one argument, from the bindings or the certified
text; the one node's edges, from the certified DAG), and :func:`recertify_composed` certifies the result by
execution: the reference plan passes every node, a do-nothing and a read-only agent score 0, each node
certifies (its check fails on the state it starts from, passes after its gold calls) from the state the
reference reaches, and no call names an unbound object. A revision that does not certify is not kept.
:func:`component_digests` names the parts so that a caller can check that nothing unblamed changed.
:func:`inject` is the fault injector (``wrong_binding``, ``unbound_text``, ``dropped_edge``, ``cycle``) in the
style of :mod:`~treadle.weft.evolve.faults`. Not covered: an id that reaches a call only through another
call's return value under an argument name the entity map does not know.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.evolve.attribute import Attribution, Blame
from treadle.weft.evolve.certify import Certificate, _writes, certify_task
from treadle.weft.evolve.compose import ComposedResult, ComposedTask, Node, reference_policy, run_composed
from treadle.weft.evolve.entities import ENTITY_MAPS, contract_column
from treadle.weft.rollouts.tasks import DependencyCycleError, details_of

__all__ = ["COMPOSED_FAULTS", "ComposedAttribution", "ComposedCertificate", "ComposedFault", "attribute_composed",
           "binding_faults", "component_digests", "edge_faults", "inject", "plan_policy", "recertify_composed",
           "revise_composed", "server_tools"]

COMPOSED_FAULTS = ("wrong_binding", "unbound_text", "dropped_edge", "cycle")
"""Fault kinds :func:`inject` makes: a node's call names the unbound (original) object in an entity-mapped argument,
or in a free-text one (``reason='Chipped mug of order 1'`` where the order is bound to 3); a node loses its edges
to its prerequisites on its own server and is declared before them; a prerequisite is made to depend on the node."""


class ComposedFault(BaseModel):
    """One wrong part of a composed task.

    Attributes:
        kind: ``binding`` (a call argument) or ``edge`` (a node's dependencies).
        node: the node it is in.
        call, arg, found, expected: for ``binding``: the index of the gold call in the node, the argument, its
            value, and the value the bindings give (for a free-text argument, ``free_text``: the text with the
            bound values).
        depends_on, expected_depends_on: for ``edge``: the node's dependencies, and the certified DAG's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["binding", "edge"]
    node: str
    detail: str
    call: int = -1
    arg: str = ""
    found: Any = None
    expected: Any = None
    depends_on: tuple[str, ...] = ()
    expected_depends_on: tuple[str, ...] = ()
    free_text: bool = False


class ComposedAttribution(BaseModel):
    """A verdict on one failed node of a composed task, and the structural fault behind it (if any)."""

    model_config = ConfigDict(extra="forbid")

    attribution: Attribution
    fault: ComposedFault | None = None

    @property
    def component(self) -> str:
        """The blamed part: ``binding:<node>.<call>.<arg>``, ``edges:<node>``, or ``<blame>:<node>``."""
        f = self.fault
        if f is None:
            return f"{self.attribution.blame.value}:{self.attribution.checkpoint}"
        return f"binding:{f.node}.{f.call}.{f.arg}" if f.kind == "binding" else f"edges:{f.node}"


class ComposedCertificate(BaseModel):
    """Certification of a composed task by execution (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    checks: dict[str, bool]
    nodes: tuple[Certificate, ...] = ()
    certified: bool
    reasons: tuple[str, ...] = ()


def server_tools(rt: Any, hashes: dict[str, str]) -> dict[str, dict[str, dict]]:
    """``{server: {tool name: tool spec (with its contract)}}`` of the registered servers ``hashes``."""
    return {s: {t["name"]: t for t in rt.registry.spec(h).tools} for s, h in hashes.items()}


def component_digests(task: ComposedTask) -> dict[str, str]:
    """``{part: digest}``: per node its calls and request (``calls:<node>``) and its edges (``edges:<node>``), the
    bindings (``bindings``) and each server's grounded snapshot (``snapshot:<server>``)."""
    def h(x: Any) -> str:
        return hashlib.sha256(json.dumps(x, sort_keys=True, default=str).encode()).hexdigest()[:16]

    out = {"bindings": h([b.model_dump(mode="json") for b in task.bindings])}
    out.update({f"snapshot:{s}": snap.digest for s, snap in task.snapshots.items()})
    for n in task.nodes:
        c = n.atomic.checkpoint
        out[f"calls:{n.name}"] = h([n.server, n.atomic.request, [str(x) for x in c.gold_calls or []]])
        out[f"edges:{n.name}"] = h(sorted(n.depends_on))
    return out


# -- detection -----------------------------------------------------------------------------------------
def _bound_values(task: ComposedTask, node: Node, kind: str, attr: str) -> list[Any]:
    """The values the bindings give an argument naming ``attr`` of a ``kind`` the node concerns on its server
    (empty when the node concerns no bound object of that kind)."""
    emap = ENTITY_MAPS[node.server]
    k = emap.kinds[kind]
    out = []
    for b in task.bindings:
        if b.kind != kind or f"{kind}:{b.identity}" not in node.entities:
            continue
        if attr == "id" and node.server in b.ids:
            out.append(b.ids[node.server][1])
        elif attr == k.identity:
            out.append(b.new_identity)
    return out


def _text_subs(task: ComposedTask, node: Node) -> list[tuple[str, str, str]]:
    """``(noun, original, bound)`` text substitutions of the bound objects ``node`` concerns on its server (noun ''
    for an identity written on its own, e.g. an e-mail): what :func:`~treadle.weft.evolve.compose.compose` applies
    to request texts and free-text arguments."""
    emap = ENTITY_MAPS[node.server]
    out = []
    for b in task.bindings:
        k = emap.kinds.get(b.kind)
        if k is None or f"{b.kind}:{b.identity}" not in node.entities:
            continue
        if node.server in b.ids:
            old, new = b.ids[node.server]
        else:  # a kind the server only refers to (the CRM's order_ref): the identity is its id here
            old, new = b.identity, b.new_identity
        if k.noun and old != new:
            out.append((k.noun, str(old), str(new)))
        if k.identity != "id" and isinstance(b.identity, str) and b.identity != b.new_identity:
            out.append(("", b.identity, str(b.new_identity)))
    return out


def _attribute_by_name(node: Node, name: str) -> tuple[str, str] | None:
    """(kind, attribute) of an argument or key named like a column of the server's entity map (``order_ref``,
    ``case_id``; a bare ``id`` names nothing)."""
    if name == "id":
        return None
    for k in ENTITY_MAPS[node.server].kinds.values():
        for col, attr in k.columns.items():
            if col.split(".", 1)[1] == name:
                return k.kind, attr
    return None


def _rebind_free(task: ComposedTask, node: Node, subs: list, name: str, value: Any, rewrite: Any) -> Any:
    """``value`` (an argument the contract maps to no entity attribute) with every mention of a bound object's
    original id or identity replaced by the bound one: in text (noun and id, or an identity such as an e-mail), in a
    scalar or nested key named like an entity column (``{"order_ref": 1}``), recursively through lists and objects."""
    if isinstance(value, list):
        return [_rebind_free(task, node, subs, name, v, rewrite) for v in value]
    if isinstance(value, dict):
        return {k: _rebind_free(task, node, subs, k, v, rewrite) for k, v in value.items()}
    hit = _attribute_by_name(node, name)
    if hit is None or value is None or isinstance(value, bool):
        return rewrite(value, subs) if isinstance(value, str) and subs else value
    kind, attr = hit
    k = ENTITY_MAPS[node.server].kinds[kind]
    for b in task.bindings:  # only the original (unbound) object is flagged: another value may be a legitimate object
        if b.kind != kind or f"{kind}:{b.identity}" not in node.entities:
            continue
        if attr == "id" and node.server in b.ids:
            old, new = b.ids[node.server]
        elif attr == k.identity or (attr == "id" and k.table is None):
            old, new = b.identity, b.new_identity
        else:
            continue
        if value == old and old != new:
            return new
    return rewrite(value, subs) if isinstance(value, str) and subs else value


def binding_faults(task: ComposedTask, tools: dict[str, dict[str, dict]]) -> list[ComposedFault]:
    """Every gold-call argument of every node that names a bound object's attribute (through the tool's contract
    and the server's entity map) with a value other than the bound one, and every argument the contract maps to no
    entity attribute (``free_text``) that names a bound object by its original id or identity: in text (``"Refund
    for order 1"``, an e-mail; rewritten as the composition rewrites request texts), or in a value or nested key
    named like an entity column (``order_ref=1``, ``{"case_id": 1}``); ``expected``: the argument rebound."""
    from treadle.weft.evolve.compose import rewrite_text

    out = []
    for node in task.nodes:
        emap = ENTITY_MAPS.get(node.server)
        if emap is None:
            continue
        subs = _text_subs(task, node)
        for i, call in enumerate(node.atomic.checkpoint.gold_calls or []):
            a2s = ((tools.get(node.server, {}).get(call.name) or {}).get("contract") or {}).get("args_to_state", {})
            for arg, value in call.arguments.items():
                col = contract_column(a2s, arg)
                hit = emap.attribute_of(col) if col else None
                if hit is None:  # free text, a nested value, or an id the contract does not map
                    fixed = _rebind_free(task, node, subs, arg, value, rewrite_text)
                    if fixed != value:
                        out.append(ComposedFault(kind="binding", node=node.name, call=i, arg=arg, found=value,
                                                 expected=fixed, free_text=True,
                                                 detail=f"{call.name}.{arg}={value!r} names an object the composition "
                                                        f"did not bind (not contract-mapped); bound: {fixed!r}"))
                    continue
                if hit is None or value is None:
                    continue
                want = _bound_values(task, node, *hit)
                if want and value not in want:
                    out.append(ComposedFault(kind="binding", node=node.name, call=i, arg=arg, found=value,
                                             expected=want[0] if len(want) == 1 else None,
                                             detail=f"{call.name}.{arg}={value!r} names a {hit[0]} the composition did "
                                                    f"not bind; the binding gives {want}"))
    return out


def edge_faults(task: ComposedTask, certified: ComposedTask) -> list[ComposedFault]:
    """Nodes whose dependencies differ from the certified composed task's (nodes absent there are not judged)."""
    ref = {n.name: n for n in certified.nodes}
    out = []
    for n in task.nodes:
        c = ref.get(n.name)
        if c is None or set(n.depends_on) == set(c.depends_on):
            continue
        lost, extra = sorted(set(c.depends_on) - set(n.depends_on)), sorted(set(n.depends_on) - set(c.depends_on))
        out.append(ComposedFault(kind="edge", node=n.name, depends_on=n.depends_on, expected_depends_on=c.depends_on,
                                 detail=f"edges lost {lost}, edges not in the certified DAG {extra}"))
    return out


# -- attribution -----------------------------------------------------------------------------------------
def _failed_nodes(task: ComposedTask, result: ComposedResult | None) -> list[str]:
    if result is None:  # the task did not run (a cycle): every node
        return [n.name for n in task.nodes]
    return [name for name, r in zip(result.nodes, result.results) if r.r != 1]


def _underivable_nodes(rt: Any, task: ComposedTask, hashes: dict[str, str], ref: Any) -> dict[str, list[str]]:
    """Per node, the gold values of :func:`~treadle.weft.evolve.task_checks.underivable_values` (its history: the
    earlier nodes' requests and the results of their reference calls)."""
    from treadle.weft.evolve.task_checks import underivable_values

    tools = {t["name"]: t for h in hashes.values() for t in rt.registry.spec(h).tools}
    by = {n.name: n for n in task.nodes}
    out: dict[str, list[str]] = {}
    text, history = "", []
    for name, outs in zip(ref.nodes, ref.outcomes):
        node = by[name]
        request = f"{text}\n{node.atomic.request}"
        results = [o.result for o in outs]
        out[name] = underivable_values(request, list(node.atomic.checkpoint.gold_calls or []), results, tools, history)
        text = request
        history += [o.result for o in outs if o.ok]
    return out


async def attribute_composed(rt: Any, task: ComposedTask, certified: ComposedTask, hashes: dict[str, str],
                             result: ComposedResult | None) -> list[ComposedAttribution]:
    """Attribute a failed run of ``task`` (``result``; None when it could not run, e.g. a cycle): the structural
    faults first (every one found, blame ``task``), without executing anything; else, for each failed node,
    the reference plan of the task as it is: it fails -> ``environment`` (``reference_fails``), it passes ->
    ``policy`` (``reference_passes``).

    A passing run is attributed only when a structural fault is found (execution accepts a call on an unbound
    object when that object also satisfies the check, e.g. a note on the original customer's case).

    Raises:
        ValueError: ``result`` is a passing run and the structure holds (nothing to attribute).
    """
    faults = edge_faults(task, certified) + binding_faults(task, server_tools(rt, hashes))
    if result is not None and result.reward == 1.0 and not faults:
        raise ValueError(f"composed task {task.name!r} passed; only failed runs are attributed")
    failed = _failed_nodes(task, result)
    spans = {n: [] for n in failed}
    if result is not None:
        for name, outs in zip(result.nodes, result.outcomes):
            spans[name] = [str(o.call) for o in outs] if name in spans else []
    if faults:
        return [ComposedAttribution(fault=f, attribution=Attribution(
            checkpoint=f.node, blame=Blame.task, rule=f"composed_{f.kind}", detail=f.detail,
            span=spans.get(f.node, []))) for f in faults]
    try:
        ref = await run_composed(rt, task, hashes)
    except DependencyCycleError as err:  # a cycle the certified DAG has too: not repairable from it
        return [ComposedAttribution(attribution=Attribution(checkpoint=task.name, blame=Blame.undecided,
                                                            rule="composed_cycle", detail=str(err)))]
    ref_ok = {name: r.r == 1 and all(o.ok for o in outs)
              for name, r, outs in zip(ref.nodes, ref.results, ref.outcomes)}
    ungiven = _underivable_nodes(rt, task, hashes, ref)
    out = []
    for name in failed:
        good = ref_ok.get(name, False)
        if good and ungiven.get(name):
            out.append(ComposedAttribution(attribution=Attribution(
                checkpoint=name, blame=Blame.task, rule="underivable_gold", span=spans.get(name, []),
                detail="gold values the node's request, the earlier nodes' requests and results and its own tool "
                       f"results do not give: {ungiven[name][:6]}")))
            continue
        out.append(ComposedAttribution(attribution=Attribution(
            checkpoint=name, blame=Blame.policy if good else Blame.environment,
            rule="reference_passes" if good else "reference_fails", span=spans.get(name, []),
            detail="the composed reference plan passes this node" if good else
                   "the composed reference plan fails this node, the bindings and edges hold")))
    return out


# -- revision ----------------------------------------------------------------------------------------------
def _replace_node(task: ComposedTask, node: Node) -> ComposedTask:
    return task.model_copy(update={"nodes": tuple(node if n.name == node.name else n for n in task.nodes)})


def _with_gold_calls(task: ComposedTask, node: Node, calls) -> ComposedTask:
    """``task`` with ``node``'s checkpoint gold calls replaced by ``calls`` (everything else unchanged)."""
    spec = node.atomic.checkpoint.model_copy(update={"gold_calls": calls})
    return _replace_node(task, node.model_copy(update={"atomic": node.atomic.model_copy(update={"checkpoint": spec})}))


def revise_composed(task: ComposedTask, certified: ComposedTask, faults: Sequence[ComposedFault]) -> ComposedTask:
    """``task`` with only the parts of ``faults`` revised: a binding fault's argument set to the bound value (a
    free-text one to the certified task's text of that call when it has one, else to the text with the bound values), an
    edge fault's node given the certified DAG's dependencies (its declaration position and every other node,
    binding and snapshot unchanged). A binding fault with no single bound value is left as it is."""
    by_name = {n.name: n for n in certified.nodes}
    for f in faults:
        node = next((n for n in task.nodes if n.name == f.node), None)
        if node is None:
            continue
        if f.kind == "binding":
            if f.expected is None:
                continue
            calls = list(node.atomic.checkpoint.gold_calls or [])
            old = calls[f.call]
            value = f.expected
            if f.free_text and f.node in by_name:  # the certified text, when the certified call is the same tool
                ref = list(by_name[f.node].atomic.checkpoint.gold_calls or [])
                if f.call < len(ref) and ref[f.call].name == old.name and isinstance(ref[f.call].arguments.get(f.arg),
                                                                                    str):
                    value = ref[f.call].arguments[f.arg]
            calls[f.call] = ToolCall(name=old.name, arguments={**old.arguments, f.arg: value})
            spec = node.atomic.checkpoint.model_copy(update={"gold_calls": calls})
            atomic = node.atomic.model_copy(update={"checkpoint": spec,
                                                    "details": details_of(node.atomic.request, spec)})
            task = _replace_node(task, node.model_copy(update={"atomic": atomic}))
        elif f.node in by_name:
            deps = by_name[f.node].depends_on
            atomic = node.atomic.model_copy(update={"depends_on": deps})
            task = _replace_node(task, node.model_copy(update={"depends_on": deps, "atomic": atomic}))
    return task


# -- certification -----------------------------------------------------------------------------------------
def plan_policy(plan: ComposedTask):
    """A node policy playing ``plan``'s gold calls for the node of the same name (none for a node ``plan`` lacks):
    a correct agent when ``plan`` is the certified composed task."""
    calls = {n.name: list(n.atomic.checkpoint.gold_calls or []) for n in plan.nodes}
    return lambda node, history: list(calls.get(node.name, []))


async def recertify_composed(rt: Any, task: ComposedTask, hashes: dict[str, str]) -> ComposedCertificate:
    """Certify ``task`` by execution: ``gold_passes`` (the reference plan scores R = 1), ``do_nothing_zero`` and
    ``read_only_zero`` (an agent making no call, or only the gold's read calls, scores R = 0), and
    ``nodes_certify``: every node certifies (:func:`~treadle.weft.evolve.certify.certify_task`: its check fails
    on the state it starts from and passes after its gold calls) from the state the reference plan reaches on
    its server; ``bindings_hold``: no gold call names an unbound object (:func:`binding_faults`: execution alone
    accepts one that also satisfies the check). A cycle makes every check fail (recorded, not raised)."""
    checks: dict[str, bool] = {}
    reasons: list[str] = []
    try:
        order = task.ordered()
    except DependencyCycleError as err:
        return ComposedCertificate(task=task.name, checks={"acyclic": False}, certified=False, reasons=(str(err),))
    tools = server_tools(rt, hashes)

    def read_only(node: Node, history: Any) -> list[ToolCall]:
        return [c for c in reference_policy(node, history) if not _writes(tools[node.server], c.name)]

    for name, policy, want in (("gold_passes", reference_policy, 1.0), ("do_nothing_zero", lambda n, h: [], 0.0),
                               ("read_only_zero", read_only, 0.0)):
        res = await run_composed(rt, task, hashes, policy)
        checks[name] = res.reward == want
        if not checks[name]:
            reasons.append(f"{name}: R = {res.reward:.3f}, expected {want}")
    sessions = {s: await rt.create_session(hashes[s], snap) for s, snap in task.snapshots.items()}
    certs = []
    try:
        for node in order:
            sid = sessions[node.server]
            certs.append(await certify_task(rt, hashes[node.server], rt.snapshot(sid), node.atomic))
            for c in node.atomic.checkpoint.gold_calls or []:
                await rt.call_tool(sid, c.name, c.arguments)
    finally:
        for sid in sessions.values():
            await rt.close(sid)
    checks["nodes_certify"] = all(c.certified for c in certs)
    reasons.extend(f"{c.task}: {r}" for c in certs for r in c.reasons)
    unbound = binding_faults(task, tools)
    checks["bindings_hold"] = not unbound
    reasons.extend(f"binding: {f.detail}" for f in unbound)
    return ComposedCertificate(task=task.name, checks=checks, nodes=tuple(certs), certified=all(checks.values()),
                               reasons=tuple(reasons))


# -- fault injection -----------------------------------------------------------------------------------------
def inject(task: ComposedTask, tools: dict[str, dict[str, dict]], how: str,
           node: str) -> tuple[ComposedTask, str] | None:
    """``task`` with one fault of kind ``how`` (:data:`COMPOSED_FAULTS`) in ``node``, and what was done; None when
    the node has nothing of that kind (no bound argument; no dependency on its own server).

    - ``wrong_binding``: the node's last argument naming a bound object gets the object's original value (the
      binding not applied: the call acts on the object the atomic task was certified on);
    - ``unbound_text``: the node's last free-text argument gets `` (<noun> <original id>)`` appended, naming the
      first bound object the node concerns by its original id;
    - ``dropped_edge``: the node loses its dependencies on nodes of its own server and is declared first;
    - ``cycle``: the node's last dependency is made to depend on the node.

    Raises:
        ValueError: an unknown ``how`` or ``node``.
    """
    if how not in COMPOSED_FAULTS:
        raise ValueError(f"unknown composed fault {how!r}; expected one of {COMPOSED_FAULTS}")
    target = next((n for n in task.nodes if n.name == node), None)
    if target is None:
        raise ValueError(f"no node {node!r} in {task.name!r}; nodes: {[n.name for n in task.nodes]}")
    if how == "wrong_binding":
        emap = ENTITY_MAPS[target.server]
        calls = list(target.atomic.checkpoint.gold_calls or [])
        for i in range(len(calls) - 1, -1, -1):
            a2s = ((tools[target.server].get(calls[i].name) or {}).get("contract") or {}).get("args_to_state", {})
            for arg, value in calls[i].arguments.items():
                col = contract_column(a2s, arg)
                hit = emap.attribute_of(col) if col else None
                if hit is None or not _bound_values(task, target, *hit):
                    continue
                b = next(b for b in task.bindings if b.kind == hit[0] and f"{b.kind}:{b.identity}" in target.entities)
                orig = b.ids[target.server][0] if hit[1] == "id" and target.server in b.ids else b.identity
                if orig == value:
                    continue
                calls[i] = ToolCall(name=calls[i].name, arguments={**calls[i].arguments, arg: orig})
                return (_with_gold_calls(task, target, calls),
                        f"{target.name}: {calls[i].name}.{arg} {value!r} -> {orig!r} (unbound)")
        return None
    if how == "unbound_text":
        subs = [x for x in _text_subs(task, target) if x[0]]
        calls = list(target.atomic.checkpoint.gold_calls or [])
        for i in range(len(calls) - 1, -1, -1):
            a2s = ((tools[target.server].get(calls[i].name) or {}).get("contract") or {}).get("args_to_state", {})
            cols = {a: contract_column(a2s, a) for a in calls[i].arguments}
            free = [a for a, v in calls[i].arguments.items()
                    if isinstance(v, str) and not (cols[a] and ENTITY_MAPS[target.server].attribute_of(cols[a]))]
            if not free or not subs:
                continue
            arg, (noun, old, _) = free[-1], subs[0]
            text = f"{calls[i].arguments[arg]} ({noun} {old})"
            calls[i] = ToolCall(name=calls[i].name, arguments={**calls[i].arguments, arg: text})
            return (_with_gold_calls(task, target, calls),
                    f"{target.name}: {calls[i].name}.{arg} -> {text!r} (unbound, free text)")
        return None
    servers = {n.name: n.server for n in task.nodes}
    if how == "dropped_edge":
        lost = [d for d in target.depends_on if servers.get(d) == target.server]
        if not lost:
            return None
        deps = tuple(d for d in target.depends_on if d not in lost)
        new = target.model_copy(update={"depends_on": deps, "atomic": target.atomic.model_copy(
            update={"depends_on": deps})})
        nodes = (new, *(n for n in task.nodes if n.name != node))
        return task.model_copy(update={"nodes": nodes}), f"{node}: dropped edges to {lost}, declared first"
    if not target.depends_on:
        return None
    prereq = target.depends_on[-1]
    p = next(n for n in task.nodes if n.name == prereq)
    deps = (*p.depends_on, node)
    looped = _replace_node(task, p.model_copy(update={"depends_on": deps,
                                                      "atomic": p.atomic.model_copy(update={"depends_on": deps})}))
    return looped, f"{prereq} made to depend on {node} (cycle)"

"""Composed cross-server tasks: a wrong binding or DAG edge is blamed on the task, only that part is revised, the
result re-certifies by execution; the evolution loop repairs injected composed faults."""
import inspect
import logging

import anyio
import pytest
from treadle.weft.envs import crm, shop
from treadle.weft.evolve import composed_revise as cr
from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.compose import certify_composed, compose, propose_groups, run_composed
from treadle.weft.evolve.loop import ComposedSlot, EvolvingSystem, evolve
from treadle.weft.rollouts.tasks import DependencyCycleError
from treadle.weft.runtime import Runtime

PERSONA = ("Mary Jackson", "mary@example.com")
LOOKALIKE = ("Mary Jackman", "mary.jackman@example.com")
NOTE, ESC, RES, CREDIT, TICKET = "crm:crm-note", "crm:crm-escalate", "crm:crm-resolve", "crm:crm-credit", \
    "shop:shop-open-ticket"


def _hashes(rt):
    return {"shop": rt.register(shop), "crm": rt.register(crm)}


@pytest.fixture(scope="module")
def certified(bundles):
    async def main():
        async with Runtime() as rt:
            ct = compose(bundles, propose_groups(bundles)["ada@example.com"], name="ada", persona=PERSONA,
                         lookalike=LOOKALIKE)
            return await certify_composed(rt, ct, _hashes(rt))
    return anyio.run(main)


# every injectable (fault, node) of the Ada composition: (what was injected, R of a correct agent, blamed part)
EXPECTED = {
    ("wrong_binding", TICKET): ("open_ticket.customer_id 4 -> 1", 0.8, f"binding:{TICKET}.0.customer_id"),
    ("wrong_binding", NOTE): ("add_note.case_id 3 -> 1", 0.8, f"binding:{NOTE}.1.case_id"),
    ("wrong_binding", ESC): ("escalate_case.case_id 3 -> 1", 0.8, f"binding:{ESC}.2.case_id"),
    ("wrong_binding", RES): ("resolve_case.case_id 3 -> 1", 0.8, f"binding:{RES}.0.case_id"),
    ("wrong_binding", CREDIT): ("issue_credit.contact_id 'C-005' -> 'C-001'", 0.8, f"binding:{CREDIT}.0.contact_id"),
    ("unbound_text", TICKET): ("open_ticket.subject -> 'Mug handle loose (customer 1)'", 0.8,
                               f"binding:{TICKET}.0.subject"),
    ("unbound_text", NOTE): ("add_note.body -> 'Replacement mug on its way (contact C-001)'", 0.8,
                             f"binding:{NOTE}.1.body"),
    ("unbound_text", RES): ("resolve_case.resolution -> 'Replacement sent (contact C-001)'", 0.8,
                            f"binding:{RES}.0.resolution"),
    ("unbound_text", CREDIT): ("issue_credit.reason -> 'Chipped mug (contact C-001)'", 0.8,
                               f"binding:{CREDIT}.0.reason"),
    # escalate before the note: every check still passes; only the edge check sees it
    ("dropped_edge", ESC): ("dropped edges to ['crm:crm-note']", 1.0, f"edges:{ESC}"),
    ("dropped_edge", RES): ("dropped edges to ['crm:crm-note', 'crm:crm-escalate']", 0.6, f"edges:{RES}"),
    ("dropped_edge", CREDIT): ("dropped edges to ['crm:crm-note', 'crm:crm-escalate', 'crm:crm-resolve']", 1.0,
                               f"edges:{CREDIT}"),
    ("cycle", NOTE): (f"{TICKET} made to depend on {NOTE}", None, f"edges:{TICKET}"),
    ("cycle", ESC): (f"{NOTE} made to depend on {ESC}", None, f"edges:{NOTE}"),
    ("cycle", RES): (f"{ESC} made to depend on {RES}", None, f"edges:{ESC}"),
    ("cycle", CREDIT): (f"{RES} made to depend on {CREDIT}", None, f"edges:{RES}"),
}


def test_each_composed_fault_is_attributed_and_only_its_part_revised(certified):
    async def main():
        async with Runtime() as rt:
            h = _hashes(rt)
            tools = cr.server_tools(rt, h)
            assert (await cr.recertify_composed(rt, certified, h)).certified
            assert cr.binding_faults(certified, tools) == [] and cr.edge_faults(certified, certified) == []
            rows = {}
            for how in cr.COMPOSED_FAULTS:
                for node in certified.nodes:
                    inj = cr.inject(certified, tools, how, node.name)
                    if inj is None:
                        continue
                    bad, what = inj
                    try:
                        res = await run_composed(rt, bad, h, cr.plan_policy(certified))
                    except DependencyCycleError:
                        res = None
                    reward = None if res is None else res.reward
                    if reward == 1.0 and not (cr.binding_faults(bad, tools) or cr.edge_faults(bad, certified)):
                        rows[(how, node.name)] = (what, reward, None, None, None, None)
                        continue
                    verdicts = await cr.attribute_composed(rt, bad, certified, h, res)
                    fixed = cr.revise_composed(bad, certified, [v.fault for v in verdicts])
                    before, after = cr.component_digests(bad), cr.component_digests(fixed)
                    changed = sorted(k for k in before if before[k] != after[k])
                    cert = await cr.recertify_composed(rt, fixed, h)
                    rows[(how, node.name)] = (what, reward, verdicts, changed,
                                              after == cr.component_digests(certified), cert)
            return rows
    rows = anyio.run(main)
    assert set(rows) == set(EXPECTED)
    for key, (what, reward, verdicts, changed, restored, cert) in rows.items():
        want_what, want_reward, part = EXPECTED[key]
        assert want_what in what and reward == want_reward, (key, what, reward)
        if part is None:  # unobserved: a correct agent still passes, nothing to attribute
            continue
        [v] = verdicts
        assert v.attribution.blame == Blame.task and v.component == part, key
        assert v.attribution.rule == ("composed_binding" if "binding" in part else "composed_edge")
        kind, name = part.split(":", 1)
        node = name.rsplit(".", 2)[0] if kind == "binding" else name
        assert changed == [f"{'calls' if kind == 'binding' else 'edges'}:{node}"], key  # nothing else changed
        assert restored and cert.certified and all(cert.checks.values()), key
    # the binding fault on the note is invisible to certification by execution (it acts on Ada's own case 1):
    # only the binding check catches it
    fault = rows[("wrong_binding", NOTE)][2][0].fault
    assert (fault.found, fault.expected) == (1, 3)


def test_a_wrong_binding_that_executes_is_refused_by_certification_and_so_is_a_cycle(certified):
    async def main():
        async with Runtime() as rt:
            h = _hashes(rt)
            tools = cr.server_tools(rt, h)
            wrong, _ = cr.inject(certified, tools, "wrong_binding", NOTE)
            text, _ = cr.inject(certified, tools, "unbound_text", RES)
            looped, _ = cr.inject(certified, tools, "cycle", RES)
            dropped, _ = cr.inject(certified, tools, "dropped_edge", RES)
            return [await cr.recertify_composed(rt, t, h) for t in (wrong, text, looped, dropped)]
    wrong, text, looped, dropped = anyio.run(main)
    # certification by execution alone accepts both wrong bindings (the faulty task's own reference plan passes its
    # checks, and the baselines hold: the note lands on Ada's own case 1): only the binding check refuses them
    text_why = "resolve_case.resolution='Replacement sent (contact C-001)' names an object"
    for cert, why in ((wrong, "add_note.case_id=1 names a case"), (text, text_why)):
        assert not cert.certified and cert.checks["bindings_hold"] is False
        assert all(v for k, v in cert.checks.items() if k != "bindings_hold")
        assert any(why in r for r in cert.reasons), cert.reasons
    assert not looped.certified and looped.checks == {"acyclic": False} and "cycle" in looped.reasons[0]
    assert not dropped.certified and dropped.checks["gold_passes"] is False
    assert any("case 3 is resolved" in r for r in dropped.reasons)


def test_an_id_outside_the_contract_mapping_is_checked_too(certified):
    """An argument the contract does not map but named like an entity column (``order_ref``), or nested in an
    object, naming the original object is a binding fault; another object's id is not (it may be legitimate)."""
    async def main():
        async with Runtime() as rt:
            return cr.server_tools(rt, _hashes(rt))
    tools = anyio.run(main)
    node = next(n for n in certified.nodes if n.name == CREDIT)
    [call] = node.atomic.checkpoint.gold_calls

    def with_arg(arg, value):
        c = call.model_copy(update={"arguments": {**call.arguments, arg: value}})
        spec = node.atomic.checkpoint.model_copy(update={"gold_calls": [c]})
        return cr._replace_node(certified, node.model_copy(update={"atomic": node.atomic.model_copy(
            update={"checkpoint": spec})}))

    cases = [("meta", {"order_ref": 1, "note": "see order 1"}, {"order_ref": 3, "note": "see order 3"}),
             ("related", [{"contact_id": "C-001"}, {"contact_id": "C-002"}],
              [{"contact_id": "C-005"}, {"contact_id": "C-002"}]),
             ("order_ref_2", 1, None), ("meta", {"order_ref": 2}, None), ("flag", True, None),
             # the credit node concerns no case: a case id or mention is not a bound object there
             ("case_id", 1, None), ("note", "see case 1", None)]
    for arg, value, want in cases:
        faults = cr.binding_faults(with_arg(arg, value), tools)
        if want is None:
            assert faults == [], (arg, value)
        else:
            [f] = faults
            assert (f.arg, f.found, f.expected, f.free_text) == (arg, value, want, True), (arg, value)


def test_free_text_binding_check_follows_the_composition_rewrite(certified):
    """A free-text argument naming the original object by noun and id, or by e-mail, is a binding fault whose
    expected text holds the bound values; an id without its noun, or another object's id, is not."""
    async def main():
        async with Runtime() as rt:
            return cr.server_tools(rt, _hashes(rt))
    tools = anyio.run(main)

    def with_reason(text):
        node = next(n for n in certified.nodes if n.name == CREDIT)
        [call] = node.atomic.checkpoint.gold_calls
        call = call.model_copy(update={"arguments": {**call.arguments, "reason": text}})
        spec = node.atomic.checkpoint.model_copy(update={"gold_calls": [call]})
        node = node.model_copy(update={"atomic": node.atomic.model_copy(update={"checkpoint": spec})})
        return cr._replace_node(certified, node)

    cases = {"Refund for order 1": "Refund for order 3", "Chipped mug, contact C-001": "Chipped mug, contact C-005",
             "asked by ada@example.com": "asked by mary@example.com", "Orders #1 and 2": "Orders #3 and 2",
             "Chipped mug (1 item)": None, "Refund for order 3": None, "ask mary@example.com": None,
             "order 12 too": None}
    for text, want in cases.items():
        faults = cr.binding_faults(with_reason(text), tools)
        if want is None:
            assert faults == [], text
        else:
            [f] = faults
            assert (f.node, f.arg, f.found, f.expected, f.free_text) == (CREDIT, "reason", text, want, True), text
            fixed = cr.revise_composed(with_reason(text), certified, faults)  # the certified text comes back
            assert cr.component_digests(fixed) == cr.component_digests(certified)


def test_structure_intact_failures_go_to_policy_and_a_pass_is_refused(certified):
    def skip_credit(node, history):
        return [] if node.name == CREDIT else list(node.atomic.checkpoint.gold_calls)

    async def main():
        async with Runtime() as rt:
            h = _hashes(rt)
            res = await run_composed(rt, certified, h, skip_credit)
            verdicts = await cr.attribute_composed(rt, certified, certified, h, res)
            ok = await run_composed(rt, certified, h)
            with pytest.raises(ValueError, match="passed"):
                await cr.attribute_composed(rt, certified, certified, h, ok)
            return verdicts
    [v] = anyio.run(main)
    assert v.fault is None and v.attribution.blame == Blame.policy and v.attribution.checkpoint == CREDIT
    assert v.attribution.rule == "reference_passes" and v.component == f"policy:{CREDIT}"


def test_inject_refuses_unknown_kinds_and_nodes(certified):
    with pytest.raises(ValueError, match="unknown composed fault"):
        cr.inject(certified, {}, "swap", NOTE)
    with pytest.raises(ValueError, match="no node 'crm:nope'"):
        cr.inject(certified, {}, "cycle", "crm:nope")


def test_the_loop_repairs_composed_faults_and_touches_nothing_else(certified):
    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)

    async def main():
        async with Runtime() as rt:
            tools = cr.server_tools(rt, _hashes(rt))
            wrong = cr.inject(certified, tools, "wrong_binding", CREDIT)[0].model_copy(update={"name": "ada-binding"})
            dropped = cr.inject(certified, tools, "dropped_edge", RES)[0].model_copy(update={"name": "ada-edge"})
            src = {"shop": inspect.getsource(shop), "crm": inspect.getsource(crm)}
            system = EvolvingSystem(sources=dict(src), certified=dict(src), tasks=[], composed=[
                ComposedSlot(task=wrong, certified=certified.model_copy(update={"name": "ada-binding"})),
                ComposedSlot(task=dropped, certified=certified.model_copy(update={"name": "ada-edge"}))])
            first = system.digests()
            rounds = await evolve(rt, system, rates={}, max_rounds=4)
            return rounds, first, system.digests(), system
    rounds, first, last, system = anyio.run(main)
    r1, r2 = rounds[0], rounds[1]
    assert r1.tasks == 2 and r1.passed == 0 and r2.passed == 2 and len(rounds) == 3  # round 3: no fall, stop
    # round 1: the note and the escalation fail on the case resolved first
    assert r1.tool_errors == 2 and r2.tool_errors == 0 and r2.error_rate == 0.0
    assert r1.blamed == r1.revised == [f"composed:ada-binding/calls:{CREDIT}", f"composed:ada-edge/edges:{RES}"]
    assert sorted(c for c in first if first[c] != last[c]) == r1.revised and all(r.untouched_ok for r in rounds)
    assert r1.revalidated == {"composed:ada-binding": True, "composed:ada-edge": True}
    assert [a.rule for a in r1.attributions] == ["composed_binding", "composed_edge"]
    assert r2.attributions == [] and r2.revised == []
    assert [s.version for s in system.composed] == [2, 2]
    theirs = cr.component_digests(certified)
    assert all(cr.component_digests(s.task) == theirs for s in system.composed)


def test_a_composed_node_whose_gold_value_nothing_gives_is_the_tasks(certified):
    """The credit node's amount changed to one no request, earlier node or tool result gives: a correct agent
    (the request's amount) fails it and the task is blamed, not the policy."""
    from treadle.weft.runtime.callparse import ToolCall

    node = next(n for n in certified.nodes if n.name == CREDIT)
    gold = list(node.atomic.checkpoint.gold_calls)
    bad_gold = [ToolCall(name=c.name, arguments={**c.arguments, "amount_cents": 777})
                if c.name == "issue_credit" else c for c in gold]
    bad_node = node.model_copy(update={"atomic": node.atomic.model_copy(update={
        "checkpoint": node.atomic.checkpoint.model_copy(update={"gold_calls": bad_gold})})})
    bad = certified.model_copy(update={"nodes": tuple(bad_node if n.name == CREDIT else n for n in certified.nodes)})

    def request_amount(n, history):
        return list((node if n.name == CREDIT else n).atomic.checkpoint.gold_calls)

    async def main():
        async with Runtime() as rt:
            h = _hashes(rt)
            res = await run_composed(rt, bad, h, request_amount)
            return await cr.attribute_composed(rt, bad, bad, h, res)
    [v] = anyio.run(main)
    assert (v.attribution.blame, v.attribution.rule, v.attribution.checkpoint) == (Blame.task, "underivable_gold",
                                                                                   CREDIT)
    assert "777" in v.attribution.detail

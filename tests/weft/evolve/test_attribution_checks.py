"""The checks that hold off the reference's path: contracts, off-path inputs, harness formats, task grounding,
free text and negative controls (each on a small hand-built case), and certification's expected effect."""
import inspect
import logging

import anyio
import pytest

from treadle.weft.runtime.callparse import parse_call
from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
from treadle.weft.evolve import probes, task_checks, text_checks
from treadle.weft.evolve.attribute import generate_verifier, record_evidence
from treadle.weft.evolve.certify import certify_task, play
from treadle.weft.evolve.faults import EnvBug, patch_source
from treadle.weft.evolve.faults_heldout import (
    ArgsPromptReAct,
    CommaCuttingReAct,
    FirstArgumentNative,
    FunctionTagPromptHermes,
    ListDroppingHermes,
    LowercasingReAct,
)
from treadle.weft.rollouts.harnesses import HermesHarness, NativeHarness, ReActHarness
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.state import RowChange, StateDiff, TableDiff

logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)


def _tool(writes, a2s):
    return {"contract": {"writes": list(writes), "args_to_state": a2s}}


def test_contract_violations_units_direction_wrong_row_and_read_only():
    credit = _tool(["credits"], {"amount_cents": "credits.amount_cents"})
    d = StateDiff(tables={"credits": TableDiff(added={"[1]": {"id": 1, "amount_cents": 50000}})})
    assert "amount_cents" in probes.contract_violations(credit, parse_call("issue_credit(amount_cents=500)"), d)[0]
    d = StateDiff(tables={"credits": TableDiff(added={"[1]": {"id": 1, "amount_cents": 500}})})
    assert probes.contract_violations(credit, parse_call("issue_credit(amount_cents=500)"), d) == []
    restock = _tool(["orders", "products"], {"order_id": "orders.id; orders.status := 'cancelled'; "
                                                          "products.stock += qty"})
    rows = {"orders": TableDiff(changed={"[2]": RowChange(before={"id": 2, "status": "placed"},
                                                          after={"id": 2, "status": "cancelled"})}),
            "products": TableDiff(changed={'["TEE"]': RowChange(before={"sku": "TEE", "stock": 3},
                                                                after={"sku": "TEE", "stock": 2})})}
    assert "+=" in probes.contract_violations(restock, parse_call("cancel_order(order_id=2)"),
                                              StateDiff(tables=rows))[0]
    tier = _tool(["contacts"], {"contact_id": "contacts.id; contacts.tier := tier"})
    wrong = StateDiff(tables={"contacts": TableDiff(changed={'["C-004"]': RowChange(
        before={"id": "C-004", "tier": "standard"}, after={"id": "C-004", "tier": "vip"})})})
    assert "another row" in probes.contract_violations(
        tier, parse_call('set_tier(contact_id="C-003", tier="vip")'), wrong)[0]
    read = _tool([], {"case_id": "cases.id"})
    assert "read-only" in probes.contract_violations(read, parse_call("get_case(case_id=1)"), wrong)[0]


@pytest.mark.parametrize("bad", [LowercasingReAct(), ListDroppingHermes(), FirstArgumentNative(), CommaCuttingReAct(),
                                 ArgsPromptReAct(), FunctionTagPromptHermes()])
def test_a_harness_that_cannot_carry_the_reference_is_found(bad):
    calls = [parse_call('issue_credit(contact_id="C-001", amount_cents=1200, reason="Chipped mug", order_ref=1)'),
             parse_call('place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])')]
    assert probes.harness_faults(bad, calls)
    for good in (HermesHarness(), ReActHarness(), NativeHarness()):
        assert probes.harness_faults(good, calls) == []


def test_instructions_that_teach_another_format_are_found():
    class Mute(ReActHarness):
        def instructions(self, tools):
            return "Answer with 'Thought:' and 'Action:' lines and 'Action Args: <JSON object>'."
    assert "Action Input:" in probes.harness_faults(Mute(), [parse_call("get_case(case_id=1)")])[0]


def test_free_text_by_meaning_and_quoted_text_exactly():
    assert text_checks.text_verdict("Replacement mug on its way", "A replacement mug is on its way") == "same"
    assert text_checks.text_verdict("Replacement sent", "Replacement not sent") == "different"
    assert text_checks.text_verdict("Replacement sent", "Refund issued to the card") == "different"
    assert text_checks.text_verdict("Replacement sent", "Sent a replacement",
                                    'Close it with the resolution "Replacement sent".') == "different"
    assert text_checks.text_verdict("Replacement sent", "wrong-Replacement sent") == "undecided"


def test_gold_values_must_come_from_the_request_history_or_results():
    tools = {}
    gold = [parse_call('find_customer(email="grace@example.com")'),
            parse_call('place_order(customer_id=3, items=[{"sku": "TEE", "qty": 3}])')]
    results = [{"id": 3, "name": "Grace Hopper", "email": "grace@example.com"}, {"order_id": 3}]
    missing = task_checks.underivable_values("I'm grace@example.com; order a cotton tee (TEE).", gold, results, tools)
    assert missing == ["place_order.items[].qty=3"]
    assert task_checks.underivable_values("I'm grace@example.com; order three cotton tees (TEE).", gold, results,
                                          tools) == []
    assert task_checks.underivable_values("Give C-002 a goodwill credit.", [parse_call(
        'issue_credit(contact_id="C-002", amount_cents=750, reason="Goodwill")')], [{}], tools) == [
        "issue_credit.amount_cents=750"]


def _run(coro):
    async def main():
        async with Runtime() as rt:
            return await coro(rt)
    return anyio.run(main)


def test_certification_refuses_a_server_born_with_a_wrong_row_write():
    bug = EnvBug(name="tier", tool="set_tier", old='WHERE id = ?", (tier, contact_id))',
                 new='WHERE id = ?", (tier, "C-%03d" % (int(contact_id[2:]) + 1)))')
    task = {t.name: t for t in crm_tasks.candidates()}["crm-vip"]

    async def go(rt):
        healthy = await certify_task(rt, rt.register(crm), crm.initial_snapshot(), task)
        broken = await certify_task(rt, rt.register(patch_source(inspect.getsource(crm), bug)),
                                    crm.initial_snapshot(), task)
        return healthy, broken
    healthy, broken = _run(go)
    assert healthy.certified and healthy.checks["expected_effect"]
    assert not broken.certified and not broken.checks["expected_effect"] and "another row" in broken.reasons[0]


def test_off_path_input_found_by_probing_the_reference_neighbourhood():
    bug = EnvBug(name="case", tool="find_customer", old='WHERE lower(email) = lower(?)", (email.strip(),))',
                 new='WHERE email = ?", (email.strip(),))')
    gold = [parse_call('find_customer(email="grace@example.com")')]

    async def go(rt):
        h = rt.register(shop)
        b = rt.register(patch_source(inspect.getsource(shop), bug))
        tools = {t["name"]: t for t in rt.registry.spec(h).tools}
        return (await probes.probe_off_path(rt, h, b, shop.initial_snapshot(), gold, tools),
                await probes.probe_off_path(rt, h, h, shop.initial_snapshot(), gold, tools))
    found, none = _run(go)
    assert "letter_case" in found and none is None


def test_negative_controls_expose_a_lenient_verifier_and_spare_a_sound_one():
    task = {t.name: t for t in shop_atomic.candidates()}["shop-place-order"]
    gold = list(task.checkpoint.gold_calls)

    async def go(rt):
        h = rt.register(shop)
        start = shop.initial_snapshot()
        tools = {t["name"]: t for t in rt.registry.spec(h).tools}
        ev = await record_evidence(rt, h, start, task.name, gold)
        sound = generate_verifier(task.checkpoint, start, ev)
        lenient = sound.model_copy(update={"compare_state": False, "assertions": [], "expected_returns": [],
                                           "gold_results_contained": False})
        return (await text_checks.negative_controls(rt, h, start, sound, gold, tools),
                await text_checks.negative_controls(rt, h, start, lenient, gold, tools))
    sound, lenient = _run(go)
    assert sound == [] and any("do-nothing" in x for x in lenient)


def test_a_generated_verifier_with_the_request_accepts_a_paraphrase_only():
    task = {t.name: t for t in crm_tasks.candidates()}["crm-note"]
    gold = list(task.checkpoint.gold_calls)

    def note(body):
        return [parse_call("get_case(case_id=1)"), parse_call(f'add_note(case_id=1, body="{body}")')]

    async def go(rt):
        h = rt.register(crm)
        start = crm.initial_snapshot()
        ev = await record_evidence(rt, h, start, task.name, gold)
        spec = generate_verifier(task.checkpoint, start, ev, request=task.request)
        out = []
        for body in ("A replacement mug is on its way", "Refund issued to the card", "Replacement mug on its way"):
            out.append((await play(rt, h, start, spec, note(body)))[1].r)
        return out
    assert _run(go) == [1, 0, 1]


def test_a_row_left_in_another_state_than_the_tools_name_declares():
    domains = {"tickets": {"status": {"open", "closed"}}, "orders": {"status": {"placed", "shipped", "cancelled"}}}
    opened = StateDiff(tables={"tickets": TableDiff(added={"[2]": {"id": 2, "customer_id": 1, "status": "closed"}})})
    tool = _tool(["tickets"], {"customer_id": "tickets.customer_id"})
    call = parse_call('open_ticket(customer_id=1, subject="Loose handle")')
    assert "declares 'open'" in probes.contract_violations(tool, call, opened, domains)[0]
    assert probes.contract_violations(tool, call, opened) == []  # no schema domains: nothing to compare with
    fine = StateDiff(tables={"tickets": TableDiff(added={"[2]": {"id": 2, "customer_id": 1, "status": "open"}})})
    assert probes.contract_violations(tool, call, fine, domains) == []
    cancelled = StateDiff(tables={"orders": TableDiff(changed={"[2]": RowChange(
        before={"id": 2, "status": "placed"}, after={"id": 2, "status": "shipped"})})})
    assert "'cancelled'" in probes.named_state_violations("cancel_order", cancelled, domains)[0]
    assert probes.named_state_violations("escalate_case", cancelled, domains) == []  # no such state: no claim
    con = __import__("sqlite3").connect(":memory:")
    con.executescript(shop.SCHEMA)
    assert probes.state_domains(con)["tickets"] == {"status": {"open", "closed"}}


def test_a_declared_change_that_changes_nothing():
    tool = _tool(["orders", "order_items", "products"],
                 {"items": "order_items(sku, qty); products.stock -= qty"})
    call = parse_call('place_order(customer_id=3, items=[{"sku": "MUG", "qty": 2}])')
    none = StateDiff(tables={"orders": TableDiff(added={"[3]": {"id": 3}})})
    assert "changed no products.stock" in probes.contract_violations(tool, call, none)[0]
    kept = StateDiff(tables={"products": TableDiff(changed={'["MUG"]': RowChange(
        before={"sku": "MUG", "stock": 10}, after={"sku": "MUG", "stock": 8})})})
    assert probes.contract_violations(tool, call, kept) == []
    restock = _tool(["orders", "products"], {"order_id": "orders.id; products.stock += qty"})
    assert probes.contract_violations(restock, parse_call("cancel_order(order_id=2)"), StateDiff(tables={})) == []


def test_a_request_that_restates_a_quantity_with_another_value():
    credit = [parse_call('issue_credit(contact_id="C-002", amount_cents=500, reason="Goodwill")')]
    assert "two values" in task_checks.restated_quantities("A credit of 500 cents ($20), please.", credit)
    assert task_checks.restated_quantities("A credit of 500 cents ($5), please.", credit) is None
    assert task_checks.restated_quantities("500 cents now and $20 next month.", credit) is None
    mugs = [parse_call('place_order(customer_id=1, items=[{"sku": "MUG", "qty": 2}])')]
    assert task_checks.restated_quantities("Order two (3) mugs.", mugs)
    assert task_checks.restated_quantities("Cancel order 2 (1 item).", [parse_call("cancel_order(order_id=2)")]) is None
    wait = [parse_call("snooze(seconds=5400)")]
    assert task_checks.restated_quantities("Snooze it for 90 minutes, i.e. 2 hours.", wait)
    assert task_checks.restated_quantities("Snooze it for 90 minutes, i.e. 1.5 hours.", wait) is None


def _controls(rt, mod, task, change):
    async def go():
        h = rt.register(mod)
        start = mod.initial_snapshot()
        tools = {t["name"]: t for t in rt.registry.spec(h).tools}
        gold = list(task.checkpoint.gold_calls)
        ev = await record_evidence(rt, h, start, task.name, gold)
        sound = generate_verifier(task.checkpoint, start, ev)
        return (await text_checks.negative_controls(rt, h, start, sound, gold, tools),
                await text_checks.negative_controls(rt, h, start, change(sound), gold, tools))
    return go()


def test_negative_controls_include_a_read_only_agent_and_an_unrequested_write():
    from treadle.weft.runtime.verify import StateAssertion

    vip = {t.name: t for t in crm_tasks.candidates()}["crm-vip"]
    cancel = {t.name: t for t in shop_atomic.candidates()}["shop-cancel-order"]
    lookup_only = {"compare_state": False, "gold_results_contained": False, "expected_returns": [{"id": "C-003"}],
                   "assertions": []}
    status_only = {"compare_state": False, "expected_returns": [], "assertions": [StateAssertion(
        sql="SELECT status FROM orders WHERE id = 2", expected=[["cancelled"]])]}

    async def go(rt):
        return (await _controls(rt, crm, vip, lambda s: s.model_copy(update=lookup_only)),
                await _controls(rt, shop, cancel, lambda s: s.model_copy(update=status_only)))
    (sound_vip, lenient_vip), (sound_cancel, lenient_cancel) = _run(go)
    assert sound_vip == [] and sound_cancel == []
    assert any("read-only agent" in x for x in lenient_vip)
    assert any("another" in x or "perturbed" in x for x in lenient_vip)  # set_tier on a contact that can take it
    assert any("unrequested write" in x for x in lenient_cancel)


def test_no_generated_verifier_of_a_certified_task_fails_a_negative_control():
    """The added controls spare every sound verifier: the default verifier of each certified shop and CRM task."""
    from treadle.weft.evolve.certify import certify_server

    async def go(rt):
        out = {}
        for mod, cands in ((shop, shop_atomic.candidates()), (crm, crm_tasks.candidates())):
            h = rt.register(mod)
            start = mod.initial_snapshot()
            tools = {t["name"]: t for t in rt.registry.spec(h).tools}
            for task in (await certify_server(rt, h, start, cands)).kept:
                gold = list(task.checkpoint.gold_calls)
                ev = await record_evidence(rt, h, start, task.name, gold)
                spec = generate_verifier(task.checkpoint, start, ev)
                out[task.name] = await text_checks.negative_controls(rt, h, start, spec, gold, tools)
        return out
    found = _run(go)
    assert len(found) >= 8 and all(v == [] for v in found.values()), found


def test_certification_refuses_servers_born_against_their_names_or_declared_changes():
    closed = EnvBug(name="closed", tool="open_ticket", old="VALUES (?, ?, ?, 'open')", new="VALUES (?, ?, ?, 'closed')")
    stock = EnvBug(name="stock", tool="place_order",
                   old='db.execute("UPDATE products SET stock = stock - ? WHERE sku = ?", (qty, sku))', new="pass")
    tasks = {t.name: t for t in shop_atomic.candidates()}

    async def go(rt):
        out = []
        for bug, name in ((closed, "shop-open-ticket"), (stock, "shop-place-order")):
            h = rt.register(patch_source(inspect.getsource(shop), bug))
            out.append(await certify_task(rt, h, shop.initial_snapshot(), tasks[name]))
        return out
    closed_cert, stock_cert = _run(go)
    assert not closed_cert.checks["expected_effect"] and "declares 'open'" in " ".join(closed_cert.reasons)
    assert not stock_cert.checks["expected_effect"] and "changed no products.stock" in " ".join(stock_cert.reasons)

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

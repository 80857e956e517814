"""Composition across the shop and the CRM: ranking, groups, bindings, grounding, DAG, reference plan."""
import anyio
import pytest

from treadle.weft.envs import crm
from treadle.weft.evolve import grounding
from treadle.weft.evolve.compose import (
    ComposedTask,
    ServerBundle,
    certify_composed,
    compose,
    propose_groups,
    rank_combinations,
    run_composed,
)
from treadle.weft.rollouts.tasks import DependencyCycleError
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import SqliteState

PERSONA = ("Mary Jackson", "mary@example.com")
LOOKALIKE = ("Mary Jackman", "mary.jackman@example.com")


def _hashes(rt, bundles):
    from treadle.weft.envs import shop
    return {"shop": rt.register(shop), "crm": rt.register(crm)}


def _composed(bundles, who):
    return compose(bundles, propose_groups(bundles)[who], name=who, persona=PERSONA, lookalike=LOOKALIKE)


def test_ranking_prefers_shared_entities_and_penalises_redundancy(bundles):
    shop_b, crm_b = bundles
    [top] = rank_combinations(bundles, 2)
    assert top.servers == ("shop", "crm") and top.shared_entities == ("customer", "order")
    assert top.complementary == 2 and top.redundant_tools == 0 and top.composable_tasks > 0
    twin = ServerBundle(name="crm", server_hash=crm_b.server_hash, snapshot=crm_b.snapshot, tools=crm_b.tools,
                        kept=crm_b.kept)  # a second CRM: every tool redundant
    scores = {s.servers: s for s in rank_combinations([shop_b, crm_b, twin], 2)}
    assert scores[("crm", "crm")].redundant_tools == len(crm_b.tools)
    assert scores[("crm", "crm")].score < scores[("shop", "crm")].score
    with pytest.raises(ValueError, match="size"):
        rank_combinations(bundles, 1)


def test_groups_span_both_servers_and_hold_only_rebindable_tasks(bundles):
    groups = propose_groups(bundles)
    assert set(groups) == {"ada@example.com", "alan@example.com", "grace@example.com"}
    assert [t.name for _, t in groups["alan@example.com"]] == ["shop-cancel-order", "shop-ship-order", "crm-open-case"]
    names = {t.name for ts in groups.values() for _, t in ts}
    assert "shop-close-ticket" not in names  # its SQL assertion holds literal ids


def test_bindings_name_the_same_object_on_both_servers(bundles):
    ct = _composed(bundles, "ada@example.com")
    by = {b.kind: b for b in ct.bindings}
    assert by["customer"].identity == "ada@example.com" and by["customer"].new_identity == PERSONA[1]
    assert by["customer"].ids == {"shop": (1, 4), "crm": ("C-001", "C-005")}
    assert by["order"].ids == {"shop": (1, 3)} and by["case"].ids == {"crm": (1, 3)}
    shop_db, crm_db = (grounding.open_copy(ct.snapshots[s]) for s in ("shop", "crm"))
    try:
        assert shop_db.execute("SELECT email FROM customers WHERE id = 4").fetchone() == (PERSONA[1],)
        assert crm_db.execute("SELECT email, tier FROM contacts WHERE id = 'C-005'").fetchone() == (PERSONA[1], "vip")
        assert shop_db.execute("SELECT customer_id, status FROM orders WHERE id = 3").fetchone() == (4, "shipped")
        assert shop_db.execute("SELECT sku, qty FROM order_items WHERE order_id = 3").fetchall() == [("MUG", 2)]
        assert crm_db.execute("SELECT contact_id, order_ref, status FROM cases WHERE id = 3").fetchone() == (
            "C-005", 3, "new")
        assert crm_db.execute("SELECT body FROM notes WHERE case_id = 3").fetchall() == [
            ("Customer sent a photo of the chipped mug.",)]
        # round 3: a finished history record (no reference to another's order) and a look-alike on each server
        assert crm_db.execute("SELECT contact_id, order_ref, status FROM cases WHERE id = 4").fetchone() == (
            "C-005", None, "resolved")
        assert shop_db.execute("SELECT name FROM customers WHERE email = ?", (LOOKALIKE[1],)).fetchone() == (
            LOOKALIKE[0],)
    finally:
        shop_db.close()
        crm_db.close()
    gold = {n.name: n.atomic.gold for n in ct.nodes}
    assert gold["crm:crm-credit"] == ["issue_credit(contact_id='C-005', amount_cents=1200, reason='Chipped mug', "
                                      "order_ref=3)"]
    assert [n.name for n in ct.nodes if "crm:crm-note" in n.depends_on] == [
        "crm:crm-escalate", "crm:crm-resolve", "crm:crm-credit"]
    assert {n.name: n.atomic.request for n in ct.nodes}["crm:crm-resolve"] == "Resolve case 3: replacement sent."


@pytest.mark.parametrize("who", ["ada@example.com", "alan@example.com", "grace@example.com"])
def test_reference_plan_passes_and_leaves_distractors_alone(bundles, who):
    async def main():
        async with Runtime() as rt:
            hashes = _hashes(rt, bundles)
            ct = await certify_composed(rt, _composed(bundles, who), hashes)
            res = await run_composed(rt, ct, hashes, keep_final=True)
            again = await run_composed(rt, ct, hashes, keep_final=True)  # sessions from the snapshot: reset exactly
            return ct, res, again
    ct, res, again = anyio.run(main)
    assert res.reward == 1.0 and len(res.results) == len(ct.nodes) >= 2
    assert {n.server for n in ct.nodes} == {"shop", "crm"}
    for s in ("shop", "crm"):
        diff = SqliteState(ct.snapshots[s]).diff(res.final[s])
        assert SqliteState(res.final[s]).diff(again.final[s]).empty
        for t in diff.tables.values():  # no row of the look-alike (shop id 5 / CRM C-006) changed
            for key, change in t.changed.items():
                assert "C-006" not in str(key) and "mary.jackman" not in str(change)
    if who == "alan@example.com":
        assert ct.dropped == ("shop:shop-ship-order",)  # shipping the order the plan cancelled


def test_a_wrong_plan_fails_the_nodes_it_breaks(bundles):
    def skip_credit(node, history):
        return [] if node.name == "crm:crm-credit" else list(node.atomic.checkpoint.gold_calls)

    async def main():
        async with Runtime() as rt:
            return await run_composed(rt, _composed(bundles, "ada@example.com"), _hashes(rt, bundles), skip_credit)
    res = anyio.run(main)
    assert [r.r for r in res.results] == [1, 1, 1, 1, 0]


def test_cycle_and_bad_members_are_refused(bundles):
    ct = _composed(bundles, "grace@example.com")
    a, b = ct.nodes
    looped = ct.model_copy(update={"nodes": (a.model_copy(update={"depends_on": (b.name,)}), b)})
    with pytest.raises(DependencyCycleError, match="cycle"):
        looped.ordered()
    with pytest.raises(ValueError, match="unknown server"):
        compose(bundles, [("mail", a.atomic)], name="x", persona=PERSONA)
    shop_b = bundles[0]
    [close] = [t for t in shop_b.kept if t.name == "shop-close-ticket"]
    with pytest.raises(ValueError, match="not rebindable"):
        compose(bundles, [("shop", close)], name="x", persona=PERSONA)
    assert isinstance(ct, ComposedTask)


def test_grounding_refuses_a_cross_server_reference_to_another_customers_order(bundles):
    from treadle.weft.runtime.sqlite_state import snapshot_from_sql

    shop_b, crm_b = bundles
    bad = snapshot_from_sql(crm.SCHEMA, crm.SEED, "INSERT INTO cases VALUES (9, 'C-002', 1, 'Wrong', 'low', 'new', NULL);")
    broken = ServerBundle(name="crm", server_hash=crm_b.server_hash, snapshot=bad, tools=crm_b.tools, kept=crm_b.kept)
    with pytest.raises(grounding.GroundingError, match="belongs to 'ada@example.com'"):
        compose([shop_b, broken], propose_groups(bundles)["grace@example.com"], name="x", persona=PERSONA)

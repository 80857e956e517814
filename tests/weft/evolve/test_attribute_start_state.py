"""Rule ``precondition_state`` of deterministic attribution: a start state that is not the certified one is blamed
(task) only when the reference fails or differs from it on the *certified* server too, or the verifier fails the
reference from it and passes it from the certified start; a broken server stays the environment's even from another
start, and a verifier that fails the reference from the certified start too the evaluator's. Works without an entity
map (BFCL object state: test_faults_bfcl.py)."""
import inspect

import anyio

from treadle.weft.envs import shop, shop_atomic
from treadle.weft.evolve.attribute import Blame, attribute, generate_verifier, record_evidence
from treadle.weft.evolve.faults import SHOP_BUGS, corrupt_verifier, patch_source
from treadle.weft.evolve.grounding import freeze, open_copy
from treadle.weft.runtime import Runtime

TASK = {t.name: t for t in shop_atomic.candidates()}["shop-ship-order"]


def _changed(*sql):
    con = open_copy(shop.initial_snapshot())
    try:
        for q in sql:
            con.execute(q)
        return freeze(con)
    finally:
        con.close()


def _attribute(run_start, *, broken=False, corrupt=None):
    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            start = shop.initial_snapshot()
            gold = list(TASK.checkpoint.gold_calls)
            ev = await record_evidence(rt, h, start, TASK.name, gold)
            assert ev.start.digest == start.digest and ev.server_hash == h
            spec = generate_verifier(TASK.checkpoint, start, ev)
            spec = corrupt_verifier(spec, corrupt) if corrupt else spec
            run_h = rt.register(patch_source(inspect.getsource(shop), SHOP_BUGS[0])) if broken else h
            sid = await rt.create_session(run_h, run_start)
            try:
                outs = [await rt.call_tool(sid, c.name, c.arguments) for c in gold]
                verdict = await rt.verify_turn(sid, run_start, spec, outs)
            finally:
                await rt.close(sid)
            assert verdict.r == 0
            return await attribute(rt, run_h, run_start, spec, ev, outs, verdict)
    return anyio.run(main)


def test_an_entity_in_the_wrong_state_is_the_tasks():
    """Order 2 exists (the entity map finds it) but is already shipped: the reference fails on the certified server."""
    a = _attribute(_changed("UPDATE orders SET status = 'shipped' WHERE id = 2"))
    assert (a.blame, a.rule) == (Blame.task, "precondition_state")
    assert a.reference_diff == {"orders": {"added": 0, "changed": 1, "removed": 0}}  # certified start -> this start


def test_a_broken_server_from_another_start_is_the_environments():
    """An unrelated start change plus an update that does not persist: the certified server reproduces the certified
    change from this start, so the server is at fault."""
    a = _attribute(_changed("INSERT INTO customers (name, email) VALUES ('Zoe', 'zoe@example.com')"), broken=True)
    assert (a.blame, a.rule) == (Blame.environment, "reference_differs")


def test_the_certified_start_keeps_the_old_rules():
    a = _attribute(shop.initial_snapshot(), broken=True)
    assert (a.blame, a.rule) == (Blame.environment, "reference_differs")


UNRELATED_ORDER_GONE = ("DELETE FROM order_items WHERE order_id = 1", "DELETE FROM orders WHERE id = 1")


def test_a_start_the_verifier_rejects_the_reference_from_is_the_tasks():
    """Order 1 (shipped, not the task's) is gone: the reference makes the certified change, but the check of the
    orders table the reference changed fails from this start and passes from the certified one (BFCL: a stock the
    reference names but finds already in the watch list, deleted from the initial state)."""
    a = _attribute(_changed(*UNRELATED_ORDER_GONE))
    assert (a.blame, a.rule) == (Blame.task, "precondition_state")


def test_a_defective_verifier_from_another_start_stays_the_evaluators():
    """The same start, with a verifier that fails the reference from the certified start too."""
    a = _attribute(_changed(*UNRELATED_ORDER_GONE), corrupt="wrong_expected_value")
    assert (a.blame, a.rule) == (Blame.evaluator, "reference_rejected")

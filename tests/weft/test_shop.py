"""The native shop environment: schema, tool contracts, errors, tasks and verification."""
import ast
import inspect

import anyio
import pytest

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.envs import shop, shop_tasks
from treadle.weft.runtime.episode import run_atomic_episode
from treadle.weft.runtime.errors import ErrorKind
from treadle.weft.runtime.isolation import check_source
from treadle.weft.runtime import Runtime, ToolOutcome
from treadle.weft.runtime.sqlite_state import SqliteState, check_schema
from treadle.weft.runtime.verify import CheckpointSpec, FailureReason, StateAssertion, judge_checkpoint, trajectory_reward

# one call per tool, in an order where each succeeds from the seed state
CONTRACT_CALLS = [
    ("find_customer", {"email": "Grace@Example.com "}),
    ("search_products", {"query": "mug"}),
    ("get_order", {"order_id": 1}),
    ("list_orders", {"customer_id": 1}),
    ("place_order", {"customer_id": 3, "items": [{"sku": "TEE", "qty": 2}, {"sku": "MUG", "qty": 1}]}),
    ("ship_order", {"order_id": 3}),
    ("cancel_order", {"order_id": 2}),
    ("open_ticket", {"customer_id": 3, "subject": "Where is my tee?", "order_id": 3}),
    ("close_ticket", {"ticket_id": 2, "resolution": "Shipped today"}),
]


def test_seed_snapshot_matches_schema_and_module_is_shareable():
    check_schema(shop.initial_snapshot(), shop.SCHEMA)
    assert check_source(inspect.getsource(shop)).findings == []
    assert {n for n, _ in CONTRACT_CALLS} == set(shop.server.tool_names)


def test_tool_contracts_hold():
    """Each call changes only the tables its contract declares as writes; read tools change nothing."""
    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            sid = await rt.create_session(h, shop.initial_snapshot())
            contracts = shop.server.contracts
            for name, args in CONTRACT_CALLS:
                before = rt.snapshot(sid)
                out = await rt.call_tool(sid, name, args)
                assert out.ok, (name, out.text)
                touched = SqliteState(before).diff(rt.snapshot(sid)).touched()
                assert touched <= set(contracts[name].writes), (name, touched)
                if contracts[name].mutating:
                    assert touched, name
            db = rt.state(sid)
            assert db.execute("SELECT sku, stock FROM products ORDER BY sku").fetchall() == [
                ("CAP", 0), ("MUG", 9), ("PEN", 5), ("TEE", 2)]  # TEE: 3 - 2 + 1 (cancelled order 2)
            assert db.execute("SELECT id, status, total_cents FROM orders ORDER BY id").fetchall() == [
                (1, "shipped", 2400), (2, "cancelled", 2500), (3, "shipped", 6200)]
    anyio.run(main)


@pytest.mark.parametrize("name, args, msg", [
    ("place_order", {"customer_id": 1, "items": [{"sku": "CAP", "qty": 1}]}, "only 0 of CAP in stock"),
    ("place_order", {"customer_id": 1, "items": [{"sku": "MUG", "qty": 1}, {"sku": "XYZ", "qty": 1}]}, "no product"),
    ("place_order", {"customer_id": 1, "items": [{"sku": "MUG", "qty": 1}, {"sku": "MUG", "qty": 1}]},
     "once per order"),
    ("place_order", {"customer_id": 99, "items": [{"sku": "MUG", "qty": 1}]}, "no customer with id 99"),
    ("cancel_order", {"order_id": 1}, "order 1 is shipped"),
    ("ship_order", {"order_id": 7}, "no order with id 7"),
    ("open_ticket", {"customer_id": 1, "subject": "About Alan's order", "order_id": 2}, "does not belong"),
    ("find_customer", {"email": "nobody@example.com"}, "no customer with e-mail"),
])
def test_tool_errors_leave_state_unchanged(name, args, msg):
    async def main():
        async with Runtime() as rt:
            sid = await rt.create_session(rt.register(shop), shop.initial_snapshot())
            before = rt.snapshot(sid).data
            out = await rt.call_tool(sid, name, args)
            assert out.error_kind == ErrorKind.execution_error and msg in out.text, out.text
            assert rt.snapshot(sid).data == before  # atomic: partial writes rolled back
    anyio.run(main)


def test_schema_rejects_bad_arguments_before_dispatch():
    async def main():
        async with Runtime() as rt:
            sid = await rt.create_session(rt.register(shop), shop.initial_snapshot())
            for args in ({"customer_id": 1, "items": []}, {"customer_id": 1, "items": [{"sku": "MUG", "qty": 0}]},
                         {"customer_id": 1, "items": [{"sku": "MUG"}]},
                         {"customer_id": "1", "items": [{"sku": "MUG", "qty": 1}]}):
                assert (await rt.call_tool(sid, "place_order", args)).error_kind == ErrorKind.invalid_args, args
    anyio.run(main)


def _run(task, policy):
    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            sid = await rt.create_session(h, shop.initial_snapshot())
            ep = await run_atomic_episode(rt, sid, [t.checkpoint for t in task.turns], policy)
            assert not any(s.startswith("verifier-") for s in rt.sessions())
            gold_counted = sum(r["calls"] for r in rt.stats.rows())
            return ep, gold_counted
    return anyio.run(main)


@pytest.mark.parametrize("task", shop_tasks.tasks(), ids=lambda t: t.name)
def test_gold_replay_passes_every_checkpoint(task):
    ep, counted = _run(task, lambda k, hist: task.turns[k].gold)
    assert ep.reward == 1.0 and all(r.r == 1 and not r.reasons for r in ep.results)
    assert counted == sum(len(t.gold) for t in task.turns)  # verifier replays are not in the statistics


@pytest.mark.parametrize("task", shop_tasks.tasks(), ids=lambda t: t.name)
def test_skipping_one_call_fails_exactly_that_checkpoint(task):
    for k, turn in enumerate(task.turns):
        gold = turn.gold
        for j in range(len(gold)):
            def policy(i, hist, k=k, j=j):
                calls = list(task.turns[i].gold)
                return calls[:j] + calls[j + 1:] if i == k else calls
            ep, _ = _run(task, policy)
            rs = [r.r for r in ep.results]
            assert rs == [0 if i == k else 1 for i in range(len(task.turns))], (turn.checkpoint.name, j, ep.results)
            bad = ep.results[k]
            assert bad.policy_failure
            assert set(bad.reasons) <= {FailureReason.state_mismatch, FailureReason.response_mismatch}
            assert ep.reward == pytest.approx((len(task.turns) - 1) / len(task.turns))


def test_extra_or_forbidden_calls_fail_their_checkpoint():
    task = shop_tasks.tasks()[0]

    def policy(i, hist):
        calls = list(task.turns[i].gold)
        if i == 2:
            calls.append("cancel_order(order_id=3)")  # forbidden on this turn
        if i == 3:
            calls.append("search_products()")  # the closing turn needs no call
        return calls
    ep, _ = _run(task, policy)
    assert [r.r for r in ep.results] == [1, 1, 0, 0]
    assert FailureReason.forbidden_call in ep.results[2].reasons
    assert ep.results[3].reasons == [FailureReason.forbidden_call]


def test_interface_errors_and_non_policy_failures():
    task = shop_tasks.tasks()[1]

    def policy(i, hist):
        calls = list(task.turns[i].gold)
        if i == 0:
            return ["cancel_order(order_id='two')", "find_customer(email='alan@example.com')"]  # wrong, gives up
        return ["open_tiket(customer_id=2)", *calls]  # unknown tool, then recovers
    ep, _ = _run(task, policy)
    assert [r.r for r in ep.results] == [0, 1]
    assert FailureReason.interface_error in ep.results[0].reasons
    strict = CheckpointSpec(name="strict", strict_interface=True)
    ok_out = ToolOutcome(session_id="s", seq=1, call=ToolCall(name="x"), ok=True, result=1)
    bad_out = ToolOutcome(session_id="s", seq=2, call=ToolCall(name="y"), ok=False,
                          error_kind=ErrorKind.unknown_tool, text="unknown")
    crash = ToolOutcome(session_id="s", seq=3, call=ToolCall(name="z"), ok=False, error_kind=ErrorKind.crash,
                        text="server died")
    timeout = ToolOutcome(session_id="s", seq=4, call=ToolCall(name="z"), ok=False, error_kind=ErrorKind.timeout,
                          text="slow")
    st = SqliteState(shop.initial_snapshot())
    assert judge_checkpoint(strict, st, [ok_out, bad_out]).reasons == [FailureReason.interface_error]
    r = judge_checkpoint(CheckpointSpec(name="c"), st, [crash])
    assert r.r == 0 and r.reasons == [FailureReason.infrastructure] and not r.policy_failure
    r = judge_checkpoint(CheckpointSpec(name="t"), st, [timeout])
    assert r.reasons == [FailureReason.timeout] and not r.policy_failure
    r = judge_checkpoint(CheckpointSpec(name="g", gold_calls=[]), st, [], gold_error="bad gold")
    assert r.reasons == [FailureReason.infrastructure]
    r = judge_checkpoint(CheckpointSpec(name="a", assertions=[StateAssertion(sql="SELECT nope", expected=[])]), st, [])
    assert r.reasons == [FailureReason.infrastructure]
    r = judge_checkpoint(CheckpointSpec(name="p", predicates=[lambda db: False], expected_returns=[{"a": 1}]), st,
                         [ok_out])
    assert r.reasons == [FailureReason.state_mismatch, FailureReason.response_mismatch] and r.policy_failure
    assert trajectory_reward([r, judge_checkpoint(CheckpointSpec(name="ok"), st, [])]) == 0.5
    assert trajectory_reward([]) == 0.0
    with pytest.raises(TypeError, match="CheckpointResult"):
        trajectory_reward([1])


def test_verifier_and_gold_unreachable_from_tools():
    """The agent's only surface is the server's tools: no verifier, gold or runtime internals there."""
    tree = ast.parse(inspect.getsource(shop))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "sqlite3", "typing", "pydantic", "treadle.weft.runtime.server",
                        "treadle.weft.runtime.sqlite_state"}
    assert check_source(inspect.getsource(shop)).findings == []

    async def main():
        async with Runtime() as rt:
            sid = await rt.create_session(rt.register(shop), shop.initial_snapshot())
            names = {t["name"] for t in await rt.list_tools(sid)}
            assert names == set(shop.server.tool_names)
            for probe in ("verify_turn", "judge_checkpoint", "tasks", "state", "snapshot", "_order"):
                assert (await rt.call_tool(sid, probe, {})).error_kind == ErrorKind.unknown_tool
            # a session id smuggled in arguments is rejected by the schema, never reaches the resolver
            out = await rt.call_tool(sid, "list_orders", {"customer_id": 1, "weft_ctx": "x"})
            assert out.error_kind == ErrorKind.invalid_args
    anyio.run(main)

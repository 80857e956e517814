"""The CRM environment: schema, contracts (each call writes only what it declares), atomic errors."""
import inspect

import anyio
import pytest

from treadle.weft.envs import crm
from treadle.weft.runtime.errors import ErrorKind
from treadle.weft.runtime.isolation import check_source
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import SqliteState, check_schema

CONTRACT_CALLS = [
    ("find_contact", {"email": " Katherine@Example.com"}),
    ("list_cases", {"contact_id": "C-001"}),
    ("get_case", {"case_id": 1}),
    ("open_case", {"contact_id": "C-004", "topic": "Late delivery", "order_ref": 7, "priority": "low"}),
    ("add_note", {"case_id": 3, "body": "Called the courier"}),
    ("escalate_case", {"case_id": 3}),
    ("resolve_case", {"case_id": 3, "resolution": "Delivered"}),
    ("issue_credit", {"contact_id": "C-004", "amount_cents": 300, "reason": "Late delivery", "order_ref": 7}),
    ("set_tier", {"contact_id": "C-002", "tier": "vip"}),
]


def test_seed_matches_schema_and_every_tool_is_exercised():
    check_schema(crm.initial_snapshot(), crm.SCHEMA)
    assert check_source(inspect.getsource(crm)).findings == []
    assert {n for n, _ in CONTRACT_CALLS} == set(crm.server.tool_names)


def test_tool_contracts_hold():
    async def main():
        async with Runtime() as rt:
            sid = await rt.create_session(rt.register(crm), crm.initial_snapshot())
            contracts = crm.server.contracts
            for name, args in CONTRACT_CALLS:
                before = rt.snapshot(sid)
                out = await rt.call_tool(sid, name, args)
                assert out.ok, (name, out.text)
                touched = SqliteState(before).diff(rt.snapshot(sid)).touched()
                assert touched <= set(contracts[name].writes), (name, touched)
                assert bool(touched) == contracts[name].mutating, name
            db = rt.state(sid)
            assert db.execute("SELECT id, priority, status, resolution FROM cases WHERE id = 3").fetchall() == [
                (3, "high", "resolved", "Delivered")]
            assert db.execute("SELECT contact_id, order_ref, amount_cents FROM credits").fetchall() == [("C-004", 7, 300)]
            assert db.execute("SELECT tier FROM contacts WHERE id = 'C-002'").fetchone() == ("vip",)
    anyio.run(main)


@pytest.mark.parametrize("name, args, msg", [
    ("find_contact", {"email": "nobody@example.com"}, "no contact with e-mail"),
    ("open_case", {"contact_id": "C-999", "topic": "Hello"}, "no contact with id 'C-999'"),
    ("add_note", {"case_id": 2, "body": "Too late"}, "case 2 is resolved"),
    ("escalate_case", {"case_id": 9}, "no case with id 9"),
    ("issue_credit", {"contact_id": "C-001", "amount_cents": 10_001, "reason": "Big"}, "at most 10000"),
    ("set_tier", {"contact_id": "C-001", "tier": "vip"}, "already vip"),
])
def test_tool_errors_leave_state_unchanged(name, args, msg):
    async def main():
        async with Runtime() as rt:
            sid = await rt.create_session(rt.register(crm), crm.initial_snapshot())
            before = rt.snapshot(sid).data
            out = await rt.call_tool(sid, name, args)
            assert out.error_kind == ErrorKind.execution_error and msg in out.text, out.text
            assert rt.snapshot(sid).data == before
    anyio.run(main)


def test_second_credit_for_an_order_is_refused_and_rolled_back():
    async def main():
        async with Runtime() as rt:
            sid = await rt.create_session(rt.register(crm), crm.initial_snapshot())
            args = {"contact_id": "C-001", "amount_cents": 100, "reason": "Chipped", "order_ref": 1}
            assert (await rt.call_tool(sid, "issue_credit", args)).ok
            out = await rt.call_tool(sid, "issue_credit", args)
            assert out.error_kind == ErrorKind.execution_error and "already has a credit" in out.text
            assert rt.state(sid).execute("SELECT count(*) FROM credits").fetchone() == (1,)
    anyio.run(main)

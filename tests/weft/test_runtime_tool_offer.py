"""The agent's tool offer (``set_available_tools``) is session state: a fork inherits its parent's offer and a
restored checkpoint keeps the offer it was written with.

Every other piece of per-session agent-facing state (the state itself, clock, random source) is covered by
test_fork.py and test_checkpoint.py; these tests pin the offer, the one that used to be dropped.
"""
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.errors import ErrorKind
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


@pytest.mark.parametrize("isolation", ["shared", "isolated"])
def test_fork_has_the_parents_tool_offer_and_then_its_own(isolation):
    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "notes.py", isolation=isolation if isolation == "isolated" else None)
            parent = await rt.create_session(h, snapshot_from_sql(NOTES_DDL))
            rt.set_available_tools(parent, ["list_notes"])
            fork = await rt.fork(parent)
            assert rt.available_tools(fork) == ["list_notes"]
            assert [t["name"] for t in await rt.list_tools(fork)] == ["list_notes"]
            out = await rt.call_tool(fork, "add_note", {"text": "x"})  # withheld in the parent: withheld here
            assert out.error_kind == ErrorKind.unknown_tool and rt.snapshot(fork).data == rt.snapshot(parent).data
            rt.set_available_tools(fork, ["list_notes", "add_note"])  # the fork's offer is its own
            assert rt.available_tools(parent) == ["list_notes"]
            assert (await rt.call_tool(fork, "add_note", {"text": "x"})).ok
            rt.set_available_tools(parent, None)
            assert rt.available_tools(fork) == ["add_note", "list_notes"]
            everything = await rt.fork(parent)  # an unrestricted parent gives an unrestricted fork
            assert rt.available_tools(everything) == sorted(rt.server_of(parent).tool_names)
    anyio.run(main)


def test_restored_session_keeps_the_offer_it_was_checkpointed_with(tmp_path):
    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(tmp_path / "ck")) as rt:
            h = rt.register(SERVERS / "notes.py")
            a = await rt.create_session(h, snapshot_from_sql(NOTES_DDL), session_id="offer-a")
            b = await rt.create_session(h, snapshot_from_sql(NOTES_DDL), session_id="offer-b")
            rt.set_available_tools(a, ["add_note", "list_notes"])
            assert (await rt.call_tool(a, "add_note", {"text": "kept"})).ok
            assert await rt.checkpoint(a, turn=0) is not None and await rt.checkpoint(b, turn=0) is not None
        async with Runtime(checkpoint_store=CheckpointStore(tmp_path / "ck")) as rt:
            rt.register(SERVERS / "notes.py")
            a = await rt.restore_session("offer-a")
            assert rt.available_tools(a) == ["add_note", "list_notes"]
            assert (await rt.call_tool(a, "explode", {})).error_kind == ErrorKind.unknown_tool
            assert [n["text"] for n in (await rt.call_tool(a, "list_notes")).result] == ["kept"]
            b = await rt.restore_session("offer-b")  # never restricted: every tool
            assert rt.available_tools(b) == sorted(rt.server_of(b).tool_names)
    anyio.run(main)

"""Each transport: in-process (default), stdio and streamable HTTP (loopback), and crash typing."""
from pathlib import Path

import anyio
import pytest

from treadle.weft.errors import ErrorKind, UnsupportedOperationError
from treadle.weft.runtime import Runtime
from treadle.weft.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


@pytest.mark.parametrize("transport", ["inproc", "stdio", "http"])
def test_transport_serves_tools(transport):
    snap = snapshot_from_sql(NOTES_DDL, "INSERT INTO notes (text) VALUES ('seed');")

    async def main():
        async with Runtime(timeout_s=20) as rt:
            h = rt.register(SERVERS / "notes.py")
            a = await rt.create_session(h, snap, transport=transport)
            b = await rt.create_session(h, snap, transport=transport)
            assert (await rt.call_tool(a, "add_note", {"text": "x"})).result == {"id": 2}
            assert [n["text"] for n in (await rt.call_tool(b, "list_notes")).result] == ["seed"]
            out = await rt.call_tool(a, "add_then_fail", {"text": "y"})
            assert out.error_kind == ErrorKind.execution_error and "refusing note 'y'" in out.text
            assert (await rt.call_tool(a, "nope")).error_kind == ErrorKind.unknown_tool
            assert {t["name"] for t in await rt.list_tools(a)} >= {"add_note", "list_notes"}
            await rt.reset(a)
            assert [n["text"] for n in (await rt.call_tool(a, "list_notes")).result] == ["seed"]
            if transport != "inproc":
                with pytest.raises(UnsupportedOperationError):
                    await rt.fork(a)
                with pytest.raises(UnsupportedOperationError):
                    rt.diff(a)
            await rt.close(a)
            assert (await rt.call_tool(b, "list_notes")).ok
    anyio.run(main)


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_server_crash_is_typed_and_isolated(transport):
    snap = snapshot_from_sql("CREATE TABLE t (a INTEGER);")

    async def main():
        async with Runtime(timeout_s=20) as rt:
            h = rt.register(SERVERS / "crashy.py")
            a = await rt.create_session(h, snap, transport=transport)
            b = await rt.create_session(h, snap, transport=transport)
            assert (await rt.call_tool(a, "put", {"a": 1})).result == {"n": 1}
            out = await rt.call_tool(a, "die")
            assert out.error_kind == ErrorKind.crash, out
            again = await rt.call_tool(a, "put", {"a": 2})
            assert again.error_kind == ErrorKind.crash and "gone" in again.text
            assert (await rt.call_tool(b, "put", {"a": 5})).result == {"n": 1}
            assert rt.stats.get(h, "die")["errors"] == {"crash": 1}
            await rt.reset(a)  # restarts the server process from the initial snapshot
            assert (await rt.call_tool(a, "put", {"a": 3})).result == {"n": 1}
    anyio.run(main)

"""Each transport: in-process (default), stdio and streamable HTTP (loopback), and crash typing."""
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.errors import ErrorKind, UnsupportedOperationError
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

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


@pytest.mark.parametrize("transport", ["inproc", "stdio", "http"])
def test_call_past_its_time_limit_rolls_back_to_before_the_call_on_every_transport(transport):
    """The in-process contract (the state before the abandoned call) holds on stdio and HTTP too: the killed
    server process restarts from the initial snapshot and replays the earlier calls, session clock and
    random source included. With the call before the timeout stamped by the process clock the replay
    cannot be faithful: the session is then at its initial snapshot, and the outcome says so."""
    snap = snapshot_from_sql(SLOW_DDL, "INSERT INTO notes (text, created) VALUES ('seed', 0);")

    async def main():
        async with Runtime(timeout_s=3) as rt:
            h = rt.register(SERVERS / "slow_notes.py")
            a = await rt.create_session(h, snap, transport=transport)
            first = [(await rt.call_tool(a, "add_note", {"text": t})).result for t in ("x", "y")]
            before = (await rt.call_tool(a, "dump")).result
            assert [r[1] for r in before] == ["seed", "x", "y"] and before[1][2:] == [first[0]["created"],
                                                                                    first[0]["lucky"]]
            out = await rt.call_tool(a, "add_then_sleep", {"text": "lost", "seconds": 60})
            assert out.error_kind == ErrorKind.timeout and "exceeded 3 s" in out.text
            assert "rolled back" in out.text
            assert (await rt.call_tool(a, "dump")).result == before  # the earlier writes stay, the abandoned one not
            nxt = (await rt.call_tool(a, "add_note", {"text": "z"})).result  # the session goes on
            assert nxt["id"] == 4 and nxt["created"] > first[1]["created"]
            if transport == "inproc":
                return
            # a tool that reads the process clock never replays: the session is left at its initial snapshot
            assert (await rt.call_tool(a, "add_note_wallclock", {"text": "w"})).ok
            out = await rt.call_tool(a, "add_then_sleep", {"text": "lost", "seconds": 60})
            assert out.error_kind == ErrorKind.timeout
            assert "returned something else than the first time" in out.text and "initial snapshot" in out.text
            assert (await rt.call_tool(a, "dump")).result == [[1, "seed", 0, None]]
            assert [e.event for e in rt.log(a)].count("reset") == 2
    anyio.run(main)


SLOW_DDL = ("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, created REAL NOT NULL, "
            "lucky INTEGER);")

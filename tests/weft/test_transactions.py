"""Every tool call is a transaction (object state like SQLite), calls past the time limit are abandoned
and rolled back, and sessions of one runtime run concurrently."""
import time
import types
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.errors import ErrorKind
from treadle.weft.runtime.object_state import snapshot_from_object
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


def counter():
    return snapshot_from_object(types.SimpleNamespace(n=0, log=[]))


@pytest.mark.parametrize("isolation", ["shared", "isolated"])
def test_object_state_rolls_back_on_error_like_sqlite(isolation):
    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "counter_obj.py", isolation=isolation)
            sid = await rt.create_session(h, counter())
            assert (await rt.call_tool(sid, "bump", {"by": 2})).result == 2
            before = rt.snapshot(sid)
            out = await rt.call_tool(sid, "bump_then_fail")
            assert out.error_kind == ErrorKind.execution_error and "failed after writing" in out.text
            assert rt.snapshot(sid) == before  # attributes and the session random source rolled back
            assert (rt.state(sid).n, rt.state(sid).log) == (2, [2])
            h2 = rt.register(SERVERS / "notes.py")
            n = await rt.create_session(h2, snapshot_from_sql(NOTES_DDL))
            before = rt.snapshot(n)
            assert (await rt.call_tool(n, "add_then_fail", {"text": "x"})).error_kind == ErrorKind.execution_error
            assert rt.snapshot(n) == before
    anyio.run(main)


@pytest.mark.parametrize("tool", ["bump_then_block", "abump_then_block"])
@pytest.mark.parametrize("isolation", ["shared", "isolated"])
def test_call_past_its_time_limit_is_abandoned_and_rolled_back(tool, isolation):
    async def main():
        async with Runtime(timeout_s=0.5) as rt:
            h = rt.register(SERVERS / "counter_obj.py", isolation=isolation)
            sid = await rt.create_session(h, counter())
            other = await rt.create_session(h, counter())
            await rt.call_tool(sid, "bump", {"by": 1})
            before = rt.snapshot(sid)
            t0 = time.perf_counter()
            out = await rt.call_tool(sid, tool, {"seconds": 2.0})
            waited = time.perf_counter() - t0
            assert out.error_kind == ErrorKind.timeout and "abandoned" in out.text and "rolled back" in out.text
            assert waited < 1.8  # returned at the limit, not when the tool finished
            assert rt.snapshot(sid) == before
            assert any(e.event == "reset" for e in rt.log(sid))
            await anyio.sleep(2.0)  # the abandoned call finishes its late writes on a detached state
            assert (rt.state(sid).n, rt.state(sid).log) == (1, [1])
            assert (await rt.call_tool(sid, "bump", {"by": 1})).result == 2  # the session keeps serving
            assert (await rt.call_tool(other, "bump", {"by": 5})).result == 5
    anyio.run(main)


def test_sessions_of_one_runtime_run_concurrently():
    """Async tools overlap; sync tools overlap on the bounded thread pool."""
    async def main():
        async with Runtime(max_threads=8) as rt:
            h = rt.register(SERVERS / "counter_obj.py")
            sids = [await rt.create_session(h, counter()) for _ in range(8)]
            for tool in ("wait", "wait_sync"):
                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for s in sids:
                        tg.start_soon(rt.call_tool, s, tool, {"seconds": 0.5})
                elapsed = time.perf_counter() - t0
                assert elapsed < 2.0, f"{tool}: 8 x 0.5 s calls took {elapsed:.2f} s (serial would be 4 s)"
            assert anyio.to_thread.current_default_thread_limiter().total_tokens == 8
        with pytest.raises(ValueError, match="max_threads"):
            Runtime(max_threads=0)
    anyio.run(main)


def test_views_of_state_wait_for_or_refuse_a_call_in_flight():
    from treadle.weft.runtime.errors import SessionBusyError

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "counter_obj.py")
            sid = await rt.create_session(h, counter())
            async with anyio.create_task_group() as tg:
                tg.start_soon(rt.call_tool, sid, "abump_then_block", {"seconds": 0.5})
                await anyio.sleep(0.1)  # the call has written its first half
                for view in (lambda: rt.snapshot(sid), lambda: rt.diff(sid), lambda: rt.state(sid)):
                    with pytest.raises(SessionBusyError, match="in flight"):
                        view()
                snap = await rt.snapshot_idle(sid)  # waits for the call: never the half-done state
                f = await rt.fork(sid)
            assert rt.state(sid).n == 2000 and snap == rt.snapshot(sid) and rt.diff(sid, f).empty
    anyio.run(main)


def test_tool_crash_is_one_log_line_and_host_logging_untouched(caplog, capfd):
    import logging

    root = logging.getLogger()
    handlers = list(root.handlers)

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "notes.py")
            sid = await rt.create_session(h, snapshot_from_sql(NOTES_DDL))
            with caplog.at_level(logging.WARNING, logger="treadle.weft.tools"):
                out = await rt.call_tool(sid, "explode")
            assert out.error_kind == ErrorKind.execution_error
            assert out.text == "Error executing tool explode: ZeroDivisionError: division by zero"
            assert [r.getMessage() for r in caplog.records if r.name == "treadle.weft.tools"] == [
                "tool explode of server notes crashed: ZeroDivisionError: division by zero"]
    anyio.run(main)
    assert root.handlers == handlers  # MCPServer's logging.basicConfig was undone
    assert "Traceback" not in capfd.readouterr().err


def test_remote_session_past_its_time_limit_restarts_its_server():
    async def main():
        async with Runtime(timeout_s=2.0) as rt:
            h = rt.register(SERVERS / "notes.py")
            sid = await rt.create_session(h, snapshot_from_sql(NOTES_DDL), transport="stdio")
            assert (await rt.call_tool(sid, "add_note", {"text": "x"})).ok
            t0 = time.perf_counter()
            out = await rt.call_tool(sid, "slow_sync", {"seconds": 30})
            assert out.error_kind == ErrorKind.timeout and "server process restarted" in out.text
            assert "1 earlier successful call(s) replayed: state rolled back to before the call" in out.text
            assert time.perf_counter() - t0 < 20
            notes = (await rt.call_tool(sid, "list_notes")).result
            assert notes == [{"id": 1, "text": "x", "tag": None}]  # a fresh server process + the replayed call
    anyio.run(main)

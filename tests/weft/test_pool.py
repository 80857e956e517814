"""Prefork worker pool: workers forked on demand, private sessions, failover after a killed worker."""
from pathlib import Path

import anyio
import pytest

from treadle.weft.errors import ErrorKind, SnapshotSchemaError, UnknownSessionError
from treadle.weft.pool import WorkerPool
from treadle.weft.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


def test_pool_failover_after_killed_worker(tmp_path):
    snap = snapshot_from_sql(NOTES_DDL)

    async def main():
        async with WorkerPool(max_workers=2, sessions_per_worker=2, checkpoint_store=str(tmp_path / "store"),
                              debounce_s=0.01) as pool:
            h = pool.register(SERVERS / "notes.py")
            sids = [await pool.create_session(h, snap) for _ in range(4)]
            assert len(pool.workers) == 2  # forked on demand: 2 sessions per worker
            assert pool.worker_pid(sids[0]) != pool.worker_pid(sids[2])
            for i, sid in enumerate(sids):
                assert (await pool.call_tool(sid, "add_note", {"text": f"s{i}"})).ok
            for i, sid in enumerate(sids):
                notes = (await pool.call_tool(sid, "list_notes")).result
                assert [n["text"] for n in notes] == [f"s{i}"]  # private state per session
            bad = await pool.call_tool(sids[0], "add_note", {"text": 3})
            assert bad.error_kind == ErrorKind.invalid_args
            await pool.checkpoint(sids[0], turn=0)
            await pool.drain()
            victim = sids[0]
            killed = pool.kill_worker_of(victim)
            await anyio.sleep(0.2)
            out = await pool.call_tool(victim, "list_notes")
            assert out.error_kind == ErrorKind.crash
            # both sessions of the dead worker came back from their checkpoints on the other worker
            for i in (0, 1):
                notes = (await pool.call_tool(sids[i], "list_notes")).result
                assert [n["text"] for n in notes] == [f"s{i}"]
                assert pool.is_interrupted(sids[i])
            # restored on a fresh worker (the other live one is full)
            assert pool.worker_pid(sids[0]) not in (killed, pool.worker_pid(sids[2]))
            assert len(pool.workers) == 3 and sum(not w.dead for w in pool.workers) == 2
            assert await pool.checkpoint_turn(sids[0]) == 0
            assert not pool.is_interrupted(sids[2])
            assert (await pool.snapshot(sids[3])).kind == "sqlite"
            with pytest.raises(SnapshotSchemaError):
                await pool.create_session(h, snapshot_from_sql("CREATE TABLE other (x);"))
            await pool.close(sids[3])
            with pytest.raises(UnknownSessionError):
                await pool.call_tool(sids[3], "list_notes")
    anyio.run(main)

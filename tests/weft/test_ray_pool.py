"""The runtime worker pool on Ray actors: placement, private sessions, failover after ray.kill."""
from pathlib import Path

import anyio
import pytest

ray = pytest.importorskip("ray")

from treadle.weft.runtime.errors import ErrorKind, SnapshotSchemaError, UnknownSessionError  # noqa: E402
from treadle.weft.runtime.ray_pool import RayWorkerPool  # noqa: E402
from treadle.weft.runtime.sqlite_state import snapshot_from_sql  # noqa: E402

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


@pytest.mark.slow  # Ray actors are Python processes importing the runtime: seconds each on 2 busy cores
def test_sessions_on_actors_and_failover_after_ray_kill(local_ray, tmp_path):
    snap = snapshot_from_sql(NOTES_DDL)

    async def main():
        async with RayWorkerPool(max_workers=2, sessions_per_worker=2, checkpoint_store=str(tmp_path / "store"),
                                 debounce_s=0.01, num_cpus=0.1) as pool:
            h = pool.register(SERVERS / "notes.py")
            sids = [await pool.create_session(h, snap) for _ in range(4)]
            assert len(pool.workers) == 2  # started on demand: 2 sessions per actor
            assert pool.worker_pid(sids[0]) != pool.worker_pid(sids[2])
            for i, sid in enumerate(sids):
                assert (await pool.call_tool(sid, "add_note", {"text": f"s{i}"})).ok
            for i, sid in enumerate(sids):
                notes = (await pool.call_tool(sid, "list_notes")).result
                assert [n["text"] for n in notes] == [f"s{i}"]  # private state per session
            bad = await pool.call_tool(sids[0], "add_note", {"text": 3})
            assert bad.error_kind == ErrorKind.invalid_args
            assert (await pool.checkpoint(sids[0], turn=0)) is not None
            await pool.drain()  # sids[1]'s debounced checkpoint is written too
            killed = pool.kill_worker_of(sids[0])
            out = await pool.call_tool(sids[0], "list_notes")
            assert out.error_kind == ErrorKind.crash
            for i in (0, 1):  # both sessions of the dead actor came back from their checkpoints elsewhere
                notes = (await pool.call_tool(sids[i], "list_notes")).result
                assert [n["text"] for n in notes] == [f"s{i}"]
                assert pool.is_interrupted(sids[i])
            assert pool.worker_pid(sids[0]) not in (killed, pool.worker_pid(sids[2]))
            assert len(pool.workers) == 3 and sum(not w.dead for w in pool.workers) == 2
            assert await pool.checkpoint_turn(sids[0]) == 0
            assert not pool.is_interrupted(sids[2])
            assert [n["text"] for n in (await pool.call_tool(sids[3], "list_notes")).result] == ["s3"]
            assert (await pool.snapshot(sids[3])).kind == "sqlite"
            with pytest.raises(SnapshotSchemaError):  # a remote error keeps its class
                await pool.create_session(h, snapshot_from_sql("CREATE TABLE other (x);"))
            await pool.close(sids[3])
            with pytest.raises(UnknownSessionError):
                await pool.call_tool(sids[3], "list_notes")
        assert all(w.dead for w in pool.workers)  # every actor stopped at exit
    anyio.run(main)


@pytest.mark.slow  # Ray actors are Python processes importing the runtime: seconds each on 2 busy cores
def test_chaos_drill_on_ray_loses_no_checkpointed_work(local_ray):
    from treadle.weft.runtime.chaos import run_chaos

    # one actor killed mid-run, its sessions restored on the replacement: 2 actor starts (each a Python
    # process importing the runtime, ~5 s here); the process-pool drill (tests/weft/test_pool.py) covers
    # more sessions and kills, and test_sessions_on_actors_and_failover_after_ray_kill restores next to a
    # surviving actor
    rep = anyio.run(lambda: run_chaos(sessions=6, workers=1, steps=3, kills=1, seed=1, deadline_s=120,
                                      ray_address="auto"))
    assert rep.kills == 1 and rep.sessions_restored >= 1  # kills placed by progress: lands at any speed
    assert rep.cross_session_leaks == 0 and rep.lost_checkpointed_mutations == 0
    assert rep.unfinished_sessions == 0 and rep.stale_writes_accepted == 0
    assert rep.stale_writes_rejected == rep.sessions_restored


@pytest.mark.parametrize("kw, match", [({"address": "nohost"}, "Ray address"), ({"num_cpus": 0}, "num_cpus"),
                                       ({"max_concurrency": 0}, "max_concurrency"), ({"max_workers": 0}, "max_workers")])
def test_bad_arguments_are_refused_before_connecting(kw, match):
    with pytest.raises(ValueError, match=match):
        RayWorkerPool(**kw)


def test_pool_outside_its_context_says_so(local_ray):
    pool = RayWorkerPool(checkpoint_store=None)
    h = pool.register(SERVERS / "notes.py")

    async def main():
        with pytest.raises(RuntimeError, match="async with RayWorkerPool"):
            await pool.create_session(h, snapshot_from_sql(NOTES_DDL))
    anyio.run(main)


def test_concurrent_calls_on_one_session_run_in_call_order(local_ray):
    import types

    from treadle.weft.runtime.object_state import snapshot_from_object

    async def main():
        async with RayWorkerPool(max_workers=1, num_cpus=0.1) as pool:
            h = pool.register(SERVERS / "counter_obj.py")
            sid = await pool.create_session(h, snapshot_from_object(types.SimpleNamespace(n=0, log=[])))
            got = [None] * 16

            async def bump(k):
                got[k] = (await pool.call_tool(sid, "bump", {"by": 1})).result
            async with anyio.create_task_group() as tg:
                for k in range(16):
                    tg.start_soon(bump, k)
            assert got == list(range(1, 17))  # the k-th call made is the k-th call run
    anyio.run(main)

"""Checkpoints: debounce, restore after a lost worker, stale-generation fencing, unwritable stores."""
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.errors import CheckpointStoreError, ErrorKind, StaleGenerationError
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


@pytest.fixture
def snap():
    return snapshot_from_sql(NOTES_DDL)


def test_store_generation_fencing(tmp_path, snap):
    store = CheckpointStore(tmp_path / "ck")
    assert store.generation("s") == 0 and store.latest("s") is None
    g1 = store.claim("s")
    r1 = store.write("s", g1, "h" * 64, snap, turn=0)
    assert (r1.generation, r1.seq, r1.turn) == (1, 1, 0)
    g2 = CheckpointStore(f"file://{tmp_path / 'ck'}").claim("s")  # another worker takes over
    assert g2 == 2
    with pytest.raises(StaleGenerationError, match="generation 1 rejected"):
        store.write("s", g1, "h" * 64, snap)
    with pytest.raises(ValueError, match="never claimed"):
        store.write("s", 5, "h" * 64, snap)
    r2 = store.write("s", g2, "h" * 64, snap)
    rec, back = store.read("s")
    assert rec == r2 and back.data == snap.data and rec.seq == 2
    with pytest.raises(KeyError):
        store.read("other")
    with pytest.raises(ValueError, match="session_id"):
        store.claim("../escape")
    with pytest.raises(CheckpointStoreError, match="cannot open"):
        CheckpointStore("nosuchprotocol://bucket/x")
    mem = CheckpointStore("memory://weft-test")
    mem.write("m", mem.claim("m"), "h", snap)
    assert mem.read("m")[1].data == snap.data


def test_debounced_checkpoints_and_restore_after_lost_worker(tmp_path, snap):
    store_url = tmp_path / "store"

    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(store_url), debounce_s=0.5) as a:  # burst < 0.5 s
            h = a.register(SERVERS / "notes.py")
            sid = await a.create_session(h, snap, session_id="rollout-1")
            for i in range(5):  # a burst of mutating calls -> one debounced checkpoint
                assert (await a.call_tool(sid, "add_note", {"text": f"n{i}"})).ok
            await a.drain()
            cps = [e for e in a.log(sid) if e.event == "checkpoint"]
            assert len(cps) == 1 and cps[0].ok and cps[0].generation == 1
            await a.call_tool(sid, "list_notes")  # read-only: no checkpoint
            await anyio.sleep(0.15)
            assert len([e for e in a.log(sid) if e.event == "checkpoint"]) == 1
            await a.call_tool(sid, "add_note", {"text": "turn-1-last"})
            rec = await a.checkpoint(sid, turn=1)  # atomic-turn boundary
            assert rec is not None and rec.turn == 1
            checkpointed = a.snapshot(sid).data
            # worker A is now presumed dead (it keeps running, unaware); B restores the session
            async with Runtime(checkpoint_store=CheckpointStore(store_url)) as b:
                assert b.register(SERVERS / "notes.py") == h  # content-addressed: same hash in B
                await b.restore_session(sid)
                assert b.is_interrupted(sid) and b.checkpoint_turn(sid) == 1
                assert b.snapshot(sid).data == checkpointed  # no checkpointed mutation lost
                notes = (await b.call_tool(sid, "list_notes")).result
                assert [n["text"] for n in notes] == ["n0", "n1", "n2", "n3", "n4", "turn-1-last"]
                await b.call_tool(sid, "add_note", {"text": "by-b"})
                await b.drain()
                # the stale worker's write is rejected and typed; B's checkpoint stands
                await a.call_tool(sid, "add_note", {"text": "by-stale-a"})
                assert await a.checkpoint(sid) is None
                bad = [e for e in a.log(sid) if e.event == "checkpoint" and not e.ok]
                assert bad and bad[0].error_kind == ErrorKind.infrastructure and "rejected" in bad[0].message
                assert a.stats.get(h, "<checkpoint>")["errors"] == {"infrastructure": 1}
                rec_b, img = CheckpointStore(store_url).read(sid)
                assert rec_b.generation == 2 and img.data == b.snapshot(sid).data
                assert rec_b.meta["interrupted"] is True
    anyio.run(main)


def test_unwritable_store_is_typed_and_runtime_keeps_serving(tmp_path, snap):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")

    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(blocker / "sub"), debounce_s=0.01) as rt:
            h = rt.register(SERVERS / "notes.py")
            sid = await rt.create_session(h, snap)
            other = await rt.create_session(h, snap)
            assert (await rt.call_tool(sid, "add_note", {"text": "x"})).ok
            await rt.drain()
            assert await rt.checkpoint(sid) is None
            errs = [e for e in rt.log(sid) if e.event == "checkpoint"]
            assert errs and all(e.error_kind == ErrorKind.infrastructure for e in errs)
            assert "CheckpointStoreError" in errs[0].message
            assert rt.stats.get(h, "<checkpoint>")["errors"]["infrastructure"] >= 1
            assert (await rt.call_tool(other, "add_note", {"text": "still fine"})).ok
            assert (await rt.call_tool(sid, "list_notes")).ok
    anyio.run(main)


WORKER = r"""
import sys, anyio
from pathlib import Path
from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

async def main():
    async with Runtime(checkpoint_store=CheckpointStore(sys.argv[1]), debounce_s=0.01) as rt:
        h = rt.register(Path(sys.argv[2]))
        sid = await rt.create_session(h, snapshot_from_sql(sys.argv[3]), session_id="killed-1")
        for i in range(3):
            await rt.call_tool(sid, "add_note", {"text": f"t0-{i}"})
        await rt.checkpoint(sid, turn=0)
        await rt.call_tool(sid, "add_note", {"text": "t1-0"})
        await rt.drain()
        print("ready", flush=True)
        await anyio.sleep(600)

anyio.run(main)
"""


def test_killed_worker_process_loses_no_checkpointed_mutation(tmp_path, snap):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "store"), str(SERVERS / "notes.py"),
                             NOTES_DDL],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()  # SIGKILL mid-session: no cleanup, no final flush
        proc.wait(10)

    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(tmp_path / "store")) as rt:
            rt.register(SERVERS / "notes.py")
            sid = await rt.restore_session("killed-1")
            notes = [n["text"] for n in (await rt.call_tool(sid, "list_notes")).result]
            assert notes == ["t0-0", "t0-1", "t0-2", "t1-0"]  # the debounced write after turn 0 survived too
            assert rt.is_interrupted(sid) and rt.checkpoint_turn(sid) == 0
            assert [e.event for e in rt.log(sid)][0] == "restore"
    anyio.run(main)


def test_interrupted_rollout_resumes_from_last_turn_boundary(tmp_path):
    from treadle.weft.envs import shop, shop_tasks
    from treadle.weft.runtime.episode import run_atomic_episode

    task = shop_tasks.tasks()[0]
    specs = [t.checkpoint for t in task.turns]

    async def main():
        store = CheckpointStore(tmp_path / "store")
        async with Runtime(checkpoint_store=store) as a:
            sid = await a.create_session(a.register(shop), shop.initial_snapshot(), session_id="ep-1")
            first = await run_atomic_episode(a, sid, specs[:2], lambda k, h: task.turns[k].gold)
            assert [r.r for r in first.results] == [1, 1]
            # worker A is lost after turn 1's boundary; B resumes the rollout from turn 2
            async with Runtime(checkpoint_store=CheckpointStore(tmp_path / "store")) as b:
                b.register(shop)
                await b.restore_session(sid)
                resume = b.checkpoint_turn(sid) + 1
                assert resume == 2 and b.is_interrupted(sid)
                rest = await run_atomic_episode(b, sid, specs, lambda k, h: task.turns[k].gold, start_turn=resume)
                assert [r.name for r in rest.results] == ["ada-3-close-ticket", "ada-4-bye"]
                assert all(r.r == 1 for r in rest.results)
                with pytest.raises(ValueError, match="start_turn"):
                    await run_atomic_episode(b, sid, specs, lambda k, h: [], start_turn=9)
    anyio.run(main)

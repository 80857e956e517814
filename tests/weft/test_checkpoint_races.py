"""Checkpoint ordering under store latency, cross-process races on one store, and
authenticated / restricted loading of checkpoints."""
import json
import os
import pickle
import time
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.errors import CheckpointIntegrityError, SnapshotSchemaError
from treadle.weft.runtime.object_state import snapshot_from_object
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql
from treadle.weft.runtime.state import Snapshot

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


class SlowStore(CheckpointStore):
    """A store whose every step takes ``delay`` seconds (as an object store's round trips do)."""

    def __init__(self, url, delay=0.05, **kw):
        super().__init__(url, **kw)
        self.delay = delay
        self.claims = 0

    def _names(self, session_id):
        time.sleep(self.delay)
        return super()._names(session_id)

    def _create_only(self, path, data):
        time.sleep(self.delay)
        return super()._create_only(path, data)

    def _read_bytes(self, path):
        time.sleep(self.delay)
        return super()._read_bytes(path)

    def claim(self, session_id):
        self.claims += 1
        return super().claim(session_id)


@pytest.mark.parametrize("gap_s", [0.0, 0.07, 0.2])
def test_session_never_fences_itself_under_store_latency(tmp_path, gap_s):
    store = SlowStore(tmp_path / "ck", delay=0.05)

    async def main():
        async with Runtime(checkpoint_store=store) as rt:  # default debounce 50 ms
            h = rt.register(SERVERS / "notes.py")
            sid = await rt.create_session(h, snapshot_from_sql(NOTES_DDL), session_id="s1")
            assert (await rt.call_tool(sid, "add_note", {"text": "turn-0"})).ok
            await anyio.sleep(gap_s)  # the debounced flush is claiming / writing now
            r0 = await rt.checkpoint(sid, turn=0)
            assert r0 is not None and r0.turn == 0
            assert (await rt.call_tool(sid, "add_note", {"text": "turn-1"})).ok
            r1 = await rt.checkpoint(sid, turn=1)
            assert r1 is not None and r1.turn == 1 and (r1.generation, r1.seq) > (r0.generation, r0.seq)
            await rt.drain()
            assert not [e for e in rt.log(sid) if e.event == "checkpoint" and not e.ok]
            assert store.claims == 1 and store.generation(sid) == 1  # the generation was claimed once
            final = rt.snapshot(sid)
        async with Runtime(checkpoint_store=CheckpointStore(tmp_path / "ck")) as rt2:
            rt2.register(SERVERS / "notes.py")
            await rt2.restore_session("s1")
            assert rt2.snapshot("s1").data == final.data and rt2.checkpoint_turn("s1") == 1
            texts = [n["text"] for n in (await rt2.call_tool("s1", "list_notes")).result]
            assert texts == ["turn-0", "turn-1"]
    anyio.run(main)


def test_flushes_are_ordered_newest_state_wins(tmp_path):
    store = SlowStore(tmp_path / "ck", delay=0.02)

    async def main():
        async with Runtime(checkpoint_store=store, debounce_s=0.0) as rt:
            h = rt.register(SERVERS / "notes.py")
            sid = await rt.create_session(h, snapshot_from_sql(NOTES_DDL), session_id="s2")
            for i in range(8):  # every call schedules a flush while earlier ones are still in flight
                assert (await rt.call_tool(sid, "add_note", {"text": f"n{i}"})).ok
                await anyio.sleep(0.005)
            await rt.drain()
            rec, img = CheckpointStore(tmp_path / "ck").read(sid)
            assert img.data == rt.snapshot(sid).data
            seqs = [int(e.message.split()[1]) for e in rt.log(sid) if e.event == "checkpoint" and e.ok]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    anyio.run(main)


CLAIMER = r"""
import os, sys
from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.state import Snapshot
store = CheckpointStore(sys.argv[1])
for _ in range(int(sys.argv[2])):
    g = store.claim("race")
    print(g, flush=True)
    try:
        store.write("race", g, "h" * 64, Snapshot("sqlite", f"{os.getpid()}-{g}".encode()))
    except Exception as err:  # stale writes are expected; anything else is reported
        if type(err).__name__ != "StaleGenerationError":
            print(f"ERROR {type(err).__name__}: {err}", flush=True)
"""


def test_processes_racing_for_one_session_get_one_owner_per_generation(tmp_path):
    import subprocess
    import sys

    url = str(tmp_path / "ck")
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, url, "60"], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300)[0].split("\n") for p in procs]
    claimed = [line for out in outs for line in out if line]
    assert not [c for c in claimed if c.startswith("ERROR")], claimed
    assert sorted(int(c) for c in claimed) == list(range(1, 241))  # every generation exactly one owner
    store = CheckpointStore(url)
    assert store.generation("race") == 240
    d = tmp_path / "ck" / "race"
    for f in d.iterdir():  # no unreadable (partial, stray-brace) file, ever
        assert not f.name.startswith(".tmp-")
        if f.suffix == ".json":
            json.loads(f.read_text())
    rec, img = store.read("race")
    assert img.data.decode().endswith(f"-{rec.generation}")


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['WEFT_PWNED']}",))


def test_tampered_checkpoint_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("WEFT_PWNED", str(marker))
    url = tmp_path / "ck"
    key = b"deployment-key"

    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(url, key=key)) as rt:
            h = rt.register(SERVERS / "wallet_obj.py")
            import types
            sid = await rt.create_session(h, snapshot_from_object(types.SimpleNamespace(balances={}, history=[])),
                                          session_id="w1")
            await rt.call_tool(sid, "deposit", {"who": "ann", "amount": 3})
            rec = await rt.checkpoint(sid, turn=0)
            assert rec is not None and rec.mac
        d = url / "w1"
        img = d / f"ckpt-{rec.generation:08d}-{rec.seq:08d}.bin"
        recf = img.with_suffix(".json")
        evil = pickle.dumps({"balances": _Evil(), "history": []}, protocol=5)
        # 1) image swapped: digest no longer matches the signed record
        img.chmod(0o644)
        os.unlink(img)
        img.write_bytes(evil)
        with pytest.raises(CheckpointIntegrityError, match="digest"):
            CheckpointStore(url, key=key).read("w1")
        # 2) record re-written to match the evil image: the MAC no longer matches
        fields = json.loads(recf.read_text())
        fields["digest"] = Snapshot("object", evil).digest
        fields["nbytes"] = len(evil)
        os.unlink(recf)
        recf.write_text(json.dumps(fields))
        async with Runtime(checkpoint_store=CheckpointStore(url, key=key)) as rt:
            rt.register(SERVERS / "wallet_obj.py")
            with pytest.raises(CheckpointIntegrityError, match="wrong MAC"):
                await rt.restore_session("w1")
        # 3) a store without a key (or a forged record) still never runs code: restricted unpickler
        async with Runtime(checkpoint_store=CheckpointStore(url)) as rt:
            rt.register(SERVERS / "wallet_obj.py")
            with pytest.raises(SnapshotSchemaError, match="not allowed"):
                await rt.restore_session("w1")
        assert not marker.exists()
    monkeypatch.delenv("TREADLE_WEFT_CHECKPOINT_KEY", raising=False)
    anyio.run(main)
    assert not marker.exists()

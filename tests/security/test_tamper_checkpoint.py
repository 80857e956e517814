"""Tampered checkpoint stores: signed records, images, deleted records, foreign keys; a refused restore never
fences the live owner and a write refused as stale is never what a restore resumes from."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.errors import CheckpointIntegrityError, StaleGenerationError
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parents[1] / "weft" / "servers"
DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"
H = "h" * 64


@pytest.fixture
def snap():
    return snapshot_from_sql(DDL)


def _written(tmp_path, snap, key="k1"):
    store = CheckpointStore(tmp_path, key=key)
    g = store.claim("s")
    rec = store.write("s", g, H, snap, turn=3)
    return store, rec, tmp_path / "s" / f"ckpt-{rec.generation:08d}-{rec.seq:08d}"


@pytest.mark.parametrize("field, value", [("turn", 99), ("server_hash", "x" * 64), ("meta", {"available": ["all"]}),
                                          ("env", None), ("mac", None), ("mac", "0" * 64), ("digest", "0" * 64)])
def test_a_tampered_signed_record_is_refused_before_its_image_is_read(tmp_path, snap, field, value):
    store, _, base = _written(tmp_path, snap)
    path = base.with_suffix(".json")
    raw = json.loads(path.read_text())
    assert CheckpointStore(tmp_path, key="k1").read("s")  # control: untouched, it reads
    raw[field] = value
    path.chmod(0o600)
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointIntegrityError):
        CheckpointStore(tmp_path, key="k1").read("s")


def test_a_tampered_image_a_foreign_key_and_a_moved_record_are_refused(tmp_path, snap):
    store, rec, base = _written(tmp_path, snap)
    with pytest.raises(CheckpointIntegrityError, match="MAC"):
        CheckpointStore(tmp_path, key="another deployment").read("s")
    image = base.with_suffix(".bin")
    data = image.read_bytes()
    image.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CheckpointIntegrityError, match="digest"):
        CheckpointStore(tmp_path, key="k1").read("s")
    moved = tmp_path / "s" / f"ckpt-{rec.generation:08d}-{rec.seq + 5:08d}.json"  # replayed as a newer record
    moved.write_text(base.with_suffix(".json").read_text())
    with pytest.raises(CheckpointIntegrityError, match="names generation"):
        CheckpointStore(tmp_path, key="k1").read("s")
    other = tmp_path / "t"  # a record of another session copied in
    other.mkdir()
    (other / base.with_suffix(".json").name).write_text(base.with_suffix(".json").read_text())
    with pytest.raises(CheckpointIntegrityError):
        CheckpointStore(tmp_path, key="k1").read("t")


def test_deleting_the_newest_record_is_noticed_by_the_store_object_that_saw_it(tmp_path, snap):
    store = CheckpointStore(tmp_path, key="k1")
    g = store.claim("s")
    store.write("s", g, H, snap)
    newest = store.write("s", g, H, snap)
    (tmp_path / "s" / f"ckpt-{g:08d}-{newest.seq:08d}.json").unlink()
    with pytest.raises(CheckpointIntegrityError, match="rolled back"):
        store.read("s")
    # what a store cannot see: a fresh object (another process) has nothing to compare with (documented)
    assert CheckpointStore(tmp_path, key="k1").read("s")[0].seq == newest.seq - 1


def test_an_unkeyed_store_says_once_that_it_trusts_its_writer(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("TREADLE_WEFT_CHECKPOINT_KEY", raising=False)
    with caplog.at_level(logging.WARNING, logger="treadle.weft.runtime.checkpoint"):
        CheckpointStore(tmp_path / "a")
        CheckpointStore(tmp_path / "a")
    lines = [r.getMessage() for r in caplog.records if "trusts whoever can write it" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "a") in lines[0]
    monkeypatch.setenv("TREADLE_WEFT_CHECKPOINT_KEY", "from-the-environment")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="treadle.weft.runtime.checkpoint"):
        keyed = CheckpointStore(tmp_path / "b")
    assert keyed.authenticated and not caplog.records  # the key comes from the environment by default


def test_a_write_refused_as_stale_is_never_resumed_from(tmp_path, snap, monkeypatch):
    store = CheckpointStore(tmp_path, key="k1")
    g = store.claim("s")
    kept = store.write("s", g, H, snap, turn=1)
    real = store._create_only

    def lose_the_session_mid_write(path, data):
        ok = real(path, data)
        if path.endswith(".bin"):
            CheckpointStore(tmp_path, key="k1").claim("s")  # a restore claims while the image is written
        return ok

    monkeypatch.setattr(store, "_create_only", lose_the_session_mid_write)
    with pytest.raises(StaleGenerationError):
        store.write("s", g, H, snap, turn=2)
    assert CheckpointStore(tmp_path, key="k1").read("s")[0] == kept


def test_a_refused_restore_does_not_fence_the_live_owner(tmp_path, snap):
    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(tmp_path, key="right")) as owner:
            h = owner.register(SERVERS / "notes.py")
            sid = await owner.create_session(h, snap, session_id="live")
            await owner.call_tool(sid, "add_note", {"text": "one"})
            assert await owner.checkpoint(sid) is not None
            async with Runtime(checkpoint_store=CheckpointStore(tmp_path, key="wrong")) as intruder:
                intruder.register(SERVERS / "notes.py")
                with pytest.raises(CheckpointIntegrityError):
                    await intruder.restore_session(sid)
            await owner.call_tool(sid, "add_note", {"text": "two"})
            rec = await owner.checkpoint(sid)  # not fenced: its next checkpoint is written
            assert rec is not None and rec.generation == 1
            assert CheckpointStore(tmp_path, key="right").generation(sid) == 1
    anyio.run(main)


def test_a_tampered_object_image_in_an_unkeyed_store_is_refused_without_fencing(tmp_path, monkeypatch):
    import fractions

    from treadle.weft.runtime.object_state import snapshot_from_object

    monkeypatch.delenv("TREADLE_WEFT_CHECKPOINT_KEY", raising=False)

    class Obj:
        pass

    o = Obj()
    o.n = 1
    store = CheckpointStore(tmp_path)
    g = store.claim("s")
    rec = store.write("s", g, "0" * 64, snapshot_from_object(o))
    evil = b"\x80\x05cfractions\nFraction\nN}\x8c\x05limit\x94K\x00s\x86b0}."  # BUILD on a class
    (tmp_path / "s" / f"ckpt-{g:08d}-{rec.seq:08d}.bin").write_bytes(evil)
    with pytest.raises(CheckpointIntegrityError, match="digest"):  # the digest catches a bare image swap
        store.read("s")
    assert "limit" not in vars(fractions.Fraction)


def _rewrite_unkeyed(tmp_path: Path, sid: str, data: bytes) -> None:
    """What a writer of an unkeyed store can do: swap the newest image and fix its record's digest."""
    import hashlib

    rec_path = max((tmp_path / sid).glob("ckpt-*.json"))
    raw = json.loads(rec_path.read_text())
    rec_path.with_suffix(".bin").write_bytes(data)
    raw["digest"], raw["nbytes"] = hashlib.sha256(data).hexdigest(), len(data)
    rec_path.write_text(json.dumps(raw))


@pytest.mark.parametrize("server, first, tamper", [
    ("notes.py", ("add_note", {"text": "one"}), "sqlite"),
    ("counter_obj.py", ("bump", {"by": 1}), "object"),
])
def test_a_tampered_image_in_an_unkeyed_store_is_refused_on_restore_without_fencing(tmp_path, snap, monkeypatch,
                                                                                     server, first, tamper):
    import fractions
    import sqlite3

    from treadle.weft.runtime.errors import SnapshotSchemaError
    from treadle.weft.runtime.object_state import snapshot_from_object

    monkeypatch.delenv("TREADLE_WEFT_CHECKPOINT_KEY", raising=False)
    if tamper == "sqlite":  # another schema: a table the server does not have
        db = sqlite3.connect(":memory:")
        db.execute("CREATE TABLE intruder (x)")
        db.commit()
        evil = db.serialize()
        start = snap
    else:  # BUILD on a class object
        evil = b"\x80\x05cfractions\nFraction\nN}\x8c\x05limit\x94K\x00s\x86b0}."

        class Counter:
            pass

        c = Counter()
        c.n, c.log = 0, []
        start = snapshot_from_object(c)

    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(tmp_path)) as owner:
            h = owner.register(SERVERS / server)
            sid = await owner.create_session(h, start, session_id="live")
            assert (await owner.call_tool(sid, *first)).ok
            assert await owner.checkpoint(sid) is not None
            _rewrite_unkeyed(tmp_path, sid, evil)
            async with Runtime(checkpoint_store=CheckpointStore(tmp_path)) as other:
                other.register(SERVERS / server)
                with pytest.raises((SnapshotSchemaError, CheckpointIntegrityError)):
                    await other.restore_session(sid)
            assert (await owner.call_tool(sid, *first)).ok
            assert await owner.checkpoint(sid) is not None  # the live owner was not fenced
    anyio.run(main)
    assert "limit" not in vars(fractions.Fraction)


def test_a_watermark_outside_the_store_notices_a_roll_back_in_a_later_process(tmp_path, snap):
    store_dir, mark = tmp_path / "store", tmp_path / "local" / "watermark.json"
    store = CheckpointStore(store_dir, key="k1", watermark=mark)
    g = store.claim("s")
    store.write("s", g, H, snap)
    newest = store.write("s", g, H, snap)
    (store_dir / "s" / f"ckpt-{g:08d}-{newest.seq:08d}.json").unlink()
    with pytest.raises(CheckpointIntegrityError, match="rolled back"):
        CheckpointStore(store_dir, key="k1", watermark=mark).read("s")  # a fresh object: the file remembers
    assert CheckpointStore(store_dir, key="k1").read("s")[0].seq == newest.seq - 1  # control: without it, unseen
    mark.write_text("{not json")
    from treadle.weft.runtime.errors import CheckpointStoreError

    with pytest.raises(CheckpointStoreError, match="watermark"):
        CheckpointStore(store_dir, key="k1", watermark=mark)

"""checkpoint.py, value by value: layout, sequence numbers, record checks,
authentication, the key from the environment, stores other than local disks, and every message."""
import json

import pytest

from treadle.weft.runtime.checkpoint import KEY_ENV, CheckpointRecord, CheckpointStore
from treadle.weft.runtime.determinism import EnvState
from treadle.weft.runtime.errors import CheckpointIntegrityError, CheckpointStoreError, StaleGenerationError
from treadle.weft.runtime.state import Snapshot

H = "h" * 64


@pytest.fixture
def snap():
    return Snapshot("object", b"\x80\x05}\x94.", EnvState(seed=7, draws=3, ticks=2, clock_start=100.0, clock_step=0.5))


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


def _names(store, sid):
    return sorted(store._names(sid))


def test_layout_and_record_fields(tmp_path, snap):
    store = CheckpointStore(tmp_path)
    assert not store.authenticated and store.url == str(tmp_path)
    g = store.claim("s")
    assert g == 1 and _names(store, "s") == ["lease-00000001.json"]
    lease = json.loads((tmp_path / "s" / "lease-00000001.json").read_text())
    assert lease["generation"] == 1 and set(lease) == {"generation", "time", "pid"}
    rec = store.write("s", g, H, snap, turn=3, meta={"k": 1})
    assert _names(store, "s") == ["ckpt-00000001-00000001.bin", "ckpt-00000001-00000001.json", "lease-00000001.json"]
    assert (tmp_path / "s" / "ckpt-00000001-00000001.bin").read_bytes() == snap.data
    assert (rec.session_id, rec.server_hash, rec.kind, rec.generation, rec.seq, rec.turn, rec.meta) == (
        "s", H, "object", 1, 1, 3, {"k": 1})
    assert (rec.digest, rec.nbytes, rec.mac) == (snap.digest, snap.nbytes, None)
    assert rec.env == snap.env.as_dict()
    back_rec, back = store.read("s")
    assert back_rec == rec and back.data == snap.data and back.env == snap.env and back.kind == "object"
    assert store.latest("s") == rec
    r2 = store.write("s", g, H, snap)
    assert (r2.seq, r2.turn, r2.meta) == (2, None, {})
    assert store.latest("s") == r2
    assert store.generation("s") == 1 and store.claim("s") == 2 and store.generation("s") == 2
    r3 = store.write("s", 2, H, snap)
    assert (r3.generation, r3.seq) == (2, 3)  # seq keeps counting across generations
    assert store.latest("s") == r3


def test_a_record_without_env_reads_with_a_fresh_env(tmp_path, snap):
    store = CheckpointStore(tmp_path)
    store.write("s", store.claim("s"), H, snap)
    p = tmp_path / "s" / "ckpt-00000001-00000001.json"
    raw = json.loads(p.read_text())
    raw["env"] = None
    p.unlink()
    p.write_text(json.dumps(raw))
    _, back = store.read("s")
    assert back.env == EnvState()


def test_an_image_whose_record_never_landed_is_skipped(tmp_path, snap):
    store = CheckpointStore(tmp_path)
    g = store.claim("s")
    (tmp_path / "s" / "ckpt-00000001-00000001.bin").write_bytes(b"torn")
    rec = store.write("s", g, H, snap)
    assert rec.seq == 2 and store.read("s")[1].data == snap.data
    (tmp_path / "s" / "ckpt-00000001-00000003.json").write_text("{}")  # taken record name for the next seq
    with pytest.raises(CheckpointStoreError, match="checkpoint record .*ckpt-00000001-00000003.json is not a "
                                                   "CheckpointRecord"):
        store.latest("s")


def test_a_record_naming_another_checkpoint_is_refused(tmp_path, snap):
    store = CheckpointStore(tmp_path)
    g = store.claim("s")
    rec = store.write("s", g, H, snap)
    bad = rec.model_copy(update={"seq": 9})
    (tmp_path / "s" / "ckpt-00000001-00000002.json").write_text(bad.model_dump_json())
    with pytest.raises(CheckpointIntegrityError, match=r"ckpt-00000001-00000002.json names generation 1 seq 9 of "
                                                       r"session 's': refused"):
        store.latest("s")
    other = rec.model_copy(update={"seq": 3, "session_id": "t"})
    (tmp_path / "s" / "ckpt-00000001-00000003.json").write_text(other.model_dump_json())
    with pytest.raises(CheckpointIntegrityError, match="of session 't': refused"):
        store.latest("s")


def test_tampered_image_is_refused(tmp_path, snap):
    store = CheckpointStore(tmp_path)
    rec = store.write("s", store.claim("s"), H, snap)
    p = tmp_path / "s" / "ckpt-00000001-00000001.bin"
    p.unlink()
    p.write_bytes(b"evil")
    with pytest.raises(CheckpointIntegrityError, match=f"is corrupt or tampered with: digest "
                                                       f"{Snapshot('object', b'evil').digest[:12]} != recorded "
                                                       f"{rec.digest[:12]}; refused"):
        store.read("s")


@pytest.mark.parametrize("key", [b"k1", "k1"])
def test_authenticated_records(tmp_path, snap, key):
    store = CheckpointStore(tmp_path, key=key)
    assert store.authenticated
    rec = store.write("s", store.claim("s"), H, snap, turn=1)
    assert rec.mac and len(rec.mac) == 64
    assert store.read("s")[0] == rec
    assert CheckpointStore(tmp_path, key=b"k1").read("s")[0] == rec  # str and bytes keys are the same key
    with pytest.raises(CheckpointIntegrityError, match="has a wrong MAC: written without this deployment's key, "
                                                       "or tampered with; refused"):
        CheckpointStore(tmp_path, key=b"k2").latest("s")
    assert CheckpointStore(tmp_path).latest("s") == rec  # without a key nothing is verified
    # a record written without a key is refused by a store with one; a field changed after signing too
    plain = CheckpointStore(tmp_path / "plain")
    plain.write("s", plain.claim("s"), H, snap)
    with pytest.raises(CheckpointIntegrityError, match="has no MAC"):
        CheckpointStore(tmp_path / "plain", key=key).latest("s")
    p = tmp_path / "s" / "ckpt-00000001-00000001.json"
    raw = json.loads(p.read_text())
    raw["turn"] = 2
    p.unlink()
    p.write_text(json.dumps(raw))
    with pytest.raises(CheckpointIntegrityError, match="wrong MAC"):
        store.latest("s")


def test_key_from_the_environment(tmp_path, snap, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "deploy")
    store = CheckpointStore(tmp_path)
    assert store.authenticated
    rec = store.write("s", store.claim("s"), H, snap)
    assert CheckpointStore(tmp_path, key="deploy").latest("s") == rec
    monkeypatch.setenv(KEY_ENV, "")
    assert not CheckpointStore(tmp_path).authenticated  # an empty variable is no key


def test_memory_store_uses_exclusive_create(snap):
    store = CheckpointStore("memory://units-ckpt")
    try:
        assert store.root == "/units-ckpt" and not store._local
        g = store.claim("m")
        rec = store.write("m", g, H, snap)
        assert store.read("m")[1].data == snap.data and rec.seq == 1
        assert store._create_only(store._path("m", "lease-00000001.json"), b"x") is False
        assert store.claim("m") == 2
        with pytest.raises(StaleGenerationError, match="session m: write from generation 1 rejected, "
                                                       "generation 2 owns it now"):
            store.write("m", 1, H, snap)
    finally:
        store.fs.rm("/units-ckpt", recursive=True)


def test_messages_of_bad_arguments(tmp_path, snap):
    store = CheckpointStore(str(tmp_path) + "/")
    assert store.root == str(tmp_path)
    with pytest.raises(TypeError, match="url must be a str or Path, got int"):
        CheckpointStore(3)
    with pytest.raises(TypeError, match="key must be bytes or str, got int"):
        CheckpointStore(tmp_path, key=5)
    with pytest.raises(CheckpointStoreError, match="cannot open checkpoint store 'nosuchproto://x'"):
        CheckpointStore("nosuchproto://x")
    for bad in ("", "a/b", ".hidden", 3, None):
        with pytest.raises(ValueError, match="session_id must be a non-empty str without '/' and not starting "
                                             "with '.', got"):
            store.generation(bad)
    assert store.generation("ok.name") == 0
    with pytest.raises(TypeError, match="snapshot must be a Snapshot, got bytes"):
        store.write("s", 0, H, b"x")
    with pytest.raises(ValueError, match=r"session s: generation 1 was never claimed \(current 0\)"):
        store.write("s", 1, H, snap)
    with pytest.raises(KeyError, match="no checkpoint for session 's' in"):
        store.read("s")
    assert store.latest("s") is None


def test_generation_ignores_files_that_are_not_leases(tmp_path):
    store = CheckpointStore(tmp_path)
    (tmp_path / "s").mkdir()
    for name in ("lease-7.json", "lease-00000009.json.tmp", "xlease-00000005.json", "lease-00000003.json"):
        (tmp_path / "s" / name).write_text("{}")
    assert store.generation("s") == 3
    assert store.claim("s") == 4
    assert CheckpointRecord.model_fields["mac"].default is None


def test_mac_is_hmac_sha256_of_the_canonical_json_of_the_record(tmp_path, snap):
    """The wire format is pinned (records signed by one worker verify in every other): HMAC-SHA256 over the
    record's JSON-mode fields without ``mac``, keys sorted, no spaces, non-JSON values as str."""
    import datetime
    import hashlib
    import hmac

    store = CheckpointStore(tmp_path, key=b"k")
    at = datetime.datetime(2026, 1, 2, 3, 4, 5)
    rec = store.write("s", store.claim("s"), H, snap, meta={"at": at, "b": 1, "a": [1, 2]})
    fields = rec.model_dump(mode="json", exclude={"mac"})
    assert fields["meta"]["at"] == "2026-01-02T03:04:05"
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    assert rec.mac == hmac.new(b"k", blob, hashlib.sha256).hexdigest()
    assert store.read("s")[0].mac == rec.mac  # verifies after the JSON round trip


def test_unreadable_image_and_write_races_are_typed(tmp_path, snap, monkeypatch):
    import treadle.weft.runtime.checkpoint as ck

    store = CheckpointStore(tmp_path)
    g = store.claim("s")
    store.write("s", g, H, snap)
    (tmp_path / "s" / "ckpt-00000001-00000001.bin").unlink()
    with pytest.raises(CheckpointStoreError, match=r"cannot read .*ckpt-00000001-00000001.bin from '.*': "):
        store.read("s")
    # every sequence number taken by an image without a record: no free number within the race limit
    monkeypatch.setattr(ck, "_MAX_RACE", 2)
    for q in (2, 3):
        (tmp_path / "s" / f"ckpt-00000001-{q:08d}.bin").write_bytes(b"torn")
    with pytest.raises(CheckpointStoreError, match="session s: no free checkpoint sequence number"):
        store.write("s", g, H, snap)
    monkeypatch.setattr(ck, "_MAX_RACE", 10_000)
    # the record's name taken between listing and creating: two writers share the generation
    real = store._create_only
    monkeypatch.setattr(store, "_create_only", lambda path, data: False if path.endswith(".json") else real(path, data))
    with pytest.raises(CheckpointStoreError, match=r"checkpoint record .*ckpt-00000001-00000004.json exists already: "
                                                   r"two writers share generation 1"):
        store.write("s", g, H, snap)


def test_a_claim_while_writing_rejects_the_write_and_leaves_no_record(tmp_path, snap, monkeypatch):
    store = CheckpointStore(tmp_path)
    g = store.claim("s")
    real = store._create_only

    def create_then_lose_the_session(path, data):
        ok = real(path, data)
        if path.endswith(".bin") and "/ckpt-" in path:
            CheckpointStore(tmp_path).claim("s")  # another worker takes over while this one writes its image
        return ok

    monkeypatch.setattr(store, "_create_only", create_then_lose_the_session)
    with pytest.raises(StaleGenerationError, match="session s: generation 2 claimed the session while generation 1 "
                                                   "wrote; write rejected"):
        store.write("s", g, H, snap)
    assert CheckpointStore(tmp_path).latest("s") is None  # the refused write is not what a restore resumes from


def test_a_claim_after_the_record_keeps_the_write_it_followed(tmp_path, snap, monkeypatch):
    store = CheckpointStore(tmp_path)
    g = store.claim("s")
    real = store._create_only

    def create_then_lose_the_session(path, data):
        ok = real(path, data)
        if path.endswith(".json") and "/ckpt-" in path:
            CheckpointStore(tmp_path).claim("s")
        return ok

    monkeypatch.setattr(store, "_create_only", create_then_lose_the_session)
    rec = store.write("s", g, H, snap)  # it happened before the claim: accepted, and the latest
    assert CheckpointStore(tmp_path).latest("s") == rec
    with pytest.raises(StaleGenerationError):
        store.write("s", g, H, snap)  # the next one is fenced


def test_local_objects_are_written_beside_their_final_name_and_linked(tmp_path, snap, monkeypatch):
    """The temporary file is made in the object's own folder (a hard link never crosses file systems), hidden
    (``.tmp-``), and gone afterwards; the object appears complete under its final name."""
    import os

    import treadle.weft.runtime.checkpoint as ck

    made = []
    real = ck.tempfile.mkstemp

    def spy(*args, **kwargs):
        fd, path = real(*args, **kwargs)
        made.append(path)
        return fd, path

    monkeypatch.setattr(ck.tempfile, "mkstemp", spy)
    store = CheckpointStore(tmp_path / "deep" / "er")
    assert store._create_only(store._path("s", "x.bin"), b"data") is True
    assert store._create_only(store._path("s", "x.bin"), b"other") is False
    assert (tmp_path / "deep" / "er" / "s" / "x.bin").read_bytes() == b"data"
    assert [os.path.dirname(p) for p in made] == [str(tmp_path / "deep" / "er" / "s")] * 2
    assert all(os.path.basename(p).startswith(".tmp-") for p in made)
    assert sorted(os.listdir(tmp_path / "deep" / "er" / "s")) == ["x.bin"]


def test_a_claim_that_loses_a_race_takes_the_next_free_generation(tmp_path, monkeypatch):
    import treadle.weft.runtime.checkpoint as ck

    store = CheckpointStore(tmp_path)
    real = store._create_only
    lost = []

    def rival_first(path, data):  # another worker creates the lease just before this one
        if path.endswith("lease-00000001.json") and not lost:
            lost.append(path)
            CheckpointStore(tmp_path).claim("s")
        return real(path, data)

    monkeypatch.setattr(store, "_create_only", rival_first)
    assert store.claim("s") == 2 and store.generation("s") == 2
    assert sorted(_names(store, "s")) == ["lease-00000001.json", "lease-00000002.json"]
    monkeypatch.setattr(store, "_create_only", lambda path, data: False)
    monkeypatch.setattr(ck, "_MAX_RACE", 3)
    with pytest.raises(CheckpointStoreError, match="session s: could not claim a generation after 3 races"):
        store.claim("s")


def test_listing_names_and_storage_options(tmp_path):
    store = CheckpointStore(tmp_path, auto_mkdir=True)  # storage options reach fsspec
    assert store.fs.auto_mkdir is True and store._local is True
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "lease-00000001.json").write_text("{}")
    (tmp_path / "s" / "sub").mkdir()
    assert _names(store, "s") == ["lease-00000001.json", "sub"]
    assert _names(store, "none") == []


def test_os_errors_listing_or_writing_name_the_path_and_store(tmp_path, monkeypatch):
    """A store the process cannot list or write (a permission error: the tests run as root, so it is
    injected) raises CheckpointStoreError naming the folder or file, the store and the OS error."""
    import tempfile

    store = CheckpointStore(tmp_path)
    store.claim("s")  # the session folder exists: listing reaches ls

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store.fs, "ls", denied)
    with pytest.raises(CheckpointStoreError) as ei:
        store.generation("s")
    assert str(ei.value) == f"cannot list {tmp_path}/s in {str(tmp_path)!r}: [Errno 13] Permission denied"
    monkeypatch.undo()
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(CheckpointStoreError) as ei:
        store.claim("s")
    assert str(ei.value) == (f"cannot write {tmp_path}/s/lease-00000002.json to {str(tmp_path)!r}: "
                             "[Errno 13] Permission denied")

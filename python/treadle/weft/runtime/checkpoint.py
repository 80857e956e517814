"""Checkpoint store for session state on an fsspec object store: create-only objects, generation fencing,
authenticated payloads.

Seed: WEFT 4.1 (MegaMCP: "after mutating calls, debounced asynchronous checkpoints to object
storage, with a generation fence against writes from stale workers"). Nothing is ever rewritten in
place; every object is created once, with the store's own exclusive-create primitive (a hard link
of a fully written temporary file on local disks, ``open(path, "xb")`` through fsspec elsewhere:
``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS, an error on the memory store)::

    <session_id>/lease-<gen>.json             one immutable lease per generation (who owns it)
    <session_id>/ckpt-<gen>-<seq>.bin         a state image (Snapshot.data)
    <session_id>/ckpt-<gen>-<seq>.json        its CheckpointRecord, created after the image: a
                                              checkpoint exists once its record exists

A worker *claims* a session (:meth:`CheckpointStore.claim`) by creating the lease of the next
generation; when two workers race for the same generation exactly one create succeeds and the
other claims the one after, so every generation has exactly one owner, across processes and
machines. A write carries the writer's generation and is rejected with
:class:`~treadle.weft.runtime.errors.StaleGenerationError` once a newer lease exists; the latest checkpoint
is the record with the highest (generation, seq), so a worker presumed dead can never overwrite its
successor's state, and a reader never sees a half-written file.

Payload authentication: with a key (``key=`` or the ``TREADLE_WEFT_CHECKPOINT_KEY`` environment
variable; per deployment, never stored beside the data), every record carries an HMAC-SHA256 over
its fields (which include the image's SHA-256), and :meth:`read` refuses a record without a valid
MAC (:class:`~treadle.weft.runtime.errors.CheckpointIntegrityError`) before any byte of the image is
deserialised. A store without a key logs one warning line (once per URL) that it trusts whoever can
write it: set the key wherever the store is shared. Object-state images are in any case unpickled by a
restricted unpickler (plain containers and the server's own classes only; see
:mod:`treadle.weft.runtime.object_state`).

Fencing: a write checks the lease after its image and before its record, and creates no record once a
newer generation exists, so a write refused as stale is never what a restore resumes from (its image,
without a record, is never read). A write that passed that check just before a claim is kept (it
happened before the claim); the new owner's first checkpoint supersedes it.

Roll-back: deleting the newest record (with write access to the store) makes the previous one the
latest, and a store cannot tell from what remains. A :class:`CheckpointStore` object remembers the
newest (generation, seq) it wrote or read per session and refuses an older "latest"
(:class:`~treadle.weft.runtime.errors.CheckpointIntegrityError`), so a runtime notices a roll-back of its own
sessions; ``watermark=`` keeps those pairs in a local file outside the store, so later processes that
use the same file notice it too. Without such an outside record nothing can detect it.
The debounce itself lives in the runtime (:class:`treadle.weft.runtime.Runtime`).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, Field

from treadle.weft.runtime.determinism import EnvState
from treadle.weft.runtime.errors import CheckpointIntegrityError, CheckpointStoreError, StaleGenerationError
from treadle.weft.runtime.state import BackendKind, Snapshot

KEY_ENV = "TREADLE_WEFT_CHECKPOINT_KEY"
_log = logging.getLogger(__name__)
_WARNED: set[str] = set()
_LEASE = re.compile(r"^lease-(\d{8,})\.json$")
_RECORD = re.compile(r"^ckpt-(\d{8,})-(\d{8,})\.json$")
_MAX_RACE = 10_000


class CheckpointRecord(BaseModel):
    """Metadata of one written checkpoint."""

    session_id: str
    server_hash: str
    kind: BackendKind
    generation: int
    seq: int
    digest: str
    nbytes: int
    time: float
    turn: int | None = None
    meta: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, Any] | None = None  # the session clock / random source (EnvState fields)
    mac: str | None = None  # HMAC-SHA256 of the other fields (stores with a key)


def _check_session_id(session_id: str) -> None:
    if not isinstance(session_id, str) or not session_id or "/" in session_id or session_id.startswith("."):
        raise ValueError(f"session_id must be a non-empty str without '/' and not starting with '.', "
                         f"got {session_id!r}")


class CheckpointStore:
    """Session checkpoints under an fsspec URL (a local folder by default).

    Args:
        url: ``"/some/dir"``, ``"file:///some/dir"``, ``"memory://x"``, ``"s3://bucket/prefix"`` (needs
            ``s3fs``), ...
        key: HMAC key (bytes or str) authenticating records; default: the ``TREADLE_WEFT_CHECKPOINT_KEY``
            environment variable, or no authentication when unset.
        watermark: a local file outside the store (e.g. on the worker's own disk) where the newest
            (generation, seq) written or read per session is kept, so that a store object of a later process
            also refuses a store whose newest record was deleted; default: kept in this object only.
        storage_options: passed to fsspec.

    Raises:
        CheckpointStoreError: the URL's protocol is unknown or its filesystem cannot be created.
        TypeError: ``url`` or ``key`` has the wrong type.
    """

    def __init__(self, url: str | Path, *, key: bytes | str | None = None, watermark: str | Path | None = None,
                 **storage_options: Any):
        if not isinstance(url, (str, Path)):
            raise TypeError(f"url must be a str or Path, got {type(url).__name__}")
        if key is None:
            key = os.environ.get(KEY_ENV) or None
        if key is not None and not isinstance(key, (bytes, str)):
            raise TypeError(f"key must be bytes or str, got {type(key).__name__}")
        self._key = key.encode() if isinstance(key, str) else key
        self.url = str(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
        except (ValueError, ImportError, OSError) as err:
            raise CheckpointStoreError(f"cannot open checkpoint store {self.url!r}: {err}") from err
        self.root = self.root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._seen: dict[str, tuple[int, int]] = {}  # newest (generation, seq) written or read, per session
        self._watermark = None if watermark is None else Path(watermark)
        self._load_watermark()
        if self._key is None and self.url not in _WARNED:
            _WARNED.add(self.url)
            _log.warning("checkpoint store %s has no key (%s unset): its records are not authenticated, it trusts "
                         "whoever can write it", self.url, KEY_ENV)

    @property
    def authenticated(self) -> bool:
        """True when records are signed and verified with a key."""
        return self._key is not None

    # -- primitives --------------------------------------------------------------------------
    def _dir(self, session_id: str) -> str:
        return f"{self.root}/{session_id}"

    def _path(self, session_id: str, name: str) -> str:
        return f"{self.root}/{session_id}/{name}"

    def _names(self, session_id: str) -> list[str]:
        d = self._dir(session_id)
        try:
            self.fs.invalidate_cache(d)
            if not self.fs.exists(d):
                return []
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(d, detail=False)]
        except (OSError, ValueError) as err:
            raise CheckpointStoreError(f"cannot list {d} in {self.url!r}: {err}") from err

    def _create_only(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists (atomically: readers never see a partial
        object); False when it already existed."""
        parent = path.rsplit("/", 1)[0]
        try:
            if self._local:
                os.makedirs(parent, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=parent, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.link(tmp, path)  # atomic exclusive create of a complete file
                finally:
                    os.unlink(tmp)
            else:
                self.fs.makedirs(parent, exist_ok=True)
                with self.fs.open(path, "xb") as f:  # conditional create (If-None-Match / ifGenerationMatch=0)
                    f.write(data)
        except FileExistsError:
            return False
        except OSError as err:
            raise CheckpointStoreError(f"cannot write {path} to {self.url!r}: {err}") from err
        return True

    def _read_bytes(self, path: str) -> bytes:
        try:
            with self.fs.open(path, "rb") as f:
                return f.read()
        except OSError as err:
            raise CheckpointStoreError(f"cannot read {path} from {self.url!r}: {err}") from err

    def _mac(self, fields: dict[str, Any]) -> str:
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
        return hmac.new(self._key, blob, hashlib.sha256).hexdigest()

    # -- generations -------------------------------------------------------------------------
    def generation(self, session_id: str) -> int:
        """The session's current generation (0 when never claimed)."""
        _check_session_id(session_id)
        gens = [int(m.group(1)) for n in self._names(session_id) if (m := _LEASE.match(n))]
        return max(gens, default=0)

    def claim(self, session_id: str) -> int:
        """Take ownership of a session: create the lease of the next generation and return it (older
        writers become stale). Racing claimers (threads, processes, machines) each get their own
        generation.

        Raises:
            CheckpointStoreError: the store cannot be listed or written.
        """
        _check_session_id(session_id)
        g = self.generation(session_id) + 1
        for _ in range(_MAX_RACE):
            lease = json.dumps({"generation": g, "time": time.time(), "pid": os.getpid()}).encode()
            if self._create_only(self._path(session_id, f"lease-{g:08d}.json"), lease):
                return g
            g = max(g + 1, self.generation(session_id) + 1)
        raise CheckpointStoreError(f"session {session_id}: could not claim a generation after {_MAX_RACE} races")

    # -- checkpoints -------------------------------------------------------------------------
    def _records(self, session_id: str) -> list[tuple[int, int]]:
        return sorted((int(m.group(1)), int(m.group(2))) for n in self._names(session_id) if (m := _RECORD.match(n)))

    def latest(self, session_id: str) -> CheckpointRecord | None:
        """The latest checkpoint record of a session (highest generation, then seq), or None.

        Raises:
            CheckpointIntegrityError: the store has a key and the record's MAC is missing or wrong.
            CheckpointStoreError: unreadable store or record.
        """
        _check_session_id(session_id)
        recs = self._records(session_id)
        if not recs:
            return None
        g, q = recs[-1]
        path = self._path(session_id, f"ckpt-{g:08d}-{q:08d}.json")
        try:
            raw = json.loads(self._read_bytes(path))
            rec = CheckpointRecord.model_validate(raw)
        except ValueError as err:
            raise CheckpointStoreError(f"checkpoint record {path} is not a CheckpointRecord: {err}") from err
        seen = self._seen.get(session_id)
        if seen is not None and (g, q) < seen:
            raise CheckpointIntegrityError(
                f"session {session_id}: the newest checkpoint is generation {g} seq {q}, but generation {seen[0]} "
                f"seq {seen[1]} was written or read before: a newer record was removed (rolled back); refused")
        if (rec.generation, rec.seq, rec.session_id) != (g, q, session_id):
            raise CheckpointIntegrityError(f"checkpoint record {path} names generation {rec.generation} seq {rec.seq} "
                                           f"of session {rec.session_id!r}: refused")
        if self._key is not None:
            fields = rec.model_dump(mode="json", exclude={"mac"})
            if not rec.mac or not hmac.compare_digest(rec.mac, self._mac(fields)):
                raise CheckpointIntegrityError(f"checkpoint record {path} has {'a wrong' if rec.mac else 'no'} MAC: "
                                               f"written without this deployment's key, or tampered with; refused")
        self._note(session_id, rec)
        return rec

    def _load_watermark(self) -> None:
        if self._watermark is None or not self._watermark.exists():
            return
        try:
            raw = json.loads(self._watermark.read_text())
            seen = {str(k): (int(v[0]), int(v[1])) for k, v in raw.items()}
        except (OSError, ValueError, TypeError, IndexError, AttributeError) as err:
            raise CheckpointStoreError(f"checkpoint watermark {str(self._watermark)!r} is unreadable: {err}") from err
        for sid, gq in seen.items():
            self._seen[sid] = max(self._seen.get(sid, (0, 0)), gq)

    def _note(self, session_id: str, rec: CheckpointRecord) -> None:
        self._seen[session_id] = max(self._seen.get(session_id, (0, 0)), (rec.generation, rec.seq))
        if self._watermark is None:
            return
        import fcntl

        try:
            self._watermark.parent.mkdir(parents=True, exist_ok=True)
            with open(self._watermark, "a+") as f:  # merged under a lock: processes sharing the file add up
                fcntl.flock(f, fcntl.LOCK_EX)
                f.seek(0)
                text = f.read()
                on_disk = json.loads(text) if text.strip() else {}
                for sid, gq in on_disk.items():
                    self._seen[sid] = max(self._seen.get(sid, (0, 0)), (int(gq[0]), int(gq[1])))
                f.seek(0)
                f.truncate()
                f.write(json.dumps({k: list(v) for k, v in sorted(self._seen.items())}))
                f.flush()
                os.fsync(f.fileno())
        except (OSError, ValueError, TypeError, IndexError) as err:
            raise CheckpointStoreError(f"cannot update checkpoint watermark {str(self._watermark)!r}: {err}") from err

    def write(self, session_id: str, generation: int, server_hash: str, snapshot: Snapshot, *,
              turn: int | None = None, meta: dict[str, Any] | None = None) -> CheckpointRecord:
        """Write a checkpoint as generation ``generation`` (two create-only objects: image, then record).

        Raises:
            StaleGenerationError: a newer generation has claimed the session.
            ValueError: ``generation`` was never claimed (greater than the current one).
            CheckpointStoreError: the store cannot be written.
        """
        _check_session_id(session_id)
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a Snapshot, got {type(snapshot).__name__}")
        current = self.generation(session_id)
        if generation < current:
            raise StaleGenerationError(f"session {session_id}: write from generation {generation} rejected, "
                                       f"generation {current} owns it now")
        if generation > current:
            raise ValueError(f"session {session_id}: generation {generation} was never claimed (current {current})")
        recs = self._records(session_id)
        seq = (recs[-1][1] + 1) if recs else 1
        for _ in range(_MAX_RACE):
            if self._create_only(self._path(session_id, f"ckpt-{generation:08d}-{seq:08d}.bin"), snapshot.data):
                break
            seq += 1  # an image of that seq exists (a write of this generation whose record never landed)
        else:
            raise CheckpointStoreError(f"session {session_id}: no free checkpoint sequence number")
        newer = self.generation(session_id)
        if newer > generation:  # claimed while the image was written: no record, so the image is never read
            raise StaleGenerationError(f"session {session_id}: generation {newer} claimed the session while "
                                       f"generation {generation} wrote; write rejected")
        rec = CheckpointRecord(session_id=session_id, server_hash=server_hash, kind=snapshot.kind,
                               generation=generation, seq=seq, digest=snapshot.digest, nbytes=snapshot.nbytes,
                               time=time.time(), turn=turn, meta=dict(meta or {}), env=snapshot.env.as_dict())
        if self._key is not None:
            rec = rec.model_copy(update={"mac": self._mac(rec.model_dump(mode="json", exclude={"mac"}))})
        path = self._path(session_id, f"ckpt-{generation:08d}-{seq:08d}.json")
        if not self._create_only(path, rec.model_dump_json().encode()):
            raise CheckpointStoreError(f"checkpoint record {path} exists already: two writers share generation "
                                       f"{generation}")
        self._note(session_id, rec)
        return rec

    def read(self, session_id: str) -> tuple[CheckpointRecord, Snapshot]:
        """The latest checkpoint of a session and its state image (authenticated before use).

        Raises:
            KeyError: the session has no checkpoint.
            CheckpointIntegrityError: the MAC is missing/wrong (with a key), or the image's digest
                differs from the record's.
            CheckpointStoreError: unreadable.
        """
        rec = self.latest(session_id)
        if rec is None:
            raise KeyError(f"no checkpoint for session {session_id!r} in {self.url!r}")
        path = self._path(session_id, f"ckpt-{rec.generation:08d}-{rec.seq:08d}.bin")
        data = self._read_bytes(path)
        snap = Snapshot(rec.kind, data, EnvState(**rec.env) if rec.env else EnvState())
        if snap.digest != rec.digest:
            raise CheckpointIntegrityError(f"checkpoint {path} is corrupt or tampered with: digest {snap.digest[:12]} "
                                           f"!= recorded {rec.digest[:12]}; refused")
        return rec, snap

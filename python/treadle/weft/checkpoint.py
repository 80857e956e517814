"""Checkpoint store for session state on an fsspec object store, with generation fencing.

Seed: WEFT 4.1 (MegaMCP: "after mutating calls, debounced asynchronous checkpoints to object
storage, with a generation fence against writes from stale workers"). Layout under the store's root::

    <session_id>/lease.json                   {"generation": g}   (who owns the session now)
    <session_id>/ckpt-<gen>-<seq>.bin         state image (Snapshot.data)
    <session_id>/latest.json                  the latest CheckpointRecord (written after the image)

A worker *claims* a session (:meth:`CheckpointStore.claim`), which bumps the generation; every write
carries the writer's generation and is rejected with :class:`StaleGenerationError` when a newer
claim exists, so a worker presumed dead cannot overwrite the checkpoint of its successor. The
check-then-write is atomic within one process (a lock per store root); across processes on a real
object store it needs conditional writes (e.g. S3 ``If-Match``), which this class does not do.
The debounce itself lives in the runtime (:class:`treadle.weft.runtime.Runtime`).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
from pydantic import BaseModel, Field

from treadle.weft.determinism import EnvState
from treadle.weft.errors import CheckpointStoreError, StaleGenerationError
from treadle.weft.state import BackendKind, Snapshot

_root_locks: dict[str, threading.Lock] = {}
_root_locks_guard = threading.Lock()


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


def _check_session_id(session_id: str) -> None:
    if not isinstance(session_id, str) or not session_id or "/" in session_id or session_id.startswith("."):
        raise ValueError(f"session_id must be a non-empty str without '/' and not starting with '.', "
                         f"got {session_id!r}")


class CheckpointStore:
    """Session checkpoints under an fsspec URL (a local folder by default).

    Args:
        url: ``"/some/dir"``, ``"file:///some/dir"``, ``"memory://x"``, ``"s3://bucket/prefix"`` (needs
            ``s3fs``), ...
        storage_options: passed to fsspec.

    Raises:
        CheckpointStoreError: the URL's protocol is unknown or its filesystem cannot be created.
    """

    def __init__(self, url: str | Path, **storage_options: Any):
        if not isinstance(url, (str, Path)):
            raise TypeError(f"url must be a str or Path, got {type(url).__name__}")
        self.url = str(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
        except (ValueError, ImportError, OSError) as err:
            raise CheckpointStoreError(f"cannot open checkpoint store {self.url!r}: {err}") from err
        self.root = self.root.rstrip("/")
        key = f"{type(self.fs).__name__}:{self.root}"
        with _root_locks_guard:
            self._lock = _root_locks.setdefault(key, threading.Lock())

    def _path(self, session_id: str, name: str) -> str:
        return f"{self.root}/{session_id}/{name}"

    def _read_json(self, path: str) -> dict[str, Any] | None:
        try:
            if not self.fs.exists(path):
                return None
            with self.fs.open(path, "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError) as err:
            raise CheckpointStoreError(f"cannot read {path} from {self.url!r}: {err}") from err

    def _write(self, path: str, data: bytes) -> None:
        try:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with self.fs.open(path, "wb") as f:
                f.write(data)
        except OSError as err:
            raise CheckpointStoreError(f"cannot write {path} to {self.url!r}: {err}") from err

    def generation(self, session_id: str) -> int:
        """The session's current generation (0 when never claimed)."""
        _check_session_id(session_id)
        lease = self._read_json(self._path(session_id, "lease.json"))
        return int(lease["generation"]) if lease else 0

    def claim(self, session_id: str) -> int:
        """Take ownership of a session: bump and return its generation (older writers become stale).

        Raises:
            CheckpointStoreError: the lease cannot be read or written.
        """
        _check_session_id(session_id)
        with self._lock:
            g = self.generation(session_id) + 1
            lease = json.dumps({"generation": g, "time": time.time()}).encode()
            self._write(self._path(session_id, "lease.json"), lease)
            return g

    def latest(self, session_id: str) -> CheckpointRecord | None:
        """The latest checkpoint record of a session, or None."""
        _check_session_id(session_id)
        rec = self._read_json(self._path(session_id, "latest.json"))
        return CheckpointRecord.model_validate(rec) if rec else None

    def write(self, session_id: str, generation: int, server_hash: str, snapshot: Snapshot, *,
              turn: int | None = None, meta: dict[str, Any] | None = None) -> CheckpointRecord:
        """Write a checkpoint as generation ``generation``.

        Raises:
            StaleGenerationError: a newer generation has claimed the session.
            ValueError: ``generation`` was never claimed (greater than the current one).
            CheckpointStoreError: the store cannot be written.
        """
        _check_session_id(session_id)
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a Snapshot, got {type(snapshot).__name__}")
        with self._lock:
            current = self.generation(session_id)
            if generation < current:
                raise StaleGenerationError(f"session {session_id}: write from generation {generation} rejected, "
                                           f"generation {current} owns it now")
            if generation > current:
                raise ValueError(f"session {session_id}: generation {generation} was never claimed (current {current})")
            prev = self.latest(session_id)
            seq = (prev.seq + 1) if prev else 1
            name = f"ckpt-{generation:08d}-{seq:08d}.bin"
            self._write(self._path(session_id, name), snapshot.data)
            rec = CheckpointRecord(session_id=session_id, server_hash=server_hash, kind=snapshot.kind,
                                   generation=generation, seq=seq, digest=snapshot.digest, nbytes=snapshot.nbytes,
                                   time=time.time(), turn=turn, meta=dict(meta or {}), env=snapshot.env.as_dict())
            self._write(self._path(session_id, "latest.json"), rec.model_dump_json().encode())
            return rec

    def read(self, session_id: str) -> tuple[CheckpointRecord, Snapshot]:
        """The latest checkpoint of a session and its state image.

        Raises:
            KeyError: the session has no checkpoint.
            CheckpointStoreError: unreadable, or the image does not match the recorded digest.
        """
        rec = self.latest(session_id)
        if rec is None:
            raise KeyError(f"no checkpoint for session {session_id!r} in {self.url!r}")
        path = self._path(session_id, f"ckpt-{rec.generation:08d}-{rec.seq:08d}.bin")
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read()
        except OSError as err:
            raise CheckpointStoreError(f"cannot read {path} from {self.url!r}: {err}") from err
        snap = Snapshot(rec.kind, data, EnvState(**rec.env) if rec.env else EnvState())
        if snap.digest != rec.digest:
            raise CheckpointStoreError(f"checkpoint {path} is corrupt: digest {snap.digest[:12]} != {rec.digest[:12]}")
        return rec, snap

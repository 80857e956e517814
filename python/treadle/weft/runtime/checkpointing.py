"""Checkpoints of a runtime's sessions: debounced after mutating calls, serialised and ordered per session,
restore after a lost worker (seed: WEFT 4.1, MegaMCP)."""
from __future__ import annotations

import time
from typing import Any

import anyio

from treadle.weft.runtime.checkpoint import CheckpointRecord
from treadle.weft.runtime.errors import (
    CheckpointStoreError,
    ErrorKind,
    StaleGenerationError,
    UnsupportedOperationError,
    WeftError,
)
from treadle.weft.runtime.sessions import _Session
from treadle.weft.runtime.state import Snapshot


class CheckpointingMixin:
    """Checkpoint methods of :class:`~treadle.weft.runtime.Runtime` (needs its store, sessions and log)."""

    store: Any
    debounce_s: float

    def _mark_dirty(self, s: _Session) -> None:
        s.dirty_at = time.monotonic()
        if not s.flusher:
            s.flusher = True
            self._require_open().start_soon(self._debounced_flush, s)

    async def _debounced_flush(self, s: _Session) -> None:
        try:
            while s.dirty_at is not None and not s.closed and not s.fenced:
                wait = s.dirty_at + self.debounce_s - time.monotonic()
                if wait > 0:
                    await anyio.sleep(wait)
                    continue
                await self._flush(s)
        finally:
            s.flusher = False

    async def _flush(self, s: _Session, turn: int | None = None) -> CheckpointRecord | None:
        """Write the session's current state as a checkpoint.

        Flushes of one session are serialised and ordered (``flush_lock``): each takes its snapshot
        after the previous flush finished, so a newer state is never overwritten by an older one.
        The session claims its generation once (first flush); only a claim by another owner (a
        ``StaleGenerationError``) fences it.
        """
        if self.store is None:
            raise WeftError("this runtime has no checkpoint_store")
        s.flushing += 1
        try:
            async with s.flush_lock:
                async with s.lock:
                    if s.state is None or s.fenced or (s.closed and s.dirty_at is None):
                        return None
                    snap = s.state.snapshot()
                    s.dirty_at = None
                if turn is not None:
                    s.turn = turn
                return await self._write_checkpoint(s, snap)
        finally:
            s.flushing -= 1

    async def _write_checkpoint(self, s: _Session, snap: Snapshot) -> CheckpointRecord | None:
        try:
            if s.generation is None:
                s.generation = await anyio.to_thread.run_sync(self.store.claim, s.id)
            gen, turn = s.generation, s.turn
            meta = {"interrupted": s.interrupted,  # the tool offer travels with the state (restore keeps it)
                    "available": None if s.available is None else sorted(s.available)}
            rec = await anyio.to_thread.run_sync(
                lambda: self.store.write(s.id, gen, s.spec.hash, snap, turn=turn, meta=meta))
        except StaleGenerationError as err:
            s.fenced = True
            self._event(s, event="checkpoint", ok=False, error_kind=ErrorKind.infrastructure, message=str(err),
                        generation=s.generation)
            self.stats.record(s.spec.hash, "<checkpoint>", None, ErrorKind.infrastructure, s.spec.name)
            return None
        except (CheckpointStoreError, OSError, ValueError) as err:
            self._event(s, event="checkpoint", ok=False, error_kind=ErrorKind.infrastructure,
                        message=f"{type(err).__name__}: {err}", generation=s.generation)
            self.stats.record(s.spec.hash, "<checkpoint>", None, ErrorKind.infrastructure, s.spec.name)
            return None
        s.last_checkpoint = rec
        self._event(s, event="checkpoint", generation=rec.generation, message=f"seq {rec.seq} {rec.digest[:12]}")
        return rec

    async def checkpoint(self, session_id: str, *, turn: int | None = None) -> CheckpointRecord | None:
        """Write a checkpoint now (e.g. at an atomic-turn boundary, ``turn`` = the turn just finished).

        Returns the record, or None when the write failed (typed ``infrastructure`` entry in the log)
        or the session was fenced by a newer generation.

        Raises:
            WeftError: the runtime has no checkpoint store.
            UnsupportedOperationError: remote-transport session.
        """
        s = self._session(session_id)
        if s.state is None:
            raise UnsupportedOperationError(f"checkpoint needs in-process state; session {s.id} uses {s.transport!r}")
        if s.fenced:
            self._event(s, event="checkpoint", ok=False, error_kind=ErrorKind.infrastructure,
                        message="stale generation: session owned by a newer worker", generation=s.generation)
            return None
        return await self._flush(s, turn=turn)

    async def drain(self) -> None:
        """Wait until no session has a pending (debounced) checkpoint."""
        while any(s.dirty_at is not None or s.flushing or s.flusher for s in self._sessions.values()
                  if not s.closed and not s.fenced):
            await anyio.sleep(self.debounce_s / 2 or 0.001)

    async def restore_session(self, session_id: str) -> str:
        """Re-open a session from its last checkpoint (e.g. after its worker died).

        Reads and authenticates the checkpoint and materialises its state first, then claims a new
        generation (a stale writer of the old one is then rejected; a refused checkpoint claims nothing,
        so the live owner keeps writing); the session gets the state and the tool offer the checkpoint
        was written with (:meth:`set_available_tools`),
        and marks the session ``interrupted`` (its rollout resumes from
        the last turn boundary, ``checkpoint_turn``; never to be counted as a policy failure).

        Raises:
            WeftError: no checkpoint store; KeyError: no checkpoint for that id;
            SnapshotSchemaError: the checkpoint's image does not fit the server's schema (nothing claimed);
            CheckpointIntegrityError: the checkpoint fails authentication, or its image names objects the
            restricted unpickler refuses (nothing of it ran); CheckpointStoreError: unreadable store;
            UnknownServerError: its server is not registered.
        """
        self._require_open()
        if self.store is None:
            raise WeftError("this runtime has no checkpoint_store")
        if session_id in self._sessions and not self._sessions[session_id].closed:
            raise ValueError(f"session {session_id!r} is open in this runtime")
        # authenticate and materialise first: a checkpoint refused (wrong key, tampered, an image the restricted
        # unpickler refuses) must not fence the live owner; claim only then, and re-read if a newer record
        # landed in between (the old owner's last write before the claim is the one to resume from)
        rec, snap = await anyio.to_thread.run_sync(self.store.read, session_id)
        spec = self.registry.spec(rec.server_hash)
        self._check_snapshot(spec, snap)  # an image of another schema is refused, nothing claimed
        binding, state = await self._bind_session(spec, session_id, "inproc", snap, None)
        gen = await anyio.to_thread.run_sync(self.store.claim, session_id)  # later stale writes are refused
        newest = await anyio.to_thread.run_sync(self.store.latest, session_id)
        if newest is not None and (newest.generation, newest.seq) != (rec.generation, rec.seq):
            binding.states.pop(session_id, None)
            binding.envs.pop(session_id, None)
            if binding is not self._shared.get(spec.hash):
                await self._close_binding(binding)
            rec, snap = await anyio.to_thread.run_sync(self.store.read, session_id)
            spec = self.registry.spec(rec.server_hash)
            self._check_snapshot(spec, snap)  # an image of another schema is refused, nothing claimed
            binding, state = await self._bind_session(spec, session_id, "inproc", snap, None)
        kept = self._closed_logs.pop(session_id, None)
        offer = rec.meta.get("available")
        s = _Session(id=session_id, spec=spec, transport="inproc", initial=snap, binding=binding, state=state,
                     generation=gen, interrupted=True, turn=rec.turn, last_checkpoint=rec,
                     available=None if offer is None else frozenset(offer) & frozenset(spec.tool_names))
        if kept is not None:
            s.log = kept
        self._sessions[session_id] = s
        self._event(s, event="restore", generation=gen,
                    message=f"from checkpoint generation {rec.generation} seq {rec.seq} turn {rec.turn}")
        return session_id

    def checkpoint_turn(self, session_id: str) -> int | None:
        """The turn recorded with the session's last checkpoint (None if none)."""
        rec = self._session(session_id).last_checkpoint
        return rec.turn if rec else None


"""Prefork worker pool: a master forks runtime workers on demand from a preloaded fork server.

Seed: WEFT 4.1 (MegaMCP: "a prefork master preloads dependencies and creates workers on demand;
workers import MCP servers as independent modules and bind session-private databases"). The pool
uses ``multiprocessing``'s *forkserver* start method with the runtime preloaded
(``set_forkserver_preload``): the fork server imports ``mcp``, pydantic and :mod:`treadle.weft` once,
and every worker is a cheap fork of it (no threads are forked: the fork server is single-threaded).
Each worker runs a :class:`~treadle.weft.runtime.Runtime` (in-process sessions, tools served through
the ``mcp`` SDK) and answers the master's requests over a pipe.

A new worker is forked when every live worker holds ``sessions_per_worker`` sessions (up to
``max_workers``). When a worker dies (killed, crashed), the call that finds it dead returns a
``crash`` outcome; its sessions are restored from their last checkpoints on another worker (a new
generation, so a late write of the dead worker would be rejected) and marked *interrupted*: the
rollout resumes from :meth:`WorkerPool.checkpoint_turn`, never counted as a policy failure. Without
a checkpoint store, sessions of a dead worker are lost (:class:`~treadle.weft.errors.WeftError`).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio

from treadle.weft import errors as _errors
from treadle.weft.callparse import ToolCall
from treadle.weft.checkpoint import CheckpointStore
from treadle.weft.determinism import EnvState
from treadle.weft.errors import ErrorKind, UnknownSessionError, WeftError
from treadle.weft.registry import Registry
from treadle.weft.runtime import ToolOutcome
from treadle.weft.state import Snapshot

_PRELOAD = ["treadle.weft.runtime", "treadle.weft.pool", "treadle.weft.checkpoint"]


# -- worker side -------------------------------------------------------------------------------
def _worker_main(conn: Any, store_url: str | None, timeout_s: float, debounce_s: float) -> None:
    """Entry point of a forked worker: serve requests from ``conn`` until shutdown or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the master decides when workers stop
    anyio.run(_worker_loop, conn, store_url, timeout_s, debounce_s)


async def _worker_loop(conn: Any, store_url: str | None, timeout_s: float, debounce_s: float) -> None:
    from treadle.weft.checkpoint import CheckpointStore
    from treadle.weft.runtime import Runtime

    def recv() -> Any:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return None

    store = CheckpointStore(store_url) if store_url else None
    async with Runtime(checkpoint_store=store, timeout_s=timeout_s, debounce_s=debounce_s) as rt:
        while True:
            msg = await anyio.to_thread.run_sync(recv)
            if msg is None or msg[0] == "shutdown":
                break
            op, args = msg
            try:
                if op == "register":
                    out: Any = rt.register(args[0])
                elif op == "create":
                    out = await rt.create_session(args[0], Snapshot(args[1], args[2], EnvState(**args[4])),
                                                  session_id=args[3])
                elif op == "call":
                    out = (await rt.call_tool(args[0], args[1], args[2])).model_dump(mode="json")
                elif op == "reset":
                    out = await rt.reset(args[0])
                elif op == "close":
                    out = await rt.close(args[0])
                elif op == "checkpoint":
                    rec = await rt.checkpoint(args[0], turn=args[1])
                    out = None if rec is None else rec.model_dump(mode="json")
                elif op == "drain":
                    out = await rt.drain()
                elif op == "restore":
                    out = await rt.restore_session(args[0])
                elif op == "snapshot":
                    s = rt.snapshot(args[0])
                    out = (s.kind, s.data, s.env.as_dict())
                elif op == "checkpoint_turn":
                    out = rt.checkpoint_turn(args[0])
                else:
                    raise ValueError(f"unknown pool operation {op!r}")
                conn.send(("ok", out))
            except Exception as err:  # noqa: BLE001  (errors go back to the master, typed by name)
                conn.send(("err", type(err).__name__, str(err)))


# -- master side -------------------------------------------------------------------------------
@dataclass(eq=False)
class _Worker:
    index: int
    process: Any
    conn: Any
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    sessions: set[str] = field(default_factory=set)
    servers: set[str] = field(default_factory=set)  # server hashes registered in this worker
    dead: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid


class WorkerDiedError(WeftError, RuntimeError):
    """The worker serving a request died before answering."""


def _raise_remote(name: str, message: str) -> None:
    cls = getattr(_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        raise cls(message)
    if name in ("ValueError", "TypeError", "KeyError"):
        raise {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}[name](message)
    raise WeftError(f"{name}: {message}")


class WorkerPool:
    """Sessions spread over forked runtime workers.

    Args:
        max_workers: most workers alive at once.
        sessions_per_worker: sessions per worker before another worker is forked.
        checkpoint_store: fsspec URL of the checkpoint store shared by all workers (needed for failover).
        timeout_s, debounce_s: passed to each worker's :class:`~treadle.weft.runtime.Runtime`.

    Use as ``async with WorkerPool(...) as pool``. Methods mirror the runtime's:
    :meth:`register`, :meth:`create_session`, :meth:`call_tool`, :meth:`reset`, :meth:`checkpoint`,
    :meth:`snapshot`, :meth:`close`.
    """

    def __init__(self, *, max_workers: int = 2, sessions_per_worker: int = 256, checkpoint_store: str | None = None,
                 timeout_s: float = 10.0, debounce_s: float = 0.05):
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        if not isinstance(sessions_per_worker, int) or sessions_per_worker < 1:
            raise ValueError(f"sessions_per_worker must be an int >= 1, got {sessions_per_worker!r}")
        if checkpoint_store is not None and not isinstance(checkpoint_store, str):
            raise TypeError(f"checkpoint_store must be an fsspec URL (str), got {type(checkpoint_store).__name__}")
        self.max_workers = max_workers
        self.sessions_per_worker = sessions_per_worker
        self.store_url = checkpoint_store
        self.timeout_s = float(timeout_s)
        self.debounce_s = float(debounce_s)
        self.registry = Registry()
        self.workers: list[_Worker] = []
        self._where: dict[str, _Worker] = {}
        self._interrupted: set[str] = set()
        self._ctx = mp.get_context("forkserver")
        self._spawn_lock = anyio.Lock()

    async def __aenter__(self) -> WorkerPool:
        self._ctx.set_forkserver_preload(_PRELOAD)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for w in self.workers:
            if not w.dead:
                try:
                    w.conn.send(("shutdown", ()))
                except (OSError, BrokenPipeError):
                    pass
        for w in self.workers:
            await anyio.to_thread.run_sync(w.process.join, 10)
            if w.process.is_alive():
                w.process.kill()
                await anyio.to_thread.run_sync(w.process.join, 5)
            w.conn.close()

    # -- plumbing ----------------------------------------------------------------------------
    async def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.store_url, self.timeout_s, self.debounce_s),
                                 daemon=True, name=f"weft-worker-{len(self.workers)}")
        await anyio.to_thread.run_sync(proc.start)
        child.close()
        w = _Worker(index=len(self.workers), process=proc, conn=parent)
        self.workers.append(w)
        return w

    async def _request(self, w: _Worker, op: str, *args: Any) -> Any:
        async with w.lock:
            if w.dead:
                raise WorkerDiedError(f"worker {w.index} (pid {w.pid}) is dead")

            def roundtrip() -> Any:
                w.conn.send((op, args))
                return w.conn.recv()

            try:
                reply = await anyio.to_thread.run_sync(roundtrip)
            except (EOFError, OSError, BrokenPipeError) as err:
                w.dead = True
                raise WorkerDiedError(f"worker {w.index} (pid {w.pid}) died during {op}: {err!r}") from err
        if reply[0] == "ok":
            return reply[1]
        _raise_remote(reply[1], reply[2])

    async def _ensure_server(self, w: _Worker, server_hash: str) -> None:
        if server_hash not in w.servers:
            got = await self._request(w, "register", self.registry.spec(server_hash).source)
            if got != server_hash:
                raise WeftError(f"worker {w.index} hashed the server as {got[:12]}, master as {server_hash[:12]}")
            w.servers.add(server_hash)

    async def _pick_worker(self, exclude: _Worker | None = None) -> _Worker:
        async with self._spawn_lock:
            live = [w for w in self.workers if not w.dead and w is not exclude and w.process.is_alive()]
            free = [w for w in live if len(w.sessions) < self.sessions_per_worker]
            if free:
                return min(free, key=lambda w: len(w.sessions))
            if len([w for w in self.workers if not w.dead]) < self.max_workers or not live:
                return await self._spawn()
            return min(live, key=lambda w: len(w.sessions))

    def _worker_of(self, session_id: str) -> _Worker:
        w = self._where.get(session_id)
        if w is None:
            raise UnknownSessionError(f"no session {session_id!r} in this pool")
        return w

    async def _failover(self, dead: _Worker) -> None:
        """Restore every session of a dead worker from its last checkpoint on another worker."""
        dead.dead = True
        if dead.process.is_alive():
            dead.process.kill()
        lost = sorted(dead.sessions)
        dead.sessions.clear()
        for sid in lost:
            self._where.pop(sid, None)
            if self.store_url is None:
                continue
            rec = await anyio.to_thread.run_sync(CheckpointStore(self.store_url).latest, sid)
            if rec is None:
                continue
            w = await self._pick_worker(exclude=dead)
            await self._ensure_server(w, rec.server_hash)
            await self._request(w, "restore", sid)
            w.sessions.add(sid)
            self._where[sid] = w
            self._interrupted.add(sid)

    # -- API ---------------------------------------------------------------------------------
    def register(self, server: Any) -> str:
        """Register a server module in the master (workers get it on first use); returns its hash."""
        return self.registry.register(server)

    async def create_session(self, server_hash: str, snapshot: Snapshot, *, session_id: str | None = None) -> str:
        """Open a session on the least-loaded worker (forking one on demand); returns its id.

        Raises: as :meth:`Runtime.create_session` (re-raised with the same exception class).
        """
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a treadle.weft.state.Snapshot, got {type(snapshot).__name__}")
        spec = self.registry.spec(server_hash)
        sid = session_id or uuid.uuid4().hex[:16]
        if sid in self._where:
            raise ValueError(f"session id {sid!r} is already open")
        w = await self._pick_worker()
        await self._ensure_server(w, spec.hash)
        await self._request(w, "create", spec.hash, snapshot.kind, snapshot.data, sid, snapshot.env.as_dict())
        w.sessions.add(sid)
        self._where[sid] = w
        return sid

    async def call_tool(self, session_id: str, name: str, arguments: dict[str, Any] | None = None) -> ToolOutcome:
        """Call a tool in a session. A dead worker gives a ``crash`` outcome and triggers failover."""
        w = self._worker_of(session_id)
        try:
            out = await self._request(w, "call", session_id, name, arguments)
        except WorkerDiedError as err:
            await self._failover(w)
            return ToolOutcome(session_id=session_id, seq=0,
                               call=ToolCall(name=name, arguments=arguments if isinstance(arguments, dict) else {}),
                               ok=False, error_kind=ErrorKind.crash, text=f"{err}; session restored from its last "
                                                                          f"checkpoint: {session_id in self._where}")
        return ToolOutcome.model_validate(out)

    async def reset(self, session_id: str) -> None:
        await self._request(self._worker_of(session_id), "reset", session_id)

    async def checkpoint(self, session_id: str, *, turn: int | None = None) -> dict[str, Any] | None:
        """Checkpoint a session now (atomic-turn boundary); the record as a dict, or None if it failed."""
        return await self._request(self._worker_of(session_id), "checkpoint", session_id, turn)

    async def drain(self) -> None:
        """Wait until no worker has a pending debounced checkpoint."""
        for w in self.workers:
            if not w.dead:
                await self._request(w, "drain")

    async def snapshot(self, session_id: str) -> Snapshot:
        kind, data, env = await self._request(self._worker_of(session_id), "snapshot", session_id)
        return Snapshot(kind, data, EnvState(**env))

    async def close(self, session_id: str) -> None:
        w = self._worker_of(session_id)
        await self._request(w, "close", session_id)
        w.sessions.discard(session_id)
        del self._where[session_id]

    def is_interrupted(self, session_id: str) -> bool:
        """True when the session was restored after its worker died."""
        self._worker_of(session_id)
        return session_id in self._interrupted

    async def checkpoint_turn(self, session_id: str) -> int | None:
        return await self._request(self._worker_of(session_id), "checkpoint_turn", session_id)

    def worker_pid(self, session_id: str) -> int:
        return self._worker_of(session_id).pid

    def kill_worker_of(self, session_id: str) -> int:
        """SIGKILL the worker serving a session (for tests and chaos drills); returns its pid."""
        pid = self.worker_pid(session_id)
        os.kill(pid, signal.SIGKILL)
        return pid

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
a checkpoint store, sessions of a dead worker are lost (:class:`~treadle.weft.runtime.errors.WeftError`).
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio

from treadle.weft.runtime import errors as _errors
from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime.checkpoint import KEY_ENV, CheckpointStore
from treadle.weft.runtime.determinism import EnvState
from treadle.weft.runtime.errors import ErrorKind, UnknownSessionError, WeftError
from treadle.weft.runtime.registry import Registry
from treadle.weft.runtime import ToolOutcome
from treadle.weft.runtime.state import Snapshot

_PRELOAD = ["treadle.weft.runtime", "treadle.weft.runtime.pool", "treadle.weft.runtime.checkpoint"]


# -- worker side -------------------------------------------------------------------------------
def _worker_main(conn: Any, store_url: str | None, timeout_s: float, debounce_s: float, key: bytes | None = None,
                 max_threads: int = 40) -> None:
    """Entry point of a forked worker: serve requests from ``conn`` until shutdown or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the master decides when workers stop
    anyio.run(_worker_loop, conn, store_url, timeout_s, debounce_s, key, max_threads)


async def _handle(rt: Any, op: str, args: tuple) -> Any:
    if op == "register":
        return rt.register(args[0])
    if op == "create":
        return await rt.create_session(args[0], Snapshot(args[1], args[2], EnvState(**args[4])), session_id=args[3])
    if op == "call":
        return (await rt.call_tool(args[0], args[1], args[2])).model_dump(mode="json")
    if op == "reset":
        return await rt.reset(args[0])
    if op == "close":
        return await rt.close(args[0])
    if op == "checkpoint":
        rec = await rt.checkpoint(args[0], turn=args[1])
        return None if rec is None else rec.model_dump(mode="json")
    if op == "drain":
        return await rt.drain()
    if op == "restore":
        return await rt.restore_session(args[0])
    if op == "snapshot":
        s = await rt.snapshot_idle(args[0])
        return (s.kind, s.data, s.env.as_dict())
    if op == "checkpoint_turn":
        return rt.checkpoint_turn(args[0])
    raise ValueError(f"unknown pool operation {op!r}")


async def _worker_loop(conn: Any, store_url: str | None, timeout_s: float, debounce_s: float,
                       key: bytes | None = None, max_threads: int = 40) -> None:
    """Requests are served concurrently (one task each; calls on one session stay ordered by the runtime's
    session lock); replies carry the request id."""
    from treadle.weft.runtime.checkpoint import CheckpointStore
    from treadle.weft.runtime import Runtime

    send_lock = threading.Lock()
    reader = anyio.CapacityLimiter(1)  # the blocking pipe read has its own thread

    def recv() -> Any:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return None

    def send(msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    async def serve(rt: Any, rid: int, op: str, args: tuple) -> None:
        try:
            reply: Any = (rid, "ok", await _handle(rt, op, args))
        except Exception as err:  # noqa: BLE001  (errors go back to the master, typed by name)
            reply = (rid, "err", type(err).__name__, str(err))
        try:
            send(reply)
        except (OSError, ValueError):  # master gone
            pass

    store = CheckpointStore(store_url, key=key) if store_url else None
    async with (Runtime(checkpoint_store=store, timeout_s=timeout_s, debounce_s=debounce_s,
                        max_threads=max_threads) as rt, anyio.create_task_group() as tg):
        while True:
            msg = await anyio.to_thread.run_sync(recv, limiter=reader)
            if msg is None or msg[1] == "shutdown":
                break
            tg.start_soon(serve, rt, *msg)
        tg.cancel_scope.cancel()


# -- master side -------------------------------------------------------------------------------
@dataclass(eq=False)
class _Worker:
    index: int
    process: Any
    conn: Any
    sessions: set[str] = field(default_factory=set)
    servers: set[str] = field(default_factory=set)  # server hashes registered in this worker
    dead: bool = False
    pending: dict[int, list[Any]] = field(default_factory=dict)  # request id -> [done event, reply]
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    registering: dict[str, anyio.Event] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid


class WorkerDiedError(WeftError, RuntimeError):
    """The worker serving a request died before answering."""


class WorkerHungError(WorkerDiedError):
    """A worker did not answer a call within the pool's deadline; it was killed (SIGKILL)."""


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
        timeout_s, debounce_s, max_threads: passed to each worker's :class:`~treadle.weft.runtime.Runtime`.
        checkpoint_key: HMAC key of the checkpoint store (default ``TREADLE_WEFT_CHECKPOINT_KEY``), handed to
            the workers through their pipe (never written to the store).
        hang_grace_s: a worker that answers no call within ``timeout_s + hang_grace_s`` (a tool holding
            the GIL, a deadlock) is killed (SIGKILL) and its sessions fail over; the call is a ``timeout``.

    Each worker serves its sessions concurrently (one task per request; async tools overlap, sync tools
    run on the worker's bounded thread pool); calls on one session stay ordered.

    Use as ``async with WorkerPool(...) as pool``. Methods mirror the runtime's:
    :meth:`register`, :meth:`create_session`, :meth:`call_tool`, :meth:`reset`, :meth:`checkpoint`,
    :meth:`snapshot`, :meth:`close`.
    """

    def __init__(self, *, max_workers: int = 2, sessions_per_worker: int = 256, checkpoint_store: str | None = None,
                 timeout_s: float = 10.0, debounce_s: float = 0.05, checkpoint_key: bytes | str | None = None,
                 max_threads: int = 40, hang_grace_s: float = 5.0):
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
        self._failover_locks: dict[int, anyio.Lock] = {}
        self._rids = itertools.count(1)
        self._tg: anyio.abc.TaskGroup | None = None
        if checkpoint_key is None:
            checkpoint_key = os.environ.get(KEY_ENV) or None
        self._key = checkpoint_key.encode() if isinstance(checkpoint_key, str) else checkpoint_key
        if not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"max_threads must be an int >= 1, got {max_threads!r}")
        if not (isinstance(hang_grace_s, (int, float)) and hang_grace_s > 0):
            raise ValueError(f"hang_grace_s must be > 0 seconds, got {hang_grace_s!r}")
        self.max_threads = max_threads
        self.hang_grace_s = float(hang_grace_s)

    async def __aenter__(self) -> WorkerPool:
        self._ctx.set_forkserver_preload(_PRELOAD)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            for w in self.workers:
                if not w.dead:
                    try:
                        with w.send_lock:
                            w.conn.send((0, "shutdown", ()))
                    except (OSError, ValueError):
                        pass
            for w in self.workers:
                await anyio.to_thread.run_sync(w.process.join, 10)
                if w.process.is_alive():
                    w.process.kill()
                    await anyio.to_thread.run_sync(w.process.join, 5)
                w.conn.close()
        finally:
            tg, self._tg = self._tg, None
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)

    # -- plumbing ----------------------------------------------------------------------------
    async def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.store_url, self.timeout_s, self.debounce_s,
                                                            self._key, self.max_threads),
                                 daemon=True, name=f"weft-worker-{len(self.workers)}")
        await anyio.to_thread.run_sync(proc.start)
        child.close()
        w = _Worker(index=len(self.workers), process=proc, conn=parent)
        self.workers.append(w)
        self._require_tg().start_soon(self._reader, w)
        return w

    def _require_tg(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise RuntimeError("use the pool inside `async with WorkerPool(...) as pool:`")
        return self._tg

    async def _reader(self, w: _Worker) -> None:
        """Route the worker's replies to their requests; on EOF (worker died) fail every pending one."""
        limiter = anyio.CapacityLimiter(1)

        def recv() -> Any:
            try:
                return w.conn.recv()
            except (EOFError, OSError):
                return None

        try:
            while True:
                reply = await anyio.to_thread.run_sync(recv, limiter=limiter, abandon_on_cancel=True)
                if reply is None:
                    break
                slot = w.pending.pop(reply[0], None)
                if slot is not None:
                    slot[1] = reply[1:]
                    slot[0].set()
        finally:
            w.dead = True
            for slot in list(w.pending.values()):
                slot[0].set()  # reply stays None: died
            w.pending.clear()

    async def _request(self, w: _Worker, op: str, *args: Any, deadline_s: float | None = None) -> Any:
        """Send one request and wait for its reply (requests to one worker run concurrently there).

        Raises:
            WorkerDiedError: the worker is dead or died before answering.
            WorkerHungError: no answer within ``deadline_s``: the worker was killed.
        """
        if w.dead:
            raise WorkerDiedError(f"worker {w.index} (pid {w.pid}) is dead")
        rid = next(self._rids)
        slot: list[Any] = [anyio.Event(), None]
        w.pending[rid] = slot
        try:
            with w.send_lock:
                w.conn.send((rid, op, args))
        except (OSError, ValueError) as err:
            w.pending.pop(rid, None)
            w.dead = True
            raise WorkerDiedError(f"worker {w.index} (pid {w.pid}) died before {op}: {err!r}") from err
        with anyio.move_on_after(deadline_s) as scope:
            await slot[0].wait()
        if scope.cancelled_caught:
            w.pending.pop(rid, None)
            self._kill(w)
            raise WorkerHungError(f"worker {w.index} (pid {w.pid}) did not answer {op} within {deadline_s:g} s: killed")
        reply = slot[1]
        if reply is None:
            raise WorkerDiedError(f"worker {w.index} (pid {w.pid}) died during {op}")
        if reply[0] == "ok":
            return reply[1]
        _raise_remote(reply[1], reply[2])

    def _kill(self, w: _Worker) -> None:
        w.dead = True
        if w.process.is_alive():
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def _ensure_server(self, w: _Worker, server_hash: str) -> None:
        while server_hash not in w.servers:
            ev = w.registering.get(server_hash)
            if ev is not None:  # another task is registering it on this worker
                await ev.wait()
                if w.dead:
                    raise WorkerDiedError(f"worker {w.index} (pid {w.pid}) is dead")
                continue
            ev = w.registering[server_hash] = anyio.Event()
            try:
                got = await self._request(w, "register", self.registry.spec(server_hash).source)
                if got != server_hash:
                    raise WeftError(f"worker {w.index} hashed the server as {got[:12]}, master as {server_hash[:12]}")
                w.servers.add(server_hash)
            finally:
                del w.registering[server_hash]
                ev.set()

    async def _pick_worker(self, exclude: _Worker | None = None, reserve: str | None = None) -> _Worker:
        async with self._spawn_lock:
            live = [w for w in self.workers if not w.dead and w is not exclude and w.process.is_alive()]
            free = [w for w in live if len(w.sessions) < self.sessions_per_worker]
            if free:
                w = min(free, key=lambda w: len(w.sessions))
            elif len([w for w in self.workers if not w.dead]) < self.max_workers or not live:
                w = await self._spawn()
            else:
                w = min(live, key=lambda w: len(w.sessions))
            if reserve is not None:  # taken under the lock: concurrent creates spread over the workers
                w.sessions.add(reserve)
            return w

    def _worker_of(self, session_id: str) -> _Worker:
        w = self._where.get(session_id)
        if w is None:
            raise UnknownSessionError(f"no session {session_id!r} in this pool")
        return w

    async def _failover(self, dead: _Worker) -> None:
        """Restore every session of a dead worker from its last checkpoint on another worker (once: callers
        that find the same dead worker wait for the first one's failover)."""
        self._kill(dead)
        async with self._failover_locks.setdefault(dead.index, anyio.Lock()):
            lost = sorted(dead.sessions)
            dead.sessions.clear()
            store = CheckpointStore(self.store_url, key=self._key) if self.store_url else None
            for sid in lost:  # `_where` keeps pointing at the dead worker until the session is back (or lost)
                # a session only reserved on the dead worker (its creation failed) may have been opened elsewhere
                # since: it is not this failover's to restore (checked again after every wait below)
                if self._where.get(sid) is not dead:
                    continue
                rec = None if store is None else await anyio.to_thread.run_sync(store.latest, sid)
                if self._where.get(sid) is not dead:
                    continue
                if rec is None:
                    self._where.pop(sid, None)
                    continue
                for _ in range(3):  # the new worker may die too
                    w = await self._pick_worker(exclude=dead)
                    try:
                        await self._ensure_server(w, rec.server_hash)
                        if self._where.get(sid) is not dead:
                            break
                        await self._request(w, "restore", sid)
                    except WorkerDiedError:
                        self._kill(w)
                        continue
                    w.sessions.add(sid)
                    self._where[sid] = w
                    self._interrupted.add(sid)
                    break
                else:
                    self._where.pop(sid, None)

    async def _session_request(self, session_id: str, op: str, *args: Any) -> Any:
        """A request about one session; when its worker is found dead, fail over and retry (3 failovers at most,
        as many as :meth:`_failover` tries replacement workers: the replacement may die too).

        Raises:
            WorkerDiedError: the session's worker died 4 times in a row during this request.
            UnknownSessionError: the session could not be restored (no checkpoint).
        """
        for attempt in range(4):
            w = self._worker_of(session_id)
            try:
                return await self._request(w, op, session_id, *args)
            except WorkerDiedError:
                if attempt == 3:
                    raise
                await self._failover(w)

    # -- API ---------------------------------------------------------------------------------
    def register(self, server: Any) -> str:
        """Register a server module in the master (workers get it on first use); returns its hash."""
        return self.registry.register(server)

    async def create_session(self, server_hash: str, snapshot: Snapshot, *, session_id: str | None = None) -> str:
        """Open a session on the least-loaded worker (forking one on demand); returns its id.

        Raises: as :meth:`Runtime.create_session` (re-raised with the same exception class).
        """
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a treadle.weft.runtime.state.Snapshot, got {type(snapshot).__name__}")
        spec = self.registry.spec(server_hash)
        sid = session_id or uuid.uuid4().hex[:16]
        if sid in self._where:
            raise ValueError(f"session id {sid!r} is already open")
        w = await self._pick_worker(reserve=sid)
        self._where[sid] = w
        try:
            await self._ensure_server(w, spec.hash)
            await self._request(w, "create", spec.hash, snapshot.kind, snapshot.data, sid, snapshot.env.as_dict())
        except BaseException:
            w.sessions.discard(sid)
            if self._where.get(sid) is w:  # (a failover may have restored an earlier life of this id elsewhere)
                self._where.pop(sid, None)
            raise
        return sid

    async def call_tool(self, session_id: str, name: str, arguments: dict[str, Any] | None = None) -> ToolOutcome:
        """Call a tool in a session. A dead worker gives a ``crash`` outcome, a hung one (no answer within
        ``timeout_s + hang_grace_s``: killed) a ``timeout``; both trigger failover."""
        w = self._worker_of(session_id)
        try:
            out = await self._request(w, "call", session_id, name, arguments,
                                      deadline_s=self.timeout_s + self.hang_grace_s)
        except WorkerDiedError as err:
            await self._failover(w)
            kind = ErrorKind.timeout if isinstance(err, WorkerHungError) else ErrorKind.crash
            return ToolOutcome(session_id=session_id, seq=0,
                               call=ToolCall(name=name, arguments=arguments if isinstance(arguments, dict) else {}),
                               ok=False, error_kind=kind, text=f"{err}; session restored from its last "
                                                               f"checkpoint: {session_id in self._where}")
        return ToolOutcome.model_validate(out)

    async def reset(self, session_id: str) -> None:
        await self._session_request(session_id, "reset")

    async def checkpoint(self, session_id: str, *, turn: int | None = None) -> dict[str, Any] | None:
        """Checkpoint a session now (atomic-turn boundary); the record as a dict, or None if it failed (also
        when the worker died: the session then fails over to its previous checkpoint)."""
        w = self._worker_of(session_id)
        try:
            return await self._request(w, "checkpoint", session_id, turn)
        except WorkerDiedError:
            await self._failover(w)
            return None

    async def drain(self) -> None:
        """Wait until no worker has a pending debounced checkpoint."""
        for w in self.workers:
            if not w.dead:
                try:
                    await self._request(w, "drain")
                except WorkerDiedError:
                    await self._failover(w)

    async def snapshot(self, session_id: str) -> Snapshot:
        kind, data, env = await self._session_request(session_id, "snapshot")
        return Snapshot(kind, data, EnvState(**env))

    async def close(self, session_id: str) -> None:
        await self._session_request(session_id, "close")
        w = self._worker_of(session_id)
        w.sessions.discard(session_id)
        del self._where[session_id]
        self._interrupted.discard(session_id)

    def is_interrupted(self, session_id: str) -> bool:
        """True when the session was restored after its worker died."""
        self._worker_of(session_id)
        return session_id in self._interrupted

    async def checkpoint_turn(self, session_id: str) -> int | None:
        return await self._session_request(session_id, "checkpoint_turn")

    def worker_pid(self, session_id: str) -> int:
        return self._worker_of(session_id).pid

    def kill_worker_of(self, session_id: str) -> int:
        """SIGKILL the worker serving a session (for tests and chaos drills); returns its pid."""
        pid = self.worker_pid(session_id)
        os.kill(pid, signal.SIGKILL)
        return pid

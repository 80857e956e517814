"""The runtime worker pool on Ray: each worker is a Ray actor holding a :class:`~treadle.weft.runtime.Runtime`.

Seed: WEFT 4.1 (MegaMCP: sessions spread over runtime workers, failover from checkpoints with a
generation fence), scaled out across nodes. :class:`RayWorkerPool`
has the API and the failure semantics of the process pool :class:`~treadle.weft.runtime.pool.WorkerPool` (it is a
subclass: placement, failover and per-session routing are shared); only the transport differs:

- a worker is a Ray actor (:class:`RuntimeActor`) scheduled by Ray (``SPREAD`` over the cluster's nodes by
  default); inside it the same request loop as a forked worker serves requests concurrently;
- checkpoints go to the shared checkpoint store (an fsspec URL: ``s3://bucket/weft``, ``gs://...``, or a
  path on a file system every node mounts; a node-local path works on one machine only) -- the object
  store every actor reaches, so a dead actor's sessions are restored from their last checkpoints on
  another actor (a new generation: a late write of the dead one is refused);
- an actor that dies (node lost, ``ray.kill``, OOM) makes the calls in flight return ``crash`` outcomes and
  its sessions fail over; one that does not answer within ``timeout_s + hang_grace_s`` is killed
  (``ray.kill``) and the call is a ``timeout``.

Ray is imported only when a pool is built (``pip install 'treadle[ray]'``).

Usage::

    async with RayWorkerPool(address="auto", max_workers=8, checkpoint_store="s3://bucket/weft") as pool:
        h = pool.register(shop)
        sid = await pool.create_session(h, shop.initial_snapshot())
        out = await pool.call_tool(sid, "place_order", {...})
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

import anyio

from treadle.weft.runtime.pool import WorkerDiedError, WorkerHungError, WorkerPool, _raise_remote, _Worker, _worker_loop

__all__ = ["RayWorkerPool", "RuntimeActor"]

_SESSION_OPS = frozenset({"call", "reset", "close", "checkpoint", "snapshot", "checkpoint_turn"})
"""Pool operations about one session (its id first): sent in the order they were made."""


class _QueueConn:
    """The pipe end a worker loop reads from and answers to, over in-process queues (inside the actor)."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.slots: dict[int, list[Any]] = {}

    def recv(self) -> Any:
        return self.inbox.get()

    def send(self, reply: Any) -> None:
        slot = self.slots.pop(reply[0], None)
        if slot is not None:
            slot[1] = reply[1:]
            slot[0].set()


class RuntimeActor:
    """A Ray actor serving one :class:`~treadle.weft.runtime.Runtime` (the request loop of
    :mod:`treadle.weft.runtime.pool` on a thread of its own); :meth:`request` is called concurrently (threaded actor).
    """

    def __init__(self, store_url: str | None, timeout_s: float, debounce_s: float, key: bytes | None,
                 max_threads: int):
        self.conn = _QueueConn()
        self.rids = itertools.count(1)
        self.thread = threading.Thread(
            target=anyio.run, args=(_worker_loop, self.conn, store_url, timeout_s, debounce_s, key, max_threads),
            daemon=True, name="weft-runtime")
        self.thread.start()

    def pid(self) -> int:
        return os.getpid()

    def request(self, op: str, args: tuple) -> tuple:
        """One pool operation; ``("ok", value)`` or ``("err", exception class name, message)``."""
        slot: list[Any] = [threading.Event(), None]
        rid = next(self.rids)
        self.conn.slots[rid] = slot
        self.conn.inbox.put((rid, op, args))
        slot[0].wait()
        return slot[1]

    def shutdown(self) -> None:
        self.conn.inbox.put(None)
        self.thread.join(10)


@dataclass(eq=False)
class _ActorHandle:
    """What the shared pool code reads of a worker's ``process``: its pid and whether it is alive."""

    actor: Any
    pid: int
    alive: bool = True

    def is_alive(self) -> bool:
        return self.alive


class RayWorkerPool(WorkerPool):
    """Sessions spread over Ray actors, each running a runtime (see the module docstring).

    Args:
        address: Ray address (``auto``, ``local``, ``ray://HOST:PORT``, ``HOST:PORT``); ignored when Ray is
            already initialised in this process.
        num_cpus: CPUs each actor reserves (default 1; a fraction packs several on one CPU). A new actor waits
            until the cluster has that much free: ``max_workers`` live actors must fit in it.
        spread: place actors with Ray's ``SPREAD`` strategy (over nodes) instead of ``DEFAULT`` (packing).
        max_concurrency: concurrent requests one actor serves (its thread pool).
        max_workers, sessions_per_worker, checkpoint_store, timeout_s, debounce_s, checkpoint_key,
            max_threads, hang_grace_s: as :class:`~treadle.weft.runtime.pool.WorkerPool`. The checkpoint key travels
            to the actors as an actor-creation argument (Ray's control store holds it; use a cluster you
            trust, or leave the store unauthenticated).

    Raises (constructor, before anything connects): ValueError / TypeError for bad arguments.
    ``__aenter__`` raises :class:`~treadle.ray_cluster.RayUnavailableError` (ray not installed) or Ray's
    ConnectionError (no cluster at ``address``).
    """

    def __init__(self, *, address: str | None = "auto", num_cpus: float = 1, spread: bool = True,
                 max_concurrency: int = 256, **pool_args: Any):
        super().__init__(**pool_args)
        from treadle.ray_cluster import check_address

        if address is not None:
            check_address(address)
        if not isinstance(num_cpus, (int, float)) or num_cpus <= 0:
            raise ValueError(f"num_cpus must be > 0, got {num_cpus!r}")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        self.address, self.num_cpus, self.spread, self.max_concurrency = address, num_cpus, spread, max_concurrency
        self.ray: Any = None
        self._actor_cls: Any = None
        self._session_locks: dict[str, anyio.Lock] = {}

    async def __aenter__(self) -> RayWorkerPool:
        from treadle.ray_cluster import ensure_ray

        self.ray = await anyio.to_thread.run_sync(ensure_ray, self.address)
        self._actor_cls = self.ray.remote(RuntimeActor).options(
            num_cpus=self.num_cpus, max_concurrency=self.max_concurrency, max_restarts=0,
            scheduling_strategy="SPREAD" if self.spread else "DEFAULT")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        live = [w for w in self.workers if not w.dead]
        for w in live:
            try:
                await anyio.to_thread.run_sync(lambda w=w: self.ray.get(w.process.actor.shutdown.remote(), timeout=15))
            except Exception:  # noqa: BLE001  (a dying actor: killed below)
                pass
        for w in self.workers:
            self._kill(w)

    # -- transport ---------------------------------------------------------------------------
    async def _spawn(self) -> _Worker:
        if self._actor_cls is None:
            raise RuntimeError("use the pool inside `async with RayWorkerPool(...) as pool:`")
        actor = self._actor_cls.remote(self.store_url, self.timeout_s, self.debounce_s, self._key, self.max_threads)
        pid = await actor.pid.remote()
        w = _Worker(index=len(self.workers), process=_ActorHandle(actor, pid), conn=None)
        self.workers.append(w)
        return w

    async def _request(self, w: _Worker, op: str, *args: Any, deadline_s: float | None = None) -> Any:
        """Send one request to the worker's actor and wait for its reply.

        Raises:
            WorkerDiedError: the actor is dead or died before answering.
            WorkerHungError: no answer within ``deadline_s``: the actor was killed.
        """
        if op in _SESSION_OPS:  # Ray does not order concurrent calls into a threaded actor: the pool does, per session
            async with self._session_locks.setdefault(args[0], anyio.Lock()):
                return await self._send(w, op, *args, deadline_s=deadline_s)
        return await self._send(w, op, *args, deadline_s=deadline_s)

    async def _send(self, w: _Worker, op: str, *args: Any, deadline_s: float | None = None) -> Any:
        if w.dead:
            raise WorkerDiedError(f"worker {w.index} (actor pid {w.pid}) is dead")
        rid = next(self._rids)
        ref = w.process.actor.request.remote(op, args)
        w.pending[rid] = [ref, None]
        reply = None
        try:
            with anyio.move_on_after(deadline_s) as scope:
                reply = await ref
        except self.ray.exceptions.RayActorError as err:
            w.dead, w.process.alive = True, False
            raise WorkerDiedError(f"worker {w.index} (actor pid {w.pid}) died during {op}: "
                                  f"{type(err).__name__}") from None
        finally:
            w.pending.pop(rid, None)
        if scope.cancelled_caught:
            self._kill(w)
            raise WorkerHungError(f"worker {w.index} (actor pid {w.pid}) did not answer {op} within "
                                  f"{deadline_s:g} s: killed")
        if reply[0] == "ok":
            return reply[1]
        _raise_remote(reply[1], reply[2])

    def _kill(self, w: _Worker) -> None:
        w.dead = True
        if w.process.alive:
            w.process.alive = False
            try:
                self.ray.kill(w.process.actor, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass

    async def close(self, session_id: str) -> None:
        await super().close(session_id)
        self._session_locks.pop(session_id, None)

    def kill_worker_of(self, session_id: str) -> int:
        """Kill (``ray.kill``) the actor serving a session, as a lost node would; returns its pid.

        The pool finds out at the next call that reaches it (as it would for a real loss)."""
        w = self._worker_of(session_id)
        self.ray.kill(w.process.actor, no_restart=True)
        return w.pid

"""Chaos drill of the worker pool: many concurrent sessions, random SIGKILLs of workers during mutating calls.

Seed: WEFT 4.1 (MegaMCP: failover from checkpoints with a generation fence). Every session owns a
SQLite table of rows tagged with its own id; each step adds one row and checkpoints the turn. The
kills are placed by progress, not by wall time (a fast machine would otherwise finish before the first
kill): ``kills`` distinct indices among the first ``sessions * steps`` mutating calls are drawn from the
seed, and the worker serving the call of each drawn index is SIGKILLed (``ray.kill`` for actors) while
that call is in flight. At the end the drill checks, per session:

- *cross-session leaks*: rows tagged with another session's id (must be 0);
- *lost checkpointed mutations*: rows of an acknowledged checkpoint missing from the session
  (restored or not; must be 0);

and reports how many sessions were restored from checkpoints and how many calls crashed; then, for
every restored session, a late write of its dead worker's generation is attempted and must be
rejected (``stale_writes_rejected``; ``stale_writes_accepted`` must be 0). The drill stops by itself:
each session runs ``steps`` turns, and every run is bounded by ``deadline_s``.

    python -m treadle.weft.runtime.chaos --sessions 1000 --workers 4 --kills 8
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import anyio
from pydantic import BaseModel

from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.errors import StaleGenerationError, WeftError
from treadle.weft.runtime.pool import WorkerDiedError, WorkerPool
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

SERVER = '''
import sqlite3
from treadle.weft.runtime.server import WeftServer

SCHEMA = "CREATE TABLE rows (id INTEGER PRIMARY KEY, tag TEXT NOT NULL, step INTEGER NOT NULL);"
server = WeftServer("chaos_rows", backend="sqlite", schema=SCHEMA)


@server.tool(writes=("rows",), returns="the new row id")
def add_row(db: sqlite3.Connection, tag: str, step: int) -> int:
    """Add one row."""
    return db.execute("INSERT INTO rows (tag, step) VALUES (?, ?)", (tag, step)).lastrowid


@server.tool(reads=("rows",), returns="all rows as [tag, step]")
def rows(db: sqlite3.Connection) -> list:
    """All rows in insertion order."""
    return [list(r) for r in db.execute("SELECT tag, step FROM rows ORDER BY id")]
'''
DDL = "CREATE TABLE rows (id INTEGER PRIMARY KEY, tag TEXT NOT NULL, step INTEGER NOT NULL);"


class ChaosReport(BaseModel):
    """Outcome of one drill (counts over all sessions)."""

    sessions: int
    workers: int
    steps: int
    kills: int
    calls: int
    crashed_calls: int
    sessions_restored: int
    cross_session_leaks: int
    lost_checkpointed_mutations: int
    acknowledged_checkpoints: int
    stale_writes_rejected: int
    stale_writes_accepted: int
    unfinished_sessions: int
    reopened_sessions: int  # killed before their first checkpoint (nothing acknowledged): opened again
    wall_s: float


async def run_chaos(*, sessions: int = 1000, workers: int = 4, steps: int = 3, kills: int = 8, seed: int = 0,
                    store: str | None = None, deadline_s: float = 900.0, ray_address: str | None = None) -> ChaosReport:
    """Run the drill (see the module docstring) and return its counts; with ``ray_address`` the workers are Ray
    actors (:class:`~treadle.weft.runtime.ray_pool.RayWorkerPool`, killed with ``ray.kill``).

    Raises:
        ValueError: a count is not positive, or ``kills`` is not below ``sessions * steps`` (each kill needs
            its own mutating call after the first).
    """
    for name, v in (("sessions", sessions), ("workers", workers), ("steps", steps)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not isinstance(kills, int) or kills < 0:
        raise ValueError(f"kills must be an int >= 0, got {kills!r}")
    if kills >= sessions * steps:
        raise ValueError(f"kills must be below sessions * steps = {sessions * steps} (one mutating call each, "
                         f"after the first), got {kills}")
    rng = random.Random(seed)
    kill_at = set(rng.sample(range(1, sessions * steps), kills))  # indices of the mutating calls to kill under
    tmp = None
    if store is None:
        tmp = tempfile.TemporaryDirectory(prefix="weft-chaos-")
        store = str(Path(tmp.name) / "store")
    snap = snapshot_from_sql(DDL)
    acked: dict[str, int] = {}  # session -> last step whose checkpoint was acknowledged (-1: creation)
    counts = {"calls": 0, "crashed": 0, "kills": 0, "leaks": 0, "lost": 0, "acks": 0, "unfinished": 0,
              "reopened": 0, "issued": 0, "owed": 0}
    restored: set[str] = set()
    t0 = time.perf_counter()
    per_worker = -(-sessions // workers)
    try:
        pool_args = dict(max_workers=workers + kills, sessions_per_worker=per_worker, checkpoint_store=store,
                         debounce_s=0.05, timeout_s=30.0)
        if ray_address is not None:
            from treadle.weft.runtime.ray_pool import RayWorkerPool

            pool_cm: WorkerPool = RayWorkerPool(address=ray_address, **pool_args)
        else:
            pool_cm = WorkerPool(**pool_args)
        async with pool_cm as pool:
            h = pool.register(SERVER)

            async def open_session(sid: str) -> None:
                for _ in range(10):  # a kill during creation loses the (unacknowledged) session: open it again
                    try:
                        await pool.create_session(h, snap, session_id=sid)
                    except WorkerDiedError:
                        continue
                    if await pool.checkpoint(sid, turn=-1) is not None:
                        acked[sid] = -1
                    if sid in pool._where:
                        return
                raise WeftError(f"{sid}: could not open the session in 10 attempts")

            async def resume(sid: str) -> int:
                """The step to continue from after a crash: after the restored turn boundary, or from the
                start when the session had no checkpoint yet (nothing was acknowledged: open it again)."""
                if sid not in pool._where:
                    counts["reopened"] += 1
                    acked.pop(sid, None)
                    await open_session(sid)
                    return 0
                restored.add(sid)
                for _ in range(10):  # the replacement worker may be killed too
                    try:
                        turn = await pool.checkpoint_turn(sid)
                    except WorkerDiedError:
                        if sid not in pool._where:
                            return await resume(sid)
                        continue
                    return (turn if turn is not None else -1) + 1
                raise WeftError(f"{sid}: could not read its checkpoint turn in 10 attempts")

            async def session(i: int) -> None:
                sid = f"chaos-{i:05d}"
                await open_session(sid)
                step = 0
                while step < steps:
                    index = counts["issued"]
                    counts["issued"] += 1
                    if index in kill_at:
                        counts["owed"] += 1
                    if counts["owed"] and not pool._where[sid].dead:  # (a dead one: the kill goes to a later call)
                        counts["owed"] -= 1
                        out = await call_and_kill(sid, step)
                    else:
                        out = await pool.call_tool(sid, "add_row", {"tag": sid, "step": step})
                    counts["calls"] += 1
                    if not out.ok:
                        counts["crashed"] += 1
                        step = await resume(sid)
                        continue
                    if await pool.checkpoint(sid, turn=step) is not None:
                        acked[sid] = step
                        counts["acks"] += 1
                        step += 1
                    else:  # the worker died between call and checkpoint
                        step = await resume(sid)
                for _ in range(3):  # the final read may meet a dying worker too
                    out = await pool.call_tool(sid, "rows")
                    if out.ok:
                        break
                else:
                    counts["unfinished"] += 1
                    return
                rows = out.result
                counts["leaks"] += sum(1 for tag, _ in rows if tag != sid)
                have = {s for tag, s in rows if tag == sid}
                counts["lost"] += sum(1 for s in range(acked.get(sid, -1) + 1) if s not in have)

            async def call_and_kill(sid: str, step: int):
                """The mutating call of a drawn index: sent, then its worker killed while it is in flight (if the
                reply wins the race, the session's next request finds the worker dead: failover all the same)."""
                w = pool._where[sid]
                result: list = []

                async def call() -> None:
                    result.append(await pool.call_tool(sid, "add_row", {"tag": sid, "step": step}))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    for _ in range(1000):  # the request is registered as pending before the call first waits
                        if w.pending or result:
                            break
                        await anyio.sleep(0)
                    pool._kill(w)
                    counts["kills"] += 1
                return result[0]

            with anyio.fail_after(deadline_s):
                async with anyio.create_task_group() as sessions_tg:
                    for i in range(sessions):
                        sessions_tg.start_soon(session, i)
        # the workers that were killed are presumed dead; a late write of theirs (their old generation) must
        # be refused: try one per restored session
        ck = CheckpointStore(store)
        stale = accepted = 0
        for sid in sorted(restored):
            g = ck.generation(sid)
            try:
                ck.write(sid, g - 1, "stale-writer", snap)
                accepted += 1
            except StaleGenerationError:
                stale += 1
        return ChaosReport(sessions=sessions, workers=workers, steps=steps, kills=counts["kills"],
                           calls=counts["calls"], crashed_calls=counts["crashed"], sessions_restored=len(restored),
                           cross_session_leaks=counts["leaks"], lost_checkpointed_mutations=counts["lost"],
                           acknowledged_checkpoints=counts["acks"], stale_writes_rejected=stale,
                           stale_writes_accepted=accepted, unfinished_sessions=counts["unfinished"],
                           reopened_sessions=counts["reopened"], wall_s=round(time.perf_counter() - t0, 2))
    finally:
        if tmp is not None:
            tmp.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kills", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=900.0)
    p.add_argument("--ray", default=None, help="workers as Ray actors: auto | local | ray://HOST:PORT | HOST:PORT")
    p.add_argument("--store", default=None, help="checkpoint store URL (default: a temporary folder; on a Ray "
                                                 "cluster of several nodes, a URL every node reaches)")
    a = p.parse_args(argv)
    if a.ray is not None:
        from treadle.ray_cluster import check_address

        try:
            check_address(a.ray)
        except ValueError as err:
            p.error(f"--ray: {err}")
    rep = anyio.run(lambda: run_chaos(sessions=a.sessions, workers=a.workers, steps=a.steps, kills=a.kills,
                                      seed=a.seed, deadline_s=a.deadline_s, ray_address=a.ray, store=a.store))
    print(json.dumps(rep.model_dump(), indent=1))


if __name__ == "__main__":
    main()

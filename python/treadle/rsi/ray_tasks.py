"""RSI seed chains and post-batch candidate evaluations as Ray tasks.

Seed: RSI sections 3.2 and 4.2 (a round runs one chain per training seed; post-batch proposals are each
evaluated by synthesising a round from the frozen queue, then judged by the Critic). The Critic, the
:class:`~treadle.rsi.loop.PostBatchGate`, the harness versions, the log and the cost ledger stay in the driver
(:class:`~treadle.rsi.loop.RSILoop`); only :meth:`RSILoop.run_chain` runs remotely, on a bare copy of the loop
that holds the config, the solver and the probe seeds (put once in Ray's object store per loop). A task
runs a contiguous slice of the queue's chains (``chunk`` of them: a chain of the offline backend costs
milliseconds, less than a Ray task's overhead).

Results equal the single-process loop for the same seeds: a chain is a pure function of (harness, task,
round, phase, online) because every random draw is seeded from those (``_rng``, ``_seed_int``); a remote
slice returns its results, the harness it ends with, and the ledger and log entries it made, which the
driver appends **in queue order**. Online rounds keep their sequential meaning (a skill admitted by chain
``i`` is seen by chain ``i+1``): inside a slice the chains run in order; slices start speculatively under the
current harness, and when slice ``j`` grows the harness, the slices after it are cancelled and rerun under
the grown one (admissions are rare, so a round is usually one wave). Candidate evaluations are submitted together (:meth:`RayChains.prefetch`);
the driver consumes them in proposal order and stops where the gate stops, so the ledger holds only the
evaluations a single-process run makes. A task whose worker dies is retried by Ray (chains are pure).

Usage::

    loop = RSILoop(seeds, solver, cfg)
    loop.distributed = RayChains("auto")     # or runs.run(..., ray_address="auto"), CLI --ray auto
    loop.step_round()
"""
from __future__ import annotations

from typing import Any

from treadle.rsi.harness import Harness
from treadle.rsi.ledger import CostLedger
from treadle.rsi.math_tasks import MathTask
from treadle.ray_cluster import ensure_ray

__all__ = ["RayChains", "run_chains_remote"]


def run_chains_remote(ctx: tuple, h: Harness, tasks: list[MathTask], rnd: int, phase: str, online: bool) -> tuple:
    """A contiguous slice of a round's chains, one after the other (as the driver would run them), on a bare
    loop built from ``ctx = (config, solver, probes)``.

    Returns ``(ChainResults, final harness, ledger entries, log entries)``.
    """
    from treadle.rsi.loop import Director, RSILoop

    config, solver, probes = ctx
    bare = RSILoop.__new__(RSILoop)  # no __init__: it would measure the seeds again
    bare.config, bare.solver, bare.probes = config, solver, probes
    bare.ledger, bare.log, bare.director, bare.round = CostLedger(), [], Director(), rnd
    out = []
    for task in tasks:
        res, h = bare.run_chain(h, task, rnd, phase, online)
        out.append(res)
    return out, h, bare.ledger.entries, bare.log


class RayChains:
    """Runs an :class:`~treadle.rsi.loop.RSILoop`'s chains as Ray tasks (set it as ``loop.distributed``).

    Args:
        address: Ray address (``auto``, ``local``, ``ray://HOST:PORT``, ``HOST:PORT``); ignored when Ray is
            already initialised in this process.
        num_cpus: CPUs each chain task reserves (default 1).
        max_retries: Ray retries of a task whose worker died (chains are pure, so a retry is exact).
        chunk: chains per Ray task (default: about two tasks per CPU of the cluster per round).

    Raises:
        RayUnavailableError: ray not installed; ValueError: malformed address.
    """

    def __init__(self, address: str | None = "auto", *, num_cpus: float = 1, max_retries: int = 3,
                 chunk: int | None = None):
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if not isinstance(num_cpus, (int, float)) or num_cpus <= 0:
            raise ValueError(f"num_cpus must be > 0, got {num_cpus!r}")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be an int >= 1 (chains per Ray task) or None (auto), got {chunk!r}")
        self.ray = ensure_ray(address)
        self.chunk = chunk
        self._slots = max(1, int(self.ray.cluster_resources().get("CPU", 1) // num_cpus))
        self._remote = self.ray.remote(num_cpus=num_cpus, max_retries=max_retries)(run_chains_remote)
        self._ctx: tuple[Any, Any] | None = None  # (loop, ObjectRef of its (config, solver, probes))
        self._pending: dict[tuple, Any] = {}
        self.submitted = 0
        """Ray tasks submitted so far (speculative ones included)."""

    def _ctx_ref(self, loop: Any) -> Any:
        if self._ctx is None or self._ctx[0] is not loop:
            self._ctx = (loop, self.ray.put((loop.config, loop.solver, loop.probes)))
        return self._ctx[1]

    def _slices(self, tasks: list[MathTask]) -> list[list[MathTask]]:
        """Contiguous slices: ``chunk`` chains each, or (auto) about two slices per CPU of the cluster."""
        size = self.chunk or max(1, -(-len(tasks) // (2 * self._slots)))
        return [tasks[i:i + size] for i in range(0, len(tasks), size)]

    @staticmethod
    def _key(h: Harness, tasks: list[MathTask], rnd: int, phase: str, online: bool) -> tuple:
        return h.digest, h.version, h.parent, tuple((t.seed_id, t.key) for t in tasks), rnd, phase, online

    def _submit(self, loop: Any, h: Harness, tasks: list[MathTask], rnd: int, phase: str, online: bool) -> Any:
        ref = self._pending.pop(self._key(h, tasks, rnd, phase, online), None)
        if ref is None:
            ref = self._remote.remote(self._ctx_ref(loop), h, tasks, rnd, phase, online)
            self.submitted += 1
        return ref

    def prefetch(self, loop: Any, harnesses: list[Harness], queue: dict[str, MathTask], rnd: int, phase: str) -> None:
        """Start the (non-online) chains of every harness on ``queue`` now; :meth:`synthesise_round` picks them
        up. Earlier prefetched chains never consumed are cancelled."""
        self.discard()
        for h in harnesses:
            for part in self._slices(list(queue.values())):
                key = self._key(h, part, rnd, phase, False)
                if key not in self._pending:
                    self._pending[key] = self._remote.remote(self._ctx_ref(loop), h, part, rnd, phase, False)
                    self.submitted += 1

    def discard(self) -> None:
        """Cancel prefetched chains nobody consumed."""
        for ref in self._pending.values():
            self.ray.cancel(ref)
        self._pending.clear()

    def synthesise_round(self, loop: Any, h: Harness, queue: dict[str, MathTask], rnd: int, phase: str,
                         online: bool) -> tuple[dict, Harness]:
        """As :meth:`RSILoop.synthesise_round` (same results, ledger and log entries, same order)."""
        items = list(queue.items())
        out: dict = {}
        i = 0
        while i < len(items):
            parts = self._slices([t for _, t in items[i:]])
            refs = [self._submit(loop, h, part, rnd, phase, online) for part in parts]
            grown = False
            for j, ref in enumerate(refs):
                results, h_out, entries, log = self.ray.get(ref)
                loop.ledger.entries.extend(entries)
                loop.log.extend(log)
                for res in results:
                    out[items[i][0]] = res
                    i += 1
                if h_out != h:  # an admitted skill: the slices after this one rerun under the grown harness
                    h, grown = h_out, True
                    for rest in refs[j + 1:]:
                        self.ray.cancel(rest)
                    break
            if not grown:
                break
        return out, h

"""Atomic-task certification by execution, coverage and near-duplicate pruning (seed: WEFT 4.1).

A candidate atomic task is *certified* on a server when, executed in the runtime from the server's
initial snapshot:

1. ``gold_executes``: every gold call runs without a tool error;
2. ``gold_passes``: the checkpoint judges the gold calls' own outcomes r = 1;
3. ``initial_fails``: the initial state does not already satisfy the task (the gold changes the
   state; for checks without state comparison, the assertions fail on the initial state);
4. ``do_nothing_zero``: an agent that makes no call scores 0;
5. ``read_only_zero``: an agent that makes the gold's read-only calls (those whose contract writes
   nothing) and no write scores 0;
6. ``expected_effect`` (SQLite state): each gold call's state change is the one its tool's contract states
   (:func:`~treadle.weft.evolve.probes.contract_violations`: declared writes, read-only claims, stored values,
   assignments, directions, the keyed row), so that a server whose bug is present at certification (a
   wrong-row write, a unit or a direction its description contradicts) does not certify it into the evidence.

Public synthesisers ship tasks that fail each of 3-5 (a lookup a read-only agent passes, a turn with
nothing to do, a check that holds from the start). Certified tasks are then pruned for
orthogonality: a task whose tool set is near a kept one (Jaccard similarity >= ``max_similarity``) is
dropped as a near-duplicate. :func:`coverage` reports which of the server's tools the kept tasks use.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointSpec

BASELINES = ("gold_executes", "gold_passes", "initial_fails", "do_nothing_zero", "read_only_zero")


class Certificate(BaseModel):
    """Verdict of certifying one atomic task on one server.

    Attributes:
        server: the server's name; task: the atomic task's name.
        tools: the gold calls' tool names, in order (the task's tool chain).
        checks: each of :data:`BASELINES` -> True when it held.
        certified: every check held.
        reasons: one line per failed check (what was observed).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: str
    task: str
    tools: tuple[str, ...]
    checks: dict[str, bool]
    certified: bool
    reasons: tuple[str, ...] = ()


class PruneDecision(BaseModel):
    """A certified task dropped as a near-duplicate of ``kept`` (``similarity`` of their tool sets)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    kept: str
    similarity: float


class Coverage(BaseModel):
    """Which of a server's tools the certified, kept tasks use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: str
    tools: tuple[str, ...]
    covered: tuple[str, ...]
    missing: tuple[str, ...]

    @property
    def ratio(self) -> float:
        return len(self.covered) / len(self.tools) if self.tools else 1.0


class ServerReport(BaseModel):
    """Certification of one server's candidates: certificates, pruned near-duplicates, kept tasks, coverage."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    server: str
    certificates: tuple[Certificate, ...]
    pruned: tuple[PruneDecision, ...]
    kept: tuple[AtomicTask, ...]
    coverage: Coverage


def _spec_without_gold(spec: CheckpointSpec) -> CheckpointSpec:
    return spec.model_copy(update={"gold_results_contained": False})


async def play(rt: Any, server_hash: str, snapshot: Snapshot, spec: CheckpointSpec, calls: Sequence[Any]):
    """Run ``calls`` in a fresh session from ``snapshot`` and judge them with ``spec``; return (outcomes, verdict)."""
    sid = await rt.create_session(server_hash, snapshot)
    try:
        outs = [await rt.call_tool(sid, c.name, c.arguments) for c in calls]
        return outs, await rt.verify_turn(sid, snapshot, spec, outs)
    finally:
        await rt.close(sid)


async def certify_task(rt: Any, server_hash: str, snapshot: Snapshot, task: AtomicTask) -> Certificate:
    """Certify ``task`` by execution on the registered server ``server_hash`` from ``snapshot``.

    Raises:
        TypeError: ``task`` is not an AtomicTask or ``snapshot`` not a Snapshot.
    """
    if not isinstance(task, AtomicTask):
        raise TypeError(f"task must be an AtomicTask, got {type(task).__name__}")
    if not isinstance(snapshot, Snapshot):
        raise TypeError(f"snapshot must be a Snapshot, got {type(snapshot).__name__}")
    spec = rt.registry.spec(server_hash)
    contracts = {t["name"]: t for t in spec.tools}
    gold = list(task.checkpoint.gold_calls or [])
    checks: dict[str, bool] = {}
    reasons: list[str] = []

    def record(name: str, ok: bool, why: str) -> None:
        checks[name] = ok
        if not ok:
            reasons.append(f"{name}: {why}")

    outs, verdict = await play(rt, server_hash, snapshot, task.checkpoint, gold)
    failed = [o for o in outs if not o.ok]
    record("gold_executes", not failed,
           f"{failed[0].call.name} -> {failed[0].error_kind.value if failed[0].error_kind else '?'}: "
           f"{failed[0].text[:160]}" if failed else "")
    record("gold_passes", verdict.r == 1, "; ".join(verdict.details)[:300])
    # the initial state against the task's state evidence (the gold's returns are not asked for)
    _, init = await play(rt, server_hash, snapshot, _spec_without_gold(task.checkpoint), [])
    record("initial_fails", init.r == 0, "the initial state already satisfies the check (nothing to do)")
    _, nothing = await play(rt, server_hash, snapshot, task.checkpoint, [])
    record("do_nothing_zero", nothing.r == 0, "an agent that makes no call passes")
    reads = [c for c in gold if not _writes(contracts, c.name)]
    _, ro = await play(rt, server_hash, snapshot, task.checkpoint, reads)
    record("read_only_zero", ro.r == 0, f"an agent making only the read calls {[c.name for c in reads]} passes")
    if snapshot.kind == "sqlite" and not failed:
        from treadle.weft.evolve.probes import contract_probe

        broken = await contract_probe(rt, server_hash, snapshot, gold, contracts)
        record("expected_effect", not broken, "; ".join(broken[:3]))
    return Certificate(server=spec.name, task=task.name, tools=tuple(c.name for c in gold), checks=checks,
                       certified=all(checks.values()), reasons=tuple(reasons))


def _writes(contracts: dict[str, dict], tool: str) -> bool:
    t = contracts.get(tool)
    if t is None:
        return False
    contract = t.get("contract") or {}
    return bool(contract.get("writes"))


def jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    """Jaccard similarity of two tool chains as sets (1.0 for two empty chains)."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def prune(certificates: Sequence[Certificate], max_similarity: float = 0.8
          ) -> tuple[list[Certificate], list[PruneDecision]]:
    """Greedy orthogonality pruning over certified tasks, in order: drop a task whose tool set has Jaccard
    similarity >= ``max_similarity`` with a kept one. Returns (kept, pruned).

    Raises:
        ValueError: ``max_similarity`` not in (0, 1].
    """
    if not isinstance(max_similarity, (int, float)) or not 0 < max_similarity <= 1:
        raise ValueError(f"max_similarity must be in (0, 1], got {max_similarity!r}")
    kept: list[Certificate] = []
    pruned: list[PruneDecision] = []
    for c in certificates:
        if not c.certified:
            continue
        near = max(((jaccard(c.tools, k.tools), k) for k in kept), key=lambda x: x[0], default=None)
        if near is not None and near[0] >= max_similarity:
            pruned.append(PruneDecision(task=c.task, kept=near[1].task, similarity=round(near[0], 4)))
        else:
            kept.append(c)
    return kept, pruned


def coverage(server: str, tool_names: Sequence[str], kept: Sequence[Certificate]) -> Coverage:
    """Which of ``tool_names`` appear in the kept tasks' tool chains."""
    used = {t for c in kept for t in c.tools}
    tools = tuple(sorted(tool_names))
    return Coverage(server=server, tools=tools, covered=tuple(t for t in tools if t in used),
                    missing=tuple(t for t in tools if t not in used))


async def certify_server(rt: Any, server_hash: str, snapshot: Snapshot, tasks: Sequence[AtomicTask], *,
                         max_similarity: float = 0.8) -> ServerReport:
    """Certify every candidate, prune near-duplicates, report coverage (one report per server).

    A candidate that raises while being certified (a runtime or server failure) is recorded as not
    certified with the error as its reason; the other candidates go on.
    """
    spec = rt.registry.spec(server_hash)
    certs: list[Certificate] = []
    for t in tasks:
        try:
            certs.append(await certify_task(rt, server_hash, snapshot, t))
        except (TypeError, ValueError):
            raise
        except Exception as err:  # noqa: BLE001  (one broken candidate never ends the round)
            certs.append(Certificate(server=spec.name, task=getattr(t, "name", "?"), tools=(), checks={},
                                     certified=False, reasons=(f"certification raised {type(err).__name__}: {err}",)))
    kept, pruned = prune(certs, max_similarity)
    names = {c.task for c in kept}
    return ServerReport(server=spec.name, certificates=tuple(certs), pruned=tuple(pruned),
                        kept=tuple(t for t in tasks if t.name in names),
                        coverage=coverage(spec.name, spec.tool_names, kept))


"""An evolving system over a synthesised environment (what ``treadle weft evolve --synth DIR --tasks FILE`` runs).

The artefacts of an accepted ``treadle weft synth`` run (``DIR/result.json``) are the *certified*
environment: the given atomic tasks are certified on it by execution
(:func:`~treadle.weft.evolve.certify.certify_task`: the gold executes and passes, the initial state, a
do-nothing and a read-only agent score 0), their reference evidence recorded and their verifiers generated
from it. The backend *served* is that of the artefacts, or another source (``backend_source``: a backend
edited or regenerated since, possibly broken). The evolution loop then blames and revises it like any
component; with an :class:`~treadle.weft.evolve.revise.LLMReviser`, the ``backend`` role rewrites it and
the synthesis validation accepts it in the sandbox. Generated code never runs in this process: the
served module calls it in :mod:`treadle.sandbox` workers.

Tasks file: JSON Lines (or one JSON list), one atomic task a line:
``{"name": str, "request": str, "gold": [{"name": tool, "arguments": {...}}], "depends_on": [names]}``.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime.verify import CheckpointSpec

__all__ = ["RESULT", "TaskLine", "load_synth_dir", "load_tasks", "synth_system"]

RESULT = "result.json"
"""The artefacts file a ``treadle weft synth`` run writes into its ``--out`` folder."""


class TaskLine(BaseModel):
    """One atomic task of a tasks file."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    request: str = Field(min_length=1)
    gold: list[ToolCall] = Field(min_length=1)
    depends_on: list[str] = Field(default_factory=list)

    def task(self) -> AtomicTask:
        return AtomicTask(name=self.name, request=self.request, depends_on=tuple(self.depends_on),
                          checkpoint=CheckpointSpec(name=self.name, gold_calls=list(self.gold)))


def load_synth_dir(path: str | Path) -> Any:
    """The accepted :class:`~treadle.weft.evolve.synth.SynthResult` of a ``treadle weft synth`` output folder.

    Raises:
        ValueError: ``path`` is not a folder, holds no readable ``result.json``, or its synthesis was not accepted.
    """
    from treadle.weft.evolve.synth import SynthResult

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{str(p)!r} is not a folder (expected a `treadle weft synth` --out folder)")
    try:
        res = SynthResult.model_validate_json((p / RESULT).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{str(p)!r} holds no readable {RESULT} ({err.strerror})") from None
    except (ValidationError, ValueError) as err:
        raise ValueError(f"{str(p / RESULT)!r} is not a synthesis result: {str(err).splitlines()[0][:200]}") from None
    if not res.accepted or res.backend is None or res.design is None or res.schema_ is None or res.checks is None:
        raise ValueError(f"the synthesis in {str(p)!r} was not accepted; only accepted artefacts are evolved")
    return res


def load_tasks(path: str | Path, tools: Sequence[str]) -> list[AtomicTask]:
    """Atomic tasks of a tasks file (see the module docstring) whose gold calls use only ``tools``.

    Raises:
        ValueError: unreadable file, a line that is not a task (its number said), no task, a duplicate name, an
            unknown tool or dependency.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {str(path)!r}: {err}") from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            rows = list(enumerate(json.loads(stripped), 1))
        except json.JSONDecodeError as err:
            raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((n, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise ValueError(f"line {n} is not JSON: {err}") from None
    tasks: list[AtomicTask] = []
    for n, row in rows:
        try:
            t = TaskLine.model_validate(row)
        except ValidationError as err:
            e = err.errors()[0]
            raise ValueError(f"task {n}: {'.'.join(map(str, e['loc'])) or 'task'}: {e['msg']} (expected "
                             '{"name", "request", "gold": [{"name", "arguments"}], "depends_on"?})') from None
        unknown = sorted({c.name for c in t.gold} - set(tools))
        if unknown:
            raise ValueError(f"task {t.name!r}: unknown tool(s) {unknown}; the environment has {sorted(tools)}")
        if any(x.name == t.name for x in tasks):
            raise ValueError(f"task {t.name!r} appears twice")
        tasks.append(t.task())
    if not tasks:
        raise ValueError(f"{str(path)!r} holds no task")
    names = {t.name for t in tasks}
    for t in tasks:
        missing = sorted(set(t.depends_on) - names)
        if missing:
            raise ValueError(f"task {t.name!r} depends on unknown task(s) {missing}")
    return tasks


async def synth_system(rt: Any, result: Any, name: str, tasks: Sequence[AtomicTask], *,
                       backend_source: str | None = None, limits: Any = None) -> Any:
    """An :class:`~treadle.weft.evolve.loop.EvolvingSystem` of one synthesised environment ``name``: ``tasks``
    certified on ``result``'s artefacts, served with ``backend_source`` (default: the artefacts' backend).

    Raises:
        ValueError: a task does not certify on the artefacts (its failed baselines said), or the artefacts are not
            servable. :class:`treadle.sandbox.SandboxUnavailableError`: no sandbox here.
    """
    from treadle.weft.evolve.attribute import generate_verifier, record_evidence
    from treadle.weft.evolve.certify import certify_task
    from treadle.weft.evolve.loop import EvolvingSystem, TaskSlot
    from treadle.weft.evolve.revise import SynthEnv
    from treadle.weft.evolve.synth_serve import synth_env
    from treadle.weft.evolve.synth_validate import Backend

    certified = SynthEnv(result, name, limits, certified=result)
    healthy = certified.source()
    env = await synth_env(rt, healthy)
    slots = []
    for task in tasks:
        cert = await certify_task(rt, env.server_hash, env.snapshot, task)
        if not cert.certified:
            raise ValueError(f"task {task.name!r} does not certify on the synthesised environment: "
                             + "; ".join(cert.reasons)[:300])
        gold = list(task.checkpoint.gold_calls or [])
        ev = await record_evidence(rt, env.server_hash, env.snapshot, task.name, gold)
        slots.append(TaskSlot(env=name, task=task, start=env.snapshot, spec=generate_verifier(task.checkpoint,
                                                                                              env.snapshot, ev),
                              evidence=ev, certified_start=env.snapshot))
    current = result if backend_source is None else result.model_copy(
        update={"backend": Backend(source=backend_source)})
    served = SynthEnv(current, name, limits, certified=result)
    return EvolvingSystem(sources={name: served.source()}, certified={name: healthy}, tasks=slots,
                          synth={name: served})

"""WEFT's task types: atomic tasks with dependencies, disclosure levels and checkpoints (WEFT 4.1).

A :class:`RolloutTask` is the one definition every environment, view and harness reads: goals,
dependencies, initial state, completion conditions (checkpoints) and the server whose tools the model
gets. These types sit below both the environments (which define tasks) and the rollouts (which run
them), so neither layer imports the other for them.

Disclosure (SimUser view) is structured data on each atomic task: ``details`` are the literal
facts of the request (values of the gold calls' arguments that appear in the request text);
``vague`` withholds all of them, ``partial`` reveals the first half, ``full`` is the request as
written.
"""
from __future__ import annotations

import graphlib
import hashlib
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from treadle.weft.runtime.verify import CheckpointSpec

Disclosure = Literal["vague", "partial", "full"]
DISCLOSURES: tuple[Disclosure, ...] = ("vague", "partial", "full")
WITHHELD = "[ask me]"


class DependencyCycleError(ValueError):
    """The atomic tasks' ``depends_on`` edges form a cycle (or name an unknown task)."""


class AtomicTask(BaseModel):
    """One atomic task: smallest independently verifiable unit of a rollout task.

    Attributes:
        name: unique within its task (also the checkpoint's name).
        request: the user's request as written (the ``full`` disclosure).
        details: literal facts of the request, in the order they are revealed.
        depends_on: names of atomic tasks that must be done first.
        checkpoint: the completion condition (gold calls, state checks), judged by the runtime.
        tools: names of the environment's tools offered to the model on this turn (None: every tool).
            Turns that withhold tools (BFCL ``missed_function`` / ``excluded_function``) list the rest;
            the runtime answers a call to a withheld tool ``unknown_tool``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str
    request: str
    details: tuple[str, ...] = ()
    depends_on: tuple[str, ...] = ()
    checkpoint: CheckpointSpec
    tools: tuple[str, ...] | None = None

    def disclose(self, level: Disclosure, extra: int = 0) -> str:
        """The request at ``level`` with ``extra`` more details revealed (asked for by the model)."""
        if level not in DISCLOSURES:
            raise ValueError(f"disclosure level must be one of {DISCLOSURES}, got {level!r}")
        shown = {"vague": 0, "partial": (len(self.details) + 1) // 2, "full": len(self.details)}[level] + extra
        text = self.request
        for d in self.details[shown:]:
            text = text.replace(d, WITHHELD)
        return text

    @property
    def gold(self) -> list[str]:
        return [str(c) for c in self.checkpoint.gold_calls or []]


class RolloutTask(BaseModel):
    """A multi-turn task: atomic tasks, the environment they run in, and its initial state.

    Attributes:
        name: task name; env: environment name (a key of the builder passed to the runner).
        atomic: the atomic tasks (any order; run in dependency order).
        disclosure: SimUser disclosure level of every atomic task's first request.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    env: str
    atomic: tuple[AtomicTask, ...]
    disclosure: Disclosure = "full"

    def ordered(self) -> list[AtomicTask]:
        """Atomic tasks in dependency order (stable: ties keep declaration order).

        Raises:
            DependencyCycleError: a cycle, or a dependency on an unknown or duplicate name.
        """
        names = [a.name for a in self.atomic]
        if len(set(names)) != len(names):
            raise DependencyCycleError(f"task {self.name!r}: duplicate atomic task names {names}")
        by_name = {a.name: a for a in self.atomic}
        for a in self.atomic:
            missing = [d for d in a.depends_on if d not in by_name]
            if missing:
                raise DependencyCycleError(f"task {self.name!r}: {a.name!r} depends on unknown {missing}")
        ts = graphlib.TopologicalSorter({a.name: a.depends_on for a in self.atomic})
        try:
            ts.prepare()
        except graphlib.CycleError as err:
            raise DependencyCycleError(f"task {self.name!r}: dependency cycle {err.args[1]}") from None
        out: list[AtomicTask] = []
        while ts.is_active():
            ready = sorted(ts.get_ready(), key=names.index)
            out.extend(by_name[n] for n in ready)
            ts.done(*ready)
        return out

    @property
    def key(self) -> str:
        """Hash of the task's canonical JSON (run folders resume by it)."""
        doc = {"name": self.name, "env": self.env, "disclosure": self.disclosure,
               "atomic": [{"name": a.name, "request": a.request, "details": a.details, "depends_on": a.depends_on,
                           "gold": a.gold, **({} if a.tools is None else {"tools": sorted(a.tools)})}
                          for a in self.atomic]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _literals(v: Any) -> list[str]:
    if isinstance(v, dict):
        return [x for item in v.values() for x in _literals(item)]
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _literals(item)]
    if isinstance(v, bool) or v is None:
        return []
    return [str(v)]


def details_of(request: str, checkpoint: CheckpointSpec) -> tuple[str, ...]:
    """Rule: literal argument values of the gold calls that occur as words in ``request``, in order of appearance."""
    found: dict[str, int] = {}
    for c in checkpoint.gold_calls or []:
        for lit in _literals(c.arguments):
            m = re.search(r"(?<![\w@.])" + re.escape(lit) + r"(?![\w@])", request)
            if m and lit not in found:
                found[lit] = m.start()
    return tuple(sorted(found, key=found.get))

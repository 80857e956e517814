"""Rollout tasks: WEFT's task types (:mod:`treadle.weft.tasks`) and the shop tasks as rollout tasks.

A :class:`RolloutTask` is the one definition every view and harness reads; views only choose *what the
model is told* (see :mod:`~treadle.weft.rollouts.views`). :func:`from_shop` derives the disclosure
details by rule from the shop tasks' own turn texts.
"""
from __future__ import annotations

from treadle.weft.tasks import (DISCLOSURES, WITHHELD, AtomicTask, DependencyCycleError, Disclosure, RolloutTask,
                                details_of)

__all__ = ["DISCLOSURES", "WITHHELD", "AtomicTask", "DependencyCycleError", "Disclosure", "RolloutTask", "details_of",
           "from_shop", "replicate"]


def from_shop(disclosure: Disclosure = "full") -> list[RolloutTask]:
    """The shop tasks (:mod:`treadle.weft.envs.shop_tasks`) as rollout tasks (each turn depends on the previous one)."""
    from treadle.weft.envs import shop_tasks

    out = []
    for t in shop_tasks.tasks():
        atomic = []
        for i, turn in enumerate(t.turns):
            atomic.append(AtomicTask(name=turn.checkpoint.name, request=turn.user,
                                     details=details_of(turn.user, turn.checkpoint),
                                     depends_on=(t.turns[i - 1].checkpoint.name,) if i else (),
                                     checkpoint=turn.checkpoint))
        out.append(RolloutTask(name=t.name, env="shop", atomic=tuple(atomic), disclosure=disclosure))
    return out


def replicate(tasks: list[RolloutTask], n: int) -> list[RolloutTask]:
    """``n`` renamed copies of each task (``name#i``): independent draws of a seeded policy on the same task set."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"replicas must be an int >= 1, got {n!r}")
    return [t.model_copy(update={"name": f"{t.name}#{i}"}) for i in range(n) for t in tasks]

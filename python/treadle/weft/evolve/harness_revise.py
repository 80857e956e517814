"""Revision of a blamed harness in the evolution loop (seed: WEFT 5.1: the harness, the prompt and parser between the
policy and the tools, is one of the four interaction components and is repaired where the fault lies).

When attribution blames the harness (rule ``harness_format``, or an LLM attributor's ``harness``), the loop:

1. **finds which harness** is at fault: every harness of the system is checked on the blamed task's reference calls
   (:func:`~treadle.weft.evolve.probes.harness_faults`: its parser does not read back what its own format writes,
   or its instructions teach another format than its parser reads); a harness blame that no harness's check
   confirms (an LLM's unsupported claim) revises nothing and is reported as ``harness:<primary>``;
2. **repairs or quarantines its view**: the harness is replaced by the system's certified (trusted) harness of
   the same name when that one carries every blamed task's reference calls; otherwise it is quarantined (removed
   from the harnesses the tasks are played and cross-checked under), and the next harness becomes the primary
   one. Harness code is trusted code: an LLM never rewrites it;
3. **re-runs the affected trajectories** under the healthy primary harness (the same replay-policy draws as the
   failed attempt, so that only the harness differs); a re-run that passes shows the failure was the harness's
   and is not counted against the policy; one that still fails is attributed again under the healthy harness
   (its verdict, often ``policy``, is what counts).
"""
from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.evolve.attribute import Attribution, Blame

__all__ = ["HarnessRerun", "counted_against_policy", "faulty_harnesses", "harness_digest", "revise_harnesses"]


class HarnessRerun(BaseModel):
    """One harness-blamed task played again under a healthy harness: its verdict ``r`` and, when it still fails,
    its attribution under that harness."""

    model_config = ConfigDict(extra="forbid")
    task: str
    checkpoint: str
    harness: str
    r: int = Field(ge=0, le=1)
    attribution: Attribution | None = None


def harness_digest(harness: Any) -> str:
    """A digest of a harness's implementation (its class, by module and qualified name): a repaired or replaced
    harness changes it."""
    cls = type(harness)
    return hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}".encode()).hexdigest()[:16]


def faulty_harnesses(harnesses: dict[str, Any], calls: Sequence[Any], tools: Sequence[dict]) -> dict[str, list[str]]:
    """``{name: why}`` of the harnesses that cannot carry ``calls`` (:func:`~treadle.weft.evolve.probes.
    harness_faults`)."""
    from treadle.weft.evolve.probes import harness_faults

    out = {}
    for name, h in harnesses.items():
        why = harness_faults(h, list(calls), list(tools))
        if why:
            out[name] = why
    return out


async def revise_harnesses(rt: Any, system: Any, blamed: Sequence[tuple[Any, Attribution, int]],
                           hashes: dict[str, str], rnd: Any, *, replay: Callable[[Any, int, Any], list[Any]],
                           attribute: Callable[..., Awaitable[Attribution]]) -> None:
    """Act on the harness-blamed slots ``blamed`` (``(slot, attribution, attempt index)``) of one round ``rnd`` of
    ``system`` (see the module docstring): ``rnd.blamed`` gets ``harness:<name>`` per faulty harness,
    ``rnd.quarantined`` the harnesses removed, ``rnd.harness_reruns`` the re-runs. ``replay(slot, attempt,
    harness)`` gives the policy's calls of that attempt through ``harness``; ``attribute(rt, slot, server_hash,
    outcomes, verdict, harness=...)`` attributes a re-run that still fails (the loop's own functions)."""
    from treadle.weft.evolve.certify import play

    if not blamed:
        return
    faulty: dict[str, list[str]] = {}
    checks: list[tuple[list[Any], list[dict]]] = []
    for slot, _, _ in blamed:
        gold, tools = list(slot.evidence.calls), rt.registry.spec(hashes[slot.env]).tools
        checks.append((gold, tools))
        for name, why in faulty_harnesses(system.harnesses, gold, tools).items():
            faulty.setdefault(name, why)
    if not faulty:  # no harness's own check confirms the blame: reported, nothing revised
        rnd.blamed.append(f"harness:{next(iter(system.harnesses), 'none')}")
        return
    for name, why in faulty.items():
        rnd.blamed.append(f"harness:{name}")
        healthy = system.certified_harnesses.get(name)
        if healthy is not None and harness_digest(healthy) != harness_digest(system.harnesses[name]) and not any(
                faulty_harnesses({name: healthy}, gold, tools) for gold, tools in checks):
            system.harnesses[name] = healthy
        else:
            del system.harnesses[name]
            rnd.quarantined[name] = "; ".join(why)[:500]
    if not system.harnesses:
        return
    primary_name, primary = next(iter(system.harnesses.items()))
    for slot, _, attempt in blamed:
        outs, verdict = await play(rt, hashes[slot.env], slot.start, slot.spec, replay(slot, attempt, primary))
        att = None
        if verdict.r != 1:
            att = await attribute(rt, slot, hashes[slot.env], outs, verdict, harness=primary)
        rnd.harness_reruns.append(HarnessRerun(task=slot.task.name, checkpoint=slot.spec.name, harness=primary_name, r=int(verdict.r == 1),
                                               attribution=att))


def counted_against_policy(attributions: Sequence[Attribution], reruns: Sequence[HarnessRerun]) -> list[str]:
    """The checkpoints whose failure is the policy's after the harness re-runs: blamed on the policy, or blamed on
    the harness and still failing under a healthy one with a policy verdict."""
    again = {r.checkpoint: r for r in reruns}
    out = []
    for a in attributions:
        if a.blame == Blame.policy:
            out.append(a.checkpoint)
        elif a.blame == Blame.harness and a.checkpoint in again:
            r = again[a.checkpoint]
            if r.attribution is not None and r.attribution.blame == Blame.policy:
                out.append(a.checkpoint)
    return sorted(out)

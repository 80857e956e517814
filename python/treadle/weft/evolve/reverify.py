"""Re-score stored rollouts with a revised verifier, without new rollouts (seed: WEFT 5.1, evaluator revision).

An evaluator fix should be cheap: the tool calls a rollout made are in its run folder
(``trajectories.jsonl``), and the environment is deterministic, so replaying those calls from the
task's initial snapshot reproduces every turn's state; the revised checkpoint is then judged on it.
No policy is called. Scores carry the verifier version, so scores of different versions never mix.

A :class:`VerifierRevision` is a JSON file::

    {"version": "v2", "checkpoints": {"ada-3-close-ticket": {"forbidden_tools": []}}}

naming, per checkpoint, the :class:`~treadle.weft.runtime.verify.CheckpointSpec` fields to replace (gold
calls as call strings, assertions as ``{sql, expected, description}``).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treadle.weft.runtime.callparse import parse_call
from treadle.weft.rollouts.records import TurnAttempt, Trajectory
from treadle.weft.rollouts.tasks import RolloutTask
from treadle.weft.runtime.verify import CheckpointSpec

_REVISABLE = {"gold_calls", "compare_state", "ignore_tables", "gold_results_contained", "assertions",
              "expected_returns", "forbidden_tools", "strict_interface", "compare_private",
              "calls_allowed_without_gold"}


class VerifierRevision(BaseModel):
    """A revised verifier: a version tag and per-checkpoint field replacements."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str = Field(min_length=1)
    checkpoints: dict[str, dict[str, Any]]

    def apply(self, spec: CheckpointSpec) -> CheckpointSpec:
        """``spec`` with this revision's replacements (unchanged when the revision does not name it)."""
        change = dict(self.checkpoints.get(spec.name, {}))
        if "gold_calls" in change and change["gold_calls"] is not None:
            change["gold_calls"] = [parse_call(c) for c in change["gold_calls"]]
        return CheckpointSpec.model_validate({**spec.model_dump(exclude={"predicates"}),
                                              "predicates": spec.predicates, **change})


def load_revision(path: str | Path, known: Sequence[str]) -> VerifierRevision:
    """Read and check a revision file against the ``known`` checkpoint names.

    Raises:
        ValueError: unreadable, not JSON, wrong shape, an unknown checkpoint or field, or a replacement that
            does not make a valid CheckpointSpec (the message says which).
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{p}: not a readable JSON file ({err})") from None
    try:
        rev = VerifierRevision.model_validate(doc)
    except ValidationError as err:
        raise ValueError(f"{p}: expected {{version, checkpoints: {{name: {{field: value}}}}}}: "
                         f"{err.errors()[0]['loc']}: {err.errors()[0]['msg']}") from None
    for name, change in rev.checkpoints.items():
        if name not in known:
            raise ValueError(f"{p}: unknown checkpoint {name!r}; expected one of {sorted(known)}")
        bad = sorted(set(change) - _REVISABLE)
        if bad:
            raise ValueError(f"{p}: checkpoint {name!r}: fields {bad} cannot be revised; expected some of "
                             f"{sorted(_REVISABLE)}")
        try:
            rev.apply(CheckpointSpec(name=name))
        except (ValidationError, ValueError) as err:
            raise ValueError(f"{p}: checkpoint {name!r}: {str(err).splitlines()[0]}") from None
    return rev


class Rescore(BaseModel):
    """A stored trajectory scored by the verifier it was sampled with and by the revised one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    task: str
    verifier_version: str
    old_rewards: tuple[int, ...]
    new_rewards: tuple[int, ...]
    old_reward: float
    new_reward: float
    replayed_calls: int

    @property
    def changed(self) -> bool:
        return self.old_rewards != self.new_rewards


def _task_name(name: str) -> str:
    return name.split("#", 1)[0]  # replicas are ``name#i``


async def _replay(rt: Any, sid: str, attempt: TurnAttempt) -> list[Any]:
    outs = []
    for step in attempt.steps:
        for c in step.calls:
            if c.name != "<unparsed>":
                outs.append(await rt.call_tool(sid, c.name, c.arguments))
    return outs


async def rescore(rt: Any, server_hash: str, snapshot: Any, traj: Trajectory, task: RolloutTask,
                  rev: VerifierRevision) -> Rescore:
    """Replay ``traj``'s recorded calls turn by turn from ``snapshot`` and judge each turn with the revised
    checkpoint. A turn on the accepted path is replayed in the path's session; for the turn where the
    rollout stopped, each recorded attempt is replayed in a fork of that turn's start and the best verdict
    counts; turns never reached score 0."""
    order = task.ordered()
    chosen = {traj.attempts[i].atomic: traj.attempts[i] for i in traj.selected}
    rewards: list[int] = []
    calls = 0
    sid = await rt.create_session(server_hash, snapshot)
    try:
        for atomic in order:
            spec = rev.apply(atomic.checkpoint)
            start = rt.snapshot(sid)
            if atomic.name in chosen:
                outs = await _replay(rt, sid, chosen[atomic.name])
                calls += len(outs)
                rewards.append((await rt.verify_turn(sid, start, spec, outs)).r)
                continue
            tried = [a for a in traj.attempts if a.atomic == atomic.name]
            best = 0
            for a in tried:
                fork = await rt.fork(sid)
                try:
                    outs = await _replay(rt, fork, a)
                    calls += len(outs)
                    best = max(best, (await rt.verify_turn(fork, start, spec, outs)).r)
                finally:
                    await rt.close(fork)
            rewards.append(best)
            break
    finally:
        await rt.close(sid)
    rewards += [0] * (len(order) - len(rewards))
    old = list(traj.rewards) + [0] * (len(order) - len(traj.rewards))
    n = len(order) or 1
    return Rescore(key=traj.key, task=traj.task, verifier_version=rev.version, old_rewards=tuple(old),
                   new_rewards=tuple(rewards), old_reward=sum(old) / n, new_reward=sum(rewards) / n,
                   replayed_calls=calls)


async def reverify(trajectories: Sequence[Trajectory], tasks: Sequence[RolloutTask], rev: VerifierRevision,
                   envs: dict[str, Any]) -> list[Rescore]:
    """Re-score every trajectory whose task is in ``tasks`` (by name; replicas ``name#i`` included).

    Args:
        envs: ``{env name: async (rt) -> rollouts Env}`` (:data:`treadle.weft.rollouts.batch.ENVS`).

    Trajectories of unknown tasks or environments, and failed ones (``failure`` set), are skipped.
    """
    from treadle.weft.runtime import Runtime

    by = {t.name: t for t in tasks}
    out: list[Rescore] = []
    async with Runtime() as rt:
        built: dict[str, Any] = {}
        for tr in trajectories:
            task = by.get(_task_name(tr.task))
            if task is None or tr.failure or tr.env not in envs:
                continue
            if tr.env not in built:
                built[tr.env] = await envs[tr.env](rt)
            env = built[tr.env]
            out.append(await rescore(rt, env.server_hash, env.snapshot, tr, task, rev))
    return out

"""Atomic-turn episodes: run a policy turn by turn in a session and judge each turn's checkpoint.

Seed: WEFT 4.1 (atomic tasks; atomic-turn GRPO samples candidate turns from one state and scores
each with its own binary check). Each turn starts from the session's current state; its checkpoint
is judged against the gold calls replayed from that same start state, so a mistake in turn k fails
checkpoint k only. ``R(tau) = mean_k r_k``. With a checkpoint store, each turn boundary is
checkpointed before the next turn starts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime import Runtime, ToolOutcome
from treadle.weft.runtime.verify import CheckpointResult, CheckpointSpec, trajectory_reward

Policy = Callable[[int, list[list[ToolOutcome]]], Sequence[str | ToolCall]]


class EpisodeResult(BaseModel):
    """Per-turn outcomes and checkpoint verdicts of one episode, and ``R = mean_k r_k``."""

    session_id: str
    outcomes: list[list[ToolOutcome]]
    results: list[CheckpointResult]
    reward: float


async def run_atomic_episode(rt: Runtime, session_id: str, checkpoints: Sequence[CheckpointSpec],
                             policy: Policy, *, start_turn: int = 0) -> EpisodeResult:
    """Run ``policy`` for each checkpoint (turn) of a session and judge it.

    Args:
        rt: an open runtime.
        session_id: an in-process session.
        checkpoints: one :class:`CheckpointSpec` per turn.
        policy: ``policy(turn_index, outcomes_so_far) -> calls`` (call strings or ToolCalls) for that turn.
        start_turn: first turn to run (resuming an interrupted rollout after
            :meth:`Runtime.restore_session`: ``rt.checkpoint_turn(sid) + 1``); earlier turns are not
            rerun and not scored (``outcomes``/``results`` hold only the turns run here).

    Raises:
        ValueError: ``start_turn`` out of range.
        TypeError: ``checkpoints`` holds something else than CheckpointSpec, or ``policy`` is not callable.
    """
    if not callable(policy):
        raise TypeError(f"policy must be callable, got {type(policy).__name__}")
    for i, c in enumerate(checkpoints):
        if not isinstance(c, CheckpointSpec):
            raise TypeError(f"checkpoints[{i}] must be a CheckpointSpec, got {type(c).__name__}")
    if not isinstance(start_turn, int) or not 0 <= start_turn <= len(checkpoints):
        raise ValueError(f"start_turn must be an int in [0, {len(checkpoints)}], got {start_turn!r}")
    history: list[list[ToolOutcome]] = []
    results: list[CheckpointResult] = []
    for k, spec in enumerate(checkpoints):
        if k < start_turn:
            continue
        start = rt.snapshot(session_id)
        turn = [await rt.call(session_id, c) for c in policy(k, history)]
        history.append(turn)
        results.append(await rt.verify_turn(session_id, start, spec, turn))
        if rt.store is not None:
            await rt.checkpoint(session_id, turn=k)
    return EpisodeResult(session_id=session_id, outcomes=history, results=results, reward=trajectory_reward(results))

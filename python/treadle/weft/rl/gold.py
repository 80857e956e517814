"""Gold turns played through the runtime: real tool outputs and every turn's start state.

:func:`play_gold` runs an :class:`~treadle.weft.rl.worlds.Episode`'s gold calls in a session of the
shop server, one assistant step per call (rendered by the harness), then a closing reply, and
returns the whole conversation plus one :class:`TurnStart` per atomic turn: the messages before the
turn (the user's request included) and the state snapshot at the turn start. Every gold turn is
verified by the runtime; a gold turn that fails its own checkpoint raises :class:`GoldError`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.weft.rl.worlds import Episode
from treadle.weft.rollouts.harnesses import Harness
from treadle.weft.rollouts.records import ParsedCall
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime.state import Snapshot

__all__ = ["GoldError", "NoAtomicTurnsError", "TurnStart", "GoldEpisode", "play_gold", "REPLY", "tool_text"]

REPLY = "Done."
"""The closing reply of every gold turn (a reply without a call ends the turn in the Hermes harness)."""


class NoAtomicTurnsError(ValueError):
    """A task has no atomic turns: there is nothing to group."""


class GoldError(RuntimeError):
    """A gold turn failed its own checkpoint (a task defect, never a policy failure)."""


@dataclass(frozen=True)
class TurnStart:
    """Where an atomic turn starts: the episode, the turn index, the atomic task, the messages the
    policy sees (history + this turn's user request) and the environment state (a snapshot)."""

    episode: Episode
    turn: int
    atomic: AtomicTask
    messages: tuple[dict[str, Any], ...]
    snapshot: Snapshot


@dataclass(frozen=True)
class GoldEpisode:
    """An episode played with its gold calls: the SFT conversation and each turn's start."""

    episode: Episode
    messages: tuple[dict[str, Any], ...]
    starts: tuple[TurnStart, ...]


def tool_text(outcome) -> str:
    """What the model sees of a tool outcome (as :func:`treadle.weft.rollouts.rollout.run_turn` shows it)."""
    return outcome.text if outcome.ok else f"Error ({outcome.error_kind.value}): {outcome.text}"


async def play_gold(rt, server_hash: str, episode: Episode, harness: Harness, *, verify: bool = True) -> GoldEpisode:
    """Play ``episode``'s gold calls in a fresh session of ``server_hash`` (see the module docstring).

    ``verify=False`` skips the runtime's checkpoint (it replays the gold twice: most of the time) when
    only the SFT conversation is needed; the tests verify every template's gold.

    Raises:
        NoAtomicTurnsError: the task has no atomic turns (before any session is created).
        GoldError: a gold turn did not pass its checkpoint.
    """

    if not episode.task.atomic:
        raise NoAtomicTurnsError(f"task {episode.task.name!r} has no atomic turns: nothing to sample or group")
    msgs: list[dict[str, Any]] = []
    starts: list[TurnStart] = []
    sid = await rt.create_session(server_hash, episode.snapshot())
    try:
        for t, atomic in enumerate(episode.task.ordered()):
            start = rt.snapshot(sid)
            msgs.append({"role": "user", "content": atomic.request})
            starts.append(TurnStart(episode, t, atomic, tuple(msgs), start))
            outcomes = []
            for i, call in enumerate(atomic.checkpoint.gold_calls or []):
                msgs.append(harness.assistant_message(harness.render([call])))
                o = await rt.call_tool(sid, call.name, call.arguments)
                outcomes.append(o)
                msgs.extend(harness.tool_messages([ParsedCall(id=f"call_{i}", name=call.name,
                                                              arguments=call.arguments)], [tool_text(o)]))
            msgs.append(harness.assistant_message(harness.render([], REPLY)))
            if not verify:
                continue
            verdict = await rt.verify_turn(sid, start, atomic.checkpoint, outcomes)
            if verdict.r != 1:
                raise GoldError(f"episode {episode.task.name!r} turn {t} ({atomic.name}): the gold calls fail their "
                                f"own checkpoint: {verdict.details}")
    finally:
        await rt.close(sid)
    return GoldEpisode(episode, tuple(msgs), tuple(starts))


async def shop_server(rt) -> str:
    """Register the shop server in ``rt``; its hash."""
    from treadle.weft.envs import shop

    return rt.register(shop)

"""Multi-problem sessions: several independent problems asked one after another in one
conversation (STAIR sec. 3.4: each earlier assistant response feeds the bank read by later turns).
"""
from __future__ import annotations

from dataclasses import dataclass

from treadle.data.arithmetic import Difficulty, Problem, ProblemGenerator, difficulty

__all__ = ["Session", "make_sessions"]


@dataclass(frozen=True)
class Session:
    """An immutable conversation of independent problems.

    Attributes:
        problems: the problems in turn order (a tuple; Problem is frozen).
    """

    problems: tuple[Problem, ...]

    def messages(self, *, answered: int | None = None) -> list[dict]:
        """Chat messages (a fresh list): for each turn a user message and, for the first
        ``answered`` turns (default: all), the gold assistant answer. ``answered=len-1`` gives a
        prompt whose last user turn is open (for generation).

        Raises:
            ValueError: ``answered`` outside ``[0, len(problems)]``.
        """
        n = len(self.problems)
        k = n if answered is None else answered
        if not isinstance(k, int) or not 0 <= k <= n:
            raise ValueError(f"answered must be an int in [0, {n}], got {answered!r}")
        out: list[dict] = []
        for i, p in enumerate(self.problems):
            out.append({"role": "user", "content": p.prompt})
            if i < k:
                out.append({"role": "assistant", "content": p.answer})
        return out


def make_sessions(n_sessions: int, turns: int, level: int | Difficulty | list[int | Difficulty], *,
                  seed: int = 0, split: str = "any") -> list[Session]:
    """``n_sessions`` sessions of ``turns`` independent problems each.

    Args:
        level: one level for every turn, or a list of ``turns`` levels (turn i gets ``level[i]``).
        split: as in :meth:`ProblemGenerator.problem`.

    Raises:
        ValueError: ``n_sessions < 0``, ``turns < 1``, a level out of range, a level list of the
            wrong length.
    """
    if not isinstance(n_sessions, int) or n_sessions < 0:
        raise ValueError(f"n_sessions must be a non-negative int, got {n_sessions!r}")
    if not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns must be an int >= 1, got {turns!r}")
    levels = list(level) if isinstance(level, (list, tuple)) else [level] * turns
    if len(levels) != turns:
        raise ValueError(f"level list must have one entry per turn ({turns}), got {len(levels)}")
    for lv in levels:
        difficulty(lv)
    gen = ProblemGenerator(seed)
    return [Session(tuple(gen.problem(lv, split=split) for lv in levels)) for _ in range(n_sessions)]

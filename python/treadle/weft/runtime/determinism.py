"""A deterministic clock and random source per session, carried by snapshots.

Issue: a tool that stores ``time.time()`` or a random id makes the gold replay of a turn differ from
the agent's run even when the agent made exactly the gold calls. Every session therefore owns a
:class:`SessionEnv`: a clock that advances one ``clock_step`` (seconds) per reading from
``clock_start`` (Unix seconds), and a counter-based random source (splitmix64 of ``(seed, draw)``),
so its whole state is five numbers (:class:`EnvState`). Snapshots carry that state
(:attr:`treadle.weft.runtime.state.Snapshot.env`): fork copies it, reset and restore bring it back, a
checkpoint stores it. The gold replay of a turn starts from the turn's start snapshot, so the same
calls read the same times and draws as the agent's session did.

Tools read them during a call (inside a call, the runtime binds the calling session's env)::

    from treadle.weft.runtime.determinism import session_random, session_time, session_uuid

    @server.tool(writes=("notes",))
    def add_note(db, text: str) -> dict:
        db.execute("INSERT INTO notes (text, created) VALUES (?, ?)", (text, session_time()))

Tools that read the process clock or the global ``random`` module directly stay non-deterministic;
:meth:`treadle.weft.runtime.Runtime.verify_turn` replays the gold twice and, when the two replays
differ, attributes a failed check to the environment (``nondeterministic_environment``), never to the
policy.
"""
from __future__ import annotations

import random
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from treadle.weft.runtime.errors import WeftError

_MASK64 = (1 << 64) - 1
DEFAULT_CLOCK_START = 1_767_225_600.0
"""2026-01-01T00:00:00Z in Unix seconds: the session clock's default first reading."""


@dataclass(frozen=True)
class EnvState:
    """Immutable state of a session's clock and random source (what a snapshot carries).

    Attributes:
        seed: random-source seed (int, taken modulo 2**64).
        draws: 64-bit words drawn so far.
        ticks: clock readings so far.
        clock_start: first clock reading, Unix seconds.
        clock_step: seconds the clock advances per reading (> 0).
    """

    seed: int = 0
    draws: int = 0
    ticks: int = 0
    clock_start: float = DEFAULT_CLOCK_START
    clock_step: float = 1.0

    def __post_init__(self) -> None:
        for name in ("seed", "draws", "ticks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or (name != "seed" and v < 0):
                raise ValueError(f"EnvState.{name} must be an int{' >= 0' if name != 'seed' else ''}, got {v!r}")
        if not isinstance(self.clock_step, (int, float)) or not self.clock_step > 0:
            raise ValueError(f"EnvState.clock_step must be > 0 seconds, got {self.clock_step!r}")
        if not isinstance(self.clock_start, (int, float)):
            raise ValueError(f"EnvState.clock_start must be Unix seconds (float), got {self.clock_start!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "draws": self.draws, "ticks": self.ticks, "clock_start": self.clock_start,
                "clock_step": self.clock_step}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SessionRandom(random.Random):
    """``random.Random`` whose draws come from the owning :class:`SessionEnv` (counter-based, so its
    state is ``(seed, draws)``); every method of ``random.Random`` (``randint``, ``choice``, ``shuffle``,
    ``uniform``, ``gauss``...) works through :meth:`random` and :meth:`getrandbits`."""

    def __init__(self, env: SessionEnv):
        self._env = env
        self._ready = False
        super().__init__(0)
        self._ready = True

    def seed(self, a: Any = None, version: int = 2) -> None:  # the env's seed is the only seed
        if getattr(self, "_ready", False):
            raise WeftError("a session's random source is seeded by its snapshot (Snapshot.with_env(seed=...))")
        super().seed(0)

    def _word(self) -> int:
        env = self._env
        w = _splitmix64(((env.seed & _MASK64) * 0x100000001B3 + env.draws) & _MASK64)
        env.draws += 1
        return w

    def random(self) -> float:
        return (self._word() >> 11) * (1.0 / (1 << 53))

    def getrandbits(self, k: int) -> int:
        if k < 0:
            raise ValueError("number of bits must be non-negative")
        out, have = 0, 0
        while have < k:
            out = (out << 64) | self._word()
            have += 64
        return out >> (have - k)

    def getstate(self) -> Any:
        return self._env.freeze()

    def setstate(self, state: Any) -> None:
        raise WeftError("restore a session's random source through its snapshot, not setstate()")


class SessionEnv:
    """The live clock and random source of one session (mutable; see :class:`EnvState`)."""

    def __init__(self, state: EnvState | None = None):
        self.load(state or EnvState())
        self.random = SessionRandom(self)

    def load(self, state: EnvState) -> None:
        """Set the clock and random source to ``state`` (in place)."""
        if not isinstance(state, EnvState):
            raise TypeError(f"state must be an EnvState, got {type(state).__name__}")
        self.seed, self.draws, self.ticks = state.seed, state.draws, state.ticks
        self.clock_start, self.clock_step = float(state.clock_start), float(state.clock_step)

    def freeze(self) -> EnvState:
        return EnvState(self.seed, self.draws, self.ticks, self.clock_start, self.clock_step)

    def copy(self) -> SessionEnv:
        return SessionEnv(self.freeze())

    def now(self) -> float:
        """The next clock reading (Unix seconds); the clock advances ``clock_step`` per reading."""
        t = self.clock_start + self.ticks * self.clock_step
        self.ticks += 1
        return t


_CURRENT: ContextVar[SessionEnv | None] = ContextVar("treadle_weft_session_env", default=None)


def current_env() -> SessionEnv:
    """The calling session's env (inside a tool call).

    Raises:
        WeftError: called outside a tool call served by the WEFT runtime.
    """
    env = _CURRENT.get()
    if env is None:
        raise WeftError("session_time()/session_random() are only available inside a WEFT tool call")
    return env


def bound_env() -> SessionEnv | None:
    """The session env bound to the running tool call, or None outside one (never raises)."""
    return _CURRENT.get()


def bind_env(env: SessionEnv | None) -> Any:
    """Make ``env`` the current session env (returns the token for :func:`unbind_env`); runtime-internal."""
    return _CURRENT.set(env)


def unbind_env(token: Any) -> None:
    _CURRENT.reset(token)


def session_time() -> float:
    """The session clock's next reading, Unix seconds (deterministic; carried by snapshots)."""
    return current_env().now()


def session_random() -> random.Random:
    """The session's random source (a ``random.Random``; deterministic; carried by snapshots)."""
    return current_env().random


def session_uuid() -> uuid.UUID:
    """A version-4 UUID drawn from the session's random source."""
    return uuid.UUID(int=session_random().getrandbits(128), version=4)

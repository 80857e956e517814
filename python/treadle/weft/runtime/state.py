"""Common interface of session state backends, immutable snapshots and state diffs.

A session owns a private, mutable *state* cloned from an immutable :class:`Snapshot` (seed: WEFT
section 4.1, MegaMCP "session-private database cloned copy-on-write from an immutable initial
snapshot"). Two backends implement :class:`StateBackend`:

- :class:`treadle.weft.runtime.sqlite_state.SqliteState` (embedded default): the handle tools receive is a
  ``sqlite3.Connection`` to a private in-memory database; clone = ``Connection.deserialize`` of the
  snapshot bytes.
- :class:`treadle.weft.runtime.object_state.ObjectState`: the handle is a Python object (environments
  written as classes); clone = ``copy.deepcopy`` of its attribute dict.

Every state can be snapshotted (bytes, byte-identical after reset), forked (independent copy of the
*current* state, for sampling several candidates from one state) and diffed (per table: rows or
attributes added, changed, removed).
"""
from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from treadle.weft.runtime.determinism import EnvState, SessionEnv

BackendKind = Literal["sqlite", "object"]


@dataclass(frozen=True)
class Snapshot:
    """An immutable state image.

    Attributes:
        env: the session's deterministic clock and random source at that moment
            (:mod:`treadle.weft.runtime.determinism`); fork, reset and restore bring it back with the data.
        kind: ``"sqlite"`` (``data`` = SQLite database image from ``Connection.serialize()``) or
            ``"object"`` (``data`` = pickle protocol 5 of the state object's attribute dict).
        data: the bytes; never mutated. ``digest`` is its SHA-256 hex.
    """

    kind: BackendKind
    data: bytes = field(repr=False)
    env: EnvState = field(default_factory=EnvState)

    def __post_init__(self) -> None:
        if self.kind not in ("sqlite", "object"):
            raise ValueError(f"Snapshot.kind must be 'sqlite' or 'object', got {self.kind!r}")
        if not isinstance(self.data, bytes):
            raise TypeError(f"Snapshot.data must be bytes, got {type(self.data).__name__}")
        if self.env is None:
            object.__setattr__(self, "env", EnvState())
        if not isinstance(self.env, EnvState):
            raise TypeError(f"Snapshot.env must be a treadle.weft.runtime.determinism.EnvState, got {type(self.env).__name__}")

    def with_env(self, **changes: Any) -> Snapshot:
        """The same state image with the session clock / random source changed (fields of
        :class:`~treadle.weft.runtime.determinism.EnvState`, e.g. ``seed=3``)."""
        return Snapshot(self.kind, self.data, dataclasses.replace(self.env, **changes))

    @property
    def digest(self) -> str:
        """SHA-256 hex digest of ``data`` (identity of the state image)."""
        return hashlib.sha256(self.data).hexdigest()

    @property
    def nbytes(self) -> int:
        return len(self.data)


class RowChange(BaseModel):
    """One row (or attribute) present in both states with different values."""

    before: Any
    after: Any


class TableDiff(BaseModel):
    """Differences within one table (SQLite) or one attribute namespace (object state).

    Keys are strings: the JSON of the primary-key tuple for SQLite rows, the dotted attribute path
    for object state.
    """

    added: dict[str, Any] = Field(default_factory=dict)
    removed: dict[str, Any] = Field(default_factory=dict)
    changed: dict[str, RowChange] = Field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


class StateDiff(BaseModel):
    """Differences ``base -> other`` per table; tables without differences are omitted."""

    tables: dict[str, TableDiff] = Field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return all(t.empty for t in self.tables.values())

    def touched(self) -> set[str]:
        """Names of the tables (namespaces) with at least one difference."""
        return {name for name, t in self.tables.items() if not t.empty}

    def counts(self) -> dict[str, dict[str, int]]:
        """``{table: {"added": n, "changed": n, "removed": n}}`` for a compact summary."""
        return {name: {"added": len(t.added), "changed": len(t.changed), "removed": len(t.removed)}
                for name, t in self.tables.items() if not t.empty}


class StateBackend(ABC):
    """A session's private mutable state.

    ``handle`` is what tool functions receive as their first argument. Implementations must make
    ``clone`` independent of the original (no shared mutable parts) and ``snapshot().data`` after
    ``restore(s)`` byte-identical to ``s.data``.
    """

    kind: BackendKind
    env: SessionEnv  # the session's clock and random source; snapshot/restore/fork carry it

    @property
    @abstractmethod
    def handle(self) -> Any:
        """The object tool functions operate on (``sqlite3.Connection`` or the state object)."""

    @abstractmethod
    def snapshot(self) -> Snapshot:
        """An immutable image of the current state."""

    @abstractmethod
    def restore(self, snapshot: Snapshot) -> None:
        """Replace the current state by ``snapshot`` in place (the handle stays valid).

        Raises:
            ValueError: ``snapshot.kind`` differs from this backend's kind.
        """

    @abstractmethod
    def fork(self) -> StateBackend:
        """An independent copy of the *current* state."""

    @abstractmethod
    def diff(self, other: StateBackend | Snapshot) -> StateDiff:
        """Differences from this state (base) to ``other``."""

    def close(self) -> None:
        """Release resources; the state must not be used afterwards."""

    def digest(self) -> str:
        return self.snapshot().digest

    def _check_kind(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a treadle.weft.runtime.state.Snapshot, got {type(snapshot).__name__}")
        if snapshot.kind != self.kind:
            raise ValueError(f"snapshot is a {snapshot.kind!r} snapshot but this state backend is {self.kind!r}")

"""SQLite session state: a private in-memory database per session (the embedded default backend).

Clone = ``sqlite3.Connection.deserialize`` of the immutable snapshot bytes into a fresh in-memory
connection (one memcpy of the image; a 1 MB snapshot clones in well under a millisecond). Reset
deserializes the same bytes again, so ``serialize()`` after reset is byte-identical to the snapshot.
Diffs compare rows by primary key (``rowid`` for tables without one). Seed: WEFT section 4.1
(MegaMCP: "session-private database cloned copy-on-write from an immutable initial snapshot").
"""
from __future__ import annotations

import json
import sqlite3
from typing import Any

from treadle.weft.runtime.determinism import SessionEnv
from treadle.weft.runtime.errors import SnapshotSchemaError
from treadle.weft.runtime.state import RowChange, Snapshot, StateBackend, StateDiff, TableDiff

Column = tuple[str, str, bool, int]  # (name, declared type upper-case, notnull, pk position)


def _connect() -> sqlite3.Connection:
    # check_same_thread=False: the mcp SDK runs sync tools on worker threads; the runtime
    # serialises calls per session, so one connection is never used by two threads at once.
    return sqlite3.connect(":memory:", check_same_thread=False)


def snapshot_from_sql(ddl: str, *scripts: str) -> Snapshot:
    """Build a SQLite :class:`Snapshot` by running ``ddl`` then each seed script.

    Args:
        ddl: ``CREATE TABLE ...`` statements (the server's schema).
        scripts: SQL scripts (e.g. ``INSERT``s) run in order after the DDL.

    Raises:
        TypeError: an argument is not a string.
        sqlite3.Error: a script fails (the message names the statement's problem).
    """
    for i, s in enumerate((ddl, *scripts)):
        if not isinstance(s, str):
            raise TypeError(f"SQL script #{i} must be a str, got {type(s).__name__}")
    con = _connect()
    try:
        con.executescript(ddl)
        for s in scripts:
            con.executescript(s)
        con.commit()
        return Snapshot("sqlite", con.serialize())
    finally:
        con.close()


def snapshot_from_connection(con: sqlite3.Connection) -> Snapshot:
    """Snapshot of an existing connection's main database (commits nothing; reads committed pages)."""
    if not isinstance(con, sqlite3.Connection):
        raise TypeError(f"con must be a sqlite3.Connection, got {type(con).__name__}")
    return Snapshot("sqlite", con.serialize())


def tables(con: sqlite3.Connection) -> list[str]:
    """User tables of ``con``, sorted by name."""
    rows = con.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' "
                       "ORDER BY name").fetchall()
    return [r[0] for r in rows]


def schema_of(con: sqlite3.Connection) -> dict[str, list[Column]]:
    """``{table: [(column, TYPE, notnull, pk_position), ...]}`` in declaration order."""
    out: dict[str, list[Column]] = {}
    for t in tables(con):
        info = con.execute(f'PRAGMA table_info("{t}")').fetchall()
        out[t] = [(r[1], (r[2] or "").upper(), bool(r[3]), int(r[5])) for r in info]
    return out


def schema_of_ddl(ddl: str) -> dict[str, list[Column]]:
    """Schema (as :func:`schema_of`) that ``ddl`` creates in an empty database."""
    con = _connect()
    try:
        con.executescript(ddl)
        return schema_of(con)
    finally:
        con.close()


def check_schema(snapshot: Snapshot, ddl: str) -> None:
    """Check that ``snapshot`` is a SQLite image whose tables and columns match ``ddl``.

    Raises:
        TypeError: ``snapshot`` is not a :class:`Snapshot`.
        SnapshotSchemaError: not a SQLite image, or tables/columns differ (each difference listed).
    """
    if not isinstance(snapshot, Snapshot):
        raise TypeError(f"snapshot must be a treadle.weft.runtime.state.Snapshot, got {type(snapshot).__name__}")
    if snapshot.kind != "sqlite":
        raise SnapshotSchemaError(f"expected a 'sqlite' snapshot, got kind {snapshot.kind!r}")
    want = schema_of_ddl(ddl)
    con = _connect()
    try:
        try:
            con.deserialize(snapshot.data)
            have = schema_of(con)
        except sqlite3.DatabaseError as err:
            raise SnapshotSchemaError(f"snapshot is not a SQLite database image ({len(snapshot.data)} bytes): "
                                      f"{err}") from err
    finally:
        con.close()
    problems = []
    for t in sorted(set(want) - set(have)):
        problems.append(f"missing table {t!r}")
    for t in sorted(set(have) - set(want)):
        problems.append(f"unexpected table {t!r}")
    for t in sorted(set(want) & set(have)):
        if want[t] != have[t]:
            problems.append(f"table {t!r}: columns {have[t]} != expected {want[t]}")
    if problems:
        raise SnapshotSchemaError("snapshot does not match the server's schema: " + "; ".join(problems))


def _key_columns(con: sqlite3.Connection, table: str) -> list[str]:
    info = con.execute(f'PRAGMA table_info("{table}")').fetchall()
    pk = sorted((r[5], r[1]) for r in info if r[5] > 0)
    return [name for _, name in pk]


def _rows(con: sqlite3.Connection, table: str) -> dict[str, dict[str, Any]]:
    keys = _key_columns(con, table)
    if keys:
        cur = con.execute(f'SELECT * FROM "{table}"')
        cols = [d[0] for d in cur.description]
        idx = [cols.index(k) for k in keys]
        return {json.dumps([r[i] for i in idx], default=repr): dict(zip(cols, r)) for r in cur}
    cur = con.execute(f'SELECT rowid AS "__rowid__", * FROM "{table}"')
    cols = [d[0] for d in cur.description]
    return {json.dumps([r[0]]): dict(zip(cols[1:], r[1:])) for r in cur}


def diff_connections(base: sqlite3.Connection, other: sqlite3.Connection) -> StateDiff:
    """Row-level differences ``base -> other`` for every table in either database.

    Rows are matched by primary key (``rowid`` when a table has none); a table only in ``other``
    counts all its rows as added, one only in ``base`` all as removed.
    """
    out = StateDiff()
    base_t, other_t = set(tables(base)), set(tables(other))
    for t in sorted(base_t | other_t):
        a = _rows(base, t) if t in base_t else {}
        b = _rows(other, t) if t in other_t else {}
        td = TableDiff(
            added={k: b[k] for k in b.keys() - a.keys()},
            removed={k: a[k] for k in a.keys() - b.keys()},
            changed={k: RowChange(before=a[k], after=b[k]) for k in a.keys() & b.keys() if a[k] != b[k]},
        )
        if not td.empty:
            out.tables[t] = td
    return out


class SqliteState(StateBackend):
    """A private in-memory SQLite database cloned from a snapshot.

    Tools receive ``handle`` (a ``sqlite3.Connection``). The server wrapper commits after a tool
    returns and rolls back when it raises, so every tool call is atomic.
    """

    kind = "sqlite"

    def __init__(self, snapshot: Snapshot):
        self._check_kind(snapshot)
        self.env = SessionEnv(snapshot.env)
        self._con = _connect()
        try:
            self._con.deserialize(snapshot.data)
            self._con.execute("SELECT count(*) FROM sqlite_master").fetchone()  # deserialize reads lazily
        except sqlite3.DatabaseError as err:
            self._con.close()
            raise SnapshotSchemaError(f"snapshot is not a SQLite database image: {err}") from err

    @property
    def handle(self) -> sqlite3.Connection:
        return self._con

    def snapshot(self) -> Snapshot:
        return Snapshot("sqlite", self._con.serialize(), self.env.freeze())

    def restore(self, snapshot: Snapshot) -> None:
        self._check_kind(snapshot)
        if self._con.in_transaction:
            self._con.rollback()
        self._con.deserialize(snapshot.data)
        self.env.load(snapshot.env)

    def fork(self) -> SqliteState:
        return SqliteState(self.snapshot())

    def diff(self, other: StateBackend | Snapshot) -> StateDiff:
        if isinstance(other, Snapshot):
            tmp = SqliteState(other)
            try:
                return diff_connections(self._con, tmp.handle)
            finally:
                tmp.close()
        if not isinstance(other, SqliteState):
            raise TypeError(f"can only diff a SqliteState against a SqliteState or sqlite Snapshot, got "
                            f"{type(other).__name__}")
        return diff_connections(self._con, other.handle)

    def close(self) -> None:
        self._con.close()

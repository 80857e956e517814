"""Progressive state grounding of a composed task into resettable initial snapshots (seed: WEFT 4.1).

Three rounds over each server's base snapshot, each one checked before the next:

1. **entities**: the bound business objects get rows of their own on every server that stores them
   (copies of the rows the atomic tasks were certified on, under new ids and a new identity);
2. **relational constraints**: the rows that relate to them (orders and their items, cases and their
   notes, tickets) are copied with every reference remapped; then SQLite's ``foreign_key_check`` must
   be empty on each server and every cross-server reference (a CRM ``order_ref``) must name an order
   of the same customer on the server that owns orders;
3. **history and distractors**: older records of the bound customer no task touches, and a look-alike
   customer (same first name, another e-mail) on every server, so that a policy must tell them apart.

The result is one immutable :class:`~treadle.weft.runtime.state.Snapshot` per server: sessions created from
them reset to exactly the grounded state.
"""
from __future__ import annotations

import sqlite3
from typing import Any

from treadle.weft.evolve.entities import EntityMap
from treadle.weft.runtime.sqlite_state import snapshot_from_connection
from treadle.weft.runtime.state import Snapshot


class GroundingError(ValueError):
    """A grounding round broke a constraint (named in the message); nothing is returned."""


def open_copy(snapshot: Snapshot) -> sqlite3.Connection:
    """A private writable connection holding a copy of ``snapshot``."""
    con = sqlite3.connect(":memory:")
    con.deserialize(bytes(snapshot.data))
    return con


def new_id(con: sqlite3.Connection, table: str, column: str) -> Any:
    """The next id of ``table.column``: max + 1 for integers; for text ids like ``C-004``, the same prefix with
    the next zero-padded number."""
    values = [v for (v,) in con.execute(f"SELECT {column} FROM {table}")]
    ints = [v for v in values if isinstance(v, int)]
    if ints or not values:
        return max(ints, default=0) + 1
    best: tuple[str, str] | None = None
    for v in values:
        s = str(v)
        head = s.rstrip("0123456789")  # prefix + trailing digits, linear (a lazy regex is quadratic on digits)
        digits = s[len(head):]
        if not digits or "\n" in head or len(digits) > 18:
            continue
        if best is None or int(digits) > int(best[1]):
            best = (head, digits)
    if best is None:
        raise GroundingError(f"cannot make a new id for {table}.{column} from values like {str(values[:3])[:200]}")
    return f"{best[0]}{int(best[1]) + 1:0{len(best[1])}d}"


def columns_of(con: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})")]


def copy_row(con: sqlite3.Connection, table: str, where: dict[str, Any], overrides: dict[str, Any],
             remap: dict[str, dict[Any, Any]] | None = None) -> int:
    """Copy the rows of ``table`` matching ``where`` with ``overrides`` set and other columns remapped through
    ``remap[column][old] -> new``; returns how many rows were copied. A single ``INTEGER PRIMARY KEY`` not in
    ``overrides`` gets SQLite's next id."""
    cols = columns_of(con, table)
    info = con.execute(f"PRAGMA table_info({table})").fetchall()
    pks = [r for r in info if r[5]]
    if len(pks) == 1 and pks[0][2].upper() == "INTEGER" and pks[0][1] not in overrides:
        overrides = {**overrides, pks[0][1]: None}  # a rowid alias: the copy gets the next id
    cond = " AND ".join(f"{k} = ?" for k in where) or "1"
    rows = con.execute(f"SELECT {', '.join(cols)} FROM {table} WHERE {cond}", tuple(where.values())).fetchall()
    for row in rows:
        vals = []
        for c, v in zip(cols, row):
            if c in overrides:
                v = overrides[c]
            elif remap and c in remap and v in remap[c]:
                v = remap[c][v]
            vals.append(v)
        con.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", vals)
    return len(rows)


def owned_children(con: sqlite3.Connection, emap: EntityMap, table: str) -> list[tuple[str, str]]:
    """Tables (and their referencing column) whose rows belong to a row of ``table``: they reference it by a
    foreign key and are not entity tables themselves (``order_items`` of ``orders``, ``notes`` of ``cases``)."""
    entity_tables = {k.table for k in emap.kinds.values() if k.table}
    out = []
    for (child,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
        if child in entity_tables:
            continue
        for fk in con.execute(f"PRAGMA foreign_key_list({child})"):
            if fk[2] == table:
                out.append((child, fk[3]))
    return out


def check_foreign_keys(con: sqlite3.Connection, server: str) -> None:
    """Raise :class:`GroundingError` when a row references a missing row (``PRAGMA foreign_key_check``)."""
    bad = con.execute("PRAGMA foreign_key_check").fetchall()
    if bad:
        raise GroundingError(f"{server}: {len(bad)} row(s) reference missing rows, e.g. {bad[0]}")


def freeze(con: sqlite3.Connection) -> Snapshot:
    con.commit()
    return snapshot_from_connection(con)

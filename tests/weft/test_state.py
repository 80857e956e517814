"""State backends: clone independence, byte-identical reset, fork + diff, schema check."""
import dataclasses
import pickle

import pytest

from treadle.weft.runtime.errors import SnapshotSchemaError
from treadle.weft.runtime.object_state import ObjectState, check_object_schema, snapshot_from_object
from treadle.weft.runtime.sqlite_state import SqliteState, check_schema, snapshot_from_sql
from treadle.weft.runtime.state import Snapshot

DDL = """
CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT NOT NULL, qty INTEGER NOT NULL);
CREATE TABLE pairs (a INTEGER, b INTEGER, note TEXT, PRIMARY KEY (a, b));
CREATE TABLE log (msg TEXT);
"""
SEED = """
INSERT INTO items VALUES (1, 'apple', 3), (2, 'pear', 0);
INSERT INTO pairs VALUES (1, 2, 'x');
INSERT INTO log VALUES ('start');
"""


@pytest.fixture
def snap():
    return snapshot_from_sql(DDL, SEED)


def test_sqlite_clones_are_private(snap):
    a, b = SqliteState(snap), SqliteState(snap)
    a.handle.execute("UPDATE items SET qty = 99 WHERE id = 1")
    a.handle.commit()
    assert b.handle.execute("SELECT qty FROM items WHERE id = 1").fetchone() == (3,)
    assert SqliteState(snap).handle.execute("SELECT qty FROM items WHERE id = 1").fetchone() == (3,)
    assert a.digest() != b.digest() == snap.digest


def test_sqlite_reset_byte_identical(snap):
    s = SqliteState(snap)
    assert s.snapshot().data == snap.data
    s.handle.executescript("INSERT INTO items VALUES (3, 'plum', 1); DELETE FROM log; DROP TABLE pairs;")
    s.handle.execute("INSERT INTO items VALUES (4, 'fig', 2)")  # left in an open transaction
    assert s.snapshot().data != snap.data
    s.restore(snap)
    assert s.snapshot().data == snap.data
    assert s.handle.execute("SELECT count(*) FROM items").fetchone() == (2,)


def test_sqlite_fork_and_diff(snap):
    s = SqliteState(snap)
    s.handle.execute("UPDATE items SET qty = 5 WHERE id = 1")
    s.handle.commit()
    f = s.fork()
    f.handle.executescript("INSERT INTO items VALUES (3, 'plum', 1); DELETE FROM items WHERE id = 2;"
                           "UPDATE pairs SET note = 'y'; INSERT INTO log VALUES ('more');")
    # the fork started from the mutated state, and the parent is untouched by the fork's writes
    assert f.handle.execute("SELECT qty FROM items WHERE id = 1").fetchone() == (5,)
    assert s.handle.execute("SELECT count(*) FROM items").fetchone() == (2,)
    d = s.diff(f)
    assert d.touched() == {"items", "pairs", "log"}
    assert list(d.tables["items"].added) == ["[3]"] and d.tables["items"].added["[3]"]["name"] == "plum"
    assert list(d.tables["items"].removed) == ["[2]"]
    assert not d.tables["items"].changed
    ch = d.tables["pairs"].changed["[1, 2]"]
    assert (ch.before["note"], ch.after["note"]) == ("x", "y")
    assert len(d.tables["log"].added) == 1  # rowid-keyed table
    assert d.counts()["items"] == {"added": 1, "changed": 0, "removed": 1}
    # diff against the initial snapshot: one changed row only
    d0 = SqliteState(snap).diff(s)
    assert d0.counts() == {"items": {"added": 0, "changed": 1, "removed": 0}}
    assert s.diff(s.snapshot()).empty


def test_sqlite_schema_check(snap):
    check_schema(snap, DDL)
    other = snapshot_from_sql("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT);")
    with pytest.raises(SnapshotSchemaError, match="missing table 'pairs'.*table 'items': columns"):
        check_schema(other, DDL)
    with pytest.raises(SnapshotSchemaError, match="not a SQLite database"):
        check_schema(Snapshot("sqlite", b"garbage" * 100), DDL)
    with pytest.raises(SnapshotSchemaError, match="expected a 'sqlite' snapshot"):
        check_schema(Snapshot("object", pickle.dumps({})), DDL)
    with pytest.raises(TypeError, match="Snapshot"):
        check_schema(b"bytes", DDL)


def test_snapshot_validation():
    with pytest.raises(ValueError, match="kind"):
        Snapshot("mysql", b"")
    with pytest.raises(TypeError, match="bytes"):
        Snapshot("sqlite", bytearray(b"x"))
    with pytest.raises(ValueError, match="'object' snapshot but this state backend is 'sqlite'"):
        SqliteState(Snapshot("object", pickle.dumps({})))


class Account:
    balances: dict
    history: list

    def __init__(self):
        self.balances = {"alice": 10, "bob": {"eur": 1, "usd": 2}}
        self.history = []


def test_object_state_clone_reset_fork_diff():
    snap = snapshot_from_object(Account())
    a, b = ObjectState(snap, Account), ObjectState(snap, Account)
    a.handle.balances["alice"] = 0
    a.handle.history.append("x")
    assert b.handle.balances["alice"] == 10 and b.handle.history == []
    assert a.snapshot().data != snap.data
    a.restore(snap)
    assert a.snapshot().data == snap.data  # byte-identical reset
    f = a.fork()
    f.handle.balances["bob"]["eur"] = 5
    f.handle.balances["carol"] = 1
    del f.handle.balances["alice"]
    f.handle.extra = True
    assert a.handle.balances["bob"]["eur"] == 1
    d = a.diff(f).tables["attributes"]
    assert set(d.added) == {"balances.carol", "extra"}
    assert set(d.removed) == {"balances.alice"}
    assert d.changed["balances.bob.eur"].before == 1 and d.changed["balances.bob.eur"].after == 5
    assert a.diff(snap).empty


def test_object_schema_check():
    snap = snapshot_from_object(Account())
    check_object_schema(snap, Account)

    @dataclasses.dataclass
    class Other:
        x: int = 0

    with pytest.raises(SnapshotSchemaError, match="missing \\['x'\\]"):
        check_object_schema(snap, Other)
    with pytest.raises(SnapshotSchemaError, match="not an object-state image"):
        check_object_schema(Snapshot("object", b"\x00nope"), Account)
    with pytest.raises(TypeError, match="picklable"):
        o = Account()
        o.lock = __import__("threading").Lock()
        snapshot_from_object(o)

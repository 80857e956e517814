"""state.py and sqlite_state.py, value by value: snapshot validation and
properties, diff summaries, schemas, row keys, diffs of tables present on one side only, and every message."""
import hashlib
import json
import sqlite3

import pytest

from treadle.weft.runtime.determinism import EnvState
from treadle.weft.runtime.errors import SnapshotSchemaError
from treadle.weft.runtime.sqlite_state import (
    SqliteState,
    _key_columns,
    _rows,
    check_schema,
    diff_connections,
    schema_of,
    schema_of_ddl,
    snapshot_from_connection,
    snapshot_from_sql,
    tables,
)
from treadle.weft.runtime.state import RowChange, Snapshot, StateDiff, TableDiff


def test_snapshot_fields_and_messages():
    s = Snapshot("object", b"abc")
    assert s.env == EnvState() and s.nbytes == 3 and s.digest == hashlib.sha256(b"abc").hexdigest()
    assert Snapshot("sqlite", b"", None).env == EnvState()
    e = s.with_env(seed=3, draws=2)
    assert (e.kind, e.data, e.env.seed, e.env.draws, e.env.ticks) == ("object", b"abc", 3, 2, 0)
    assert s.env.seed == 0  # with_env makes a new snapshot
    with pytest.raises(ValueError, match="Snapshot.kind must be 'sqlite' or 'object', got 'csv'"):
        Snapshot("csv", b"")
    with pytest.raises(TypeError, match="Snapshot.data must be bytes, got bytearray"):
        Snapshot("object", bytearray(b"x"))
    with pytest.raises(TypeError, match="Snapshot.env must be a treadle.weft.runtime.determinism.EnvState, got dict"):
        Snapshot("object", b"", {})


def test_diff_summaries():
    empty = TableDiff()
    assert empty.empty
    assert not TableDiff(added={"a": 1}).empty and not TableDiff(removed={"a": 1}).empty
    assert not TableDiff(changed={"a": RowChange(before=1, after=2)}).empty
    d = StateDiff(tables={"t": TableDiff(added={"1": {}, "2": {}}, removed={"3": {}},
                                         changed={"4": RowChange(before=1, after=2)}), "u": empty})
    assert not d.empty and StateDiff(tables={"u": empty}).empty and StateDiff().empty
    assert d.touched() == {"t"}
    assert d.counts() == {"t": {"added": 2, "changed": 1, "removed": 1}}


DDL = ("CREATE TABLE b (k1 TEXT, k2 INTEGER, v real NOT NULL, PRIMARY KEY (k2, k1));"
       "CREATE TABLE a (x, y INTEGER);")


def test_schema_and_keys():
    con = sqlite3.connect(":memory:")
    con.executescript(DDL)
    assert tables(con) == ["a", "b"]
    assert schema_of(con) == {"a": [("x", "", False, 0), ("y", "INTEGER", False, 0)],
                              "b": [("k1", "TEXT", False, 2), ("k2", "INTEGER", False, 1), ("v", "REAL", True, 0)]}
    assert schema_of_ddl(DDL) == schema_of(con)
    assert _key_columns(con, "b") == ["k2", "k1"] and _key_columns(con, "a") == []
    con.executescript("INSERT INTO b VALUES ('p', 1, 0.5); INSERT INTO a VALUES ('q', 2), ('r', 3);")
    assert _rows(con, "b") == {'[1, "p"]': {"k1": "p", "k2": 1, "v": 0.5}}
    assert _rows(con, "a") == {"[1]": {"x": "q", "y": 2}, "[2]": {"x": "r", "y": 3}}
    snap = snapshot_from_connection(con)
    assert snap.kind == "sqlite" and SqliteState(snap).handle.execute("SELECT count(*) FROM a").fetchone() == (2,)
    with pytest.raises(TypeError, match="con must be a sqlite3.Connection, got str"):
        snapshot_from_connection("x")
    con.close()


def test_snapshot_from_sql_runs_every_script_in_order():
    snap = snapshot_from_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT);", "INSERT INTO t VALUES (1, 'a');",
                             "UPDATE t SET v = 'b';")
    s = SqliteState(snap)
    assert s.handle.execute("SELECT v FROM t").fetchall() == [("b",)]
    s.close()
    with pytest.raises(TypeError, match="SQL script #2 must be a str, got int"):
        snapshot_from_sql("CREATE TABLE t (a);", "SELECT 1;", 3)


def test_check_schema_lists_every_difference():
    ddl = "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT); CREATE TABLE u (a);"
    check_schema(snapshot_from_sql(ddl), ddl)
    other = snapshot_from_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL); CREATE TABLE w (a);")
    with pytest.raises(SnapshotSchemaError) as err:
        check_schema(other, ddl)
    assert str(err.value) == (
        "snapshot does not match the server's schema: missing table 'u'; unexpected table 'w'; table 't': columns "
        "[('id', 'INTEGER', False, 1), ('v', 'TEXT', True, 0)] != expected "
        "[('id', 'INTEGER', False, 1), ('v', 'TEXT', False, 0)]")
    with pytest.raises(SnapshotSchemaError, match=r"snapshot is not a SQLite database image \(9 bytes\)"):
        check_schema(Snapshot("sqlite", b"not a db!"), ddl)
    with pytest.raises(SnapshotSchemaError, match="expected a 'sqlite' snapshot, got kind 'object'"):
        check_schema(Snapshot("object", b""), ddl)
    with pytest.raises(TypeError, match="snapshot must be a treadle.weft.runtime.state.Snapshot, got bytes"):
        check_schema(b"", ddl)


def test_diff_connections_tables_on_one_side_and_rowid_keys():
    a = sqlite3.connect(":memory:")
    b = sqlite3.connect(":memory:")
    a.executescript("CREATE TABLE only_a (v); INSERT INTO only_a VALUES (1);"
                    "CREATE TABLE both (v); INSERT INTO both VALUES ('x'), ('y');")
    b.executescript("CREATE TABLE only_b (v); INSERT INTO only_b VALUES (2);"
                    "CREATE TABLE both (v); INSERT INTO both VALUES ('x'), ('z'), ('w');")
    d = diff_connections(a, b)
    assert sorted(d.tables) == ["both", "only_a", "only_b"]
    assert d.tables["only_a"] == TableDiff(removed={"[1]": {"v": 1}})
    assert d.tables["only_b"] == TableDiff(added={"[1]": {"v": 2}})
    assert d.tables["both"] == TableDiff(added={"[3]": {"v": "w"}},
                                         changed={"[2]": RowChange(before={"v": "y"}, after={"v": "z"})})
    assert diff_connections(a, a).tables == {}


def test_rows_keyed_by_a_blob_primary_key():
    # a primary key JSON cannot encode (a BLOB) is keyed by its repr, never an error
    con = sqlite3.connect(":memory:")
    con.executescript("CREATE TABLE files (digest BLOB PRIMARY KEY, size INTEGER);")
    con.execute("INSERT INTO files VALUES (?, ?)", (b"\x00\x01", 3))
    assert _rows(con, "files") == {json.dumps([repr(b"\x00\x01")]): {"digest": b"\x00\x01", "size": 3}}


def test_sqlite_state_restore_fork_diff_and_messages():
    snap = snapshot_from_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT);", "INSERT INTO t VALUES (1, 'a');")
    s = SqliteState(snap.with_env(seed=5))
    try:
        assert s.env.freeze().seed == 5 and s.snapshot().env.seed == 5
        s.handle.execute("INSERT INTO t VALUES (2, 'b')")  # an open transaction: restore rolls it back first
        assert s.handle.in_transaction
        s.restore(snap)
        assert s.handle.execute("SELECT count(*) FROM t").fetchone() == (1,) and s.env.freeze().seed == 0
        assert s.snapshot().data == snap.data and s.digest() == snap.digest
        s.handle.execute("UPDATE t SET v = 'c'")
        s.handle.commit()
        f = s.fork()
        assert f.snapshot().data == s.snapshot().data and f.handle is not s.handle
        f.handle.execute("DELETE FROM t")
        f.handle.commit()
        assert s.diff(f).counts() == {"t": {"added": 0, "changed": 0, "removed": 1}}
        assert s.diff(snap).tables["t"].changed == {"[1]": RowChange(before={"id": 1, "v": "c"},
                                                                     after={"id": 1, "v": "a"})}
        f.close()
        with pytest.raises(TypeError, match="can only diff a SqliteState against a SqliteState or sqlite Snapshot, "
                                            "got int"):
            s.diff(1)
        with pytest.raises(ValueError, match="snapshot is a 'object' snapshot but this state backend is 'sqlite'"):
            s.restore(Snapshot("object", b""))
        with pytest.raises(TypeError, match="snapshot must be a treadle.weft.runtime.state.Snapshot, got bytes"):
            s.restore(b"")
    finally:
        s.close()
    with pytest.raises(SnapshotSchemaError, match="snapshot is not a SQLite database image: "):
        SqliteState(Snapshot("sqlite", b"garbage bytes here"))

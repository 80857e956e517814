"""Test server: rows stamped with a time and a random id."""
import sqlite3
import time
import uuid

from treadle.weft.runtime.determinism import session_random, session_time, session_uuid
from treadle.weft.runtime.server import WeftServer

SCHEMA = "CREATE TABLE notes (id TEXT PRIMARY KEY, text TEXT NOT NULL, created REAL NOT NULL, lucky INTEGER);"
server = WeftServer("stamped", backend="sqlite", schema=SCHEMA)


@server.tool(writes=("notes",), returns="the new note's id and time")
def add_note(db: sqlite3.Connection, text: str) -> dict:
    """Add a note stamped with the session clock and a session-random id."""
    row = (str(session_uuid()), text, session_time(), session_random().randint(1, 10**9))
    db.execute("INSERT INTO notes VALUES (?, ?, ?, ?)", row)
    return {"id": row[0], "created": row[2], "lucky": row[3]}


@server.tool(writes=("notes",), returns="the new note's id and time")
def add_note_wallclock(db: sqlite3.Connection, text: str) -> dict:
    """Add a note stamped with the process clock and a fresh uuid4 (non-deterministic on purpose)."""
    row = (str(uuid.uuid4()), text, time.time(), 0)
    db.execute("INSERT INTO notes VALUES (?, ?, ?, ?)", row)
    return {"id": row[0], "created": row[2]}

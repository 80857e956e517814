"""Test server: notes stamped by the session clock
(replays exactly), by the process clock (never replays), and a write followed by a long sleep."""
import sqlite3
import time

import anyio

from treadle.weft.runtime.determinism import session_random, session_time
from treadle.weft.runtime.server import WeftServer

SCHEMA = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, created REAL NOT NULL, lucky INTEGER);"
server = WeftServer("slow_notes", backend="sqlite", schema=SCHEMA)


@server.tool(writes=("notes",), returns="the new note's id, time and lucky number")
def add_note(db: sqlite3.Connection, text: str) -> dict:
    """Add a note stamped with the session clock and random source."""
    row = (text, session_time(), session_random().randint(1, 10**9))
    cur = db.execute("INSERT INTO notes (text, created, lucky) VALUES (?, ?, ?)", row)
    return {"id": cur.lastrowid, "created": row[1], "lucky": row[2]}


@server.tool(writes=("notes",), returns="the new note's id and time")
def add_note_wallclock(db: sqlite3.Connection, text: str) -> dict:
    """Add a note stamped with the process clock (non-deterministic on purpose)."""
    now = time.time()
    cur = db.execute("INSERT INTO notes (text, created) VALUES (?, ?)", (text, now))
    return {"id": cur.lastrowid, "created": now}


@server.tool(writes=("notes",))
async def add_then_sleep(db: sqlite3.Connection, text: str, seconds: float) -> dict:
    """Insert, then sleep past any time limit."""
    db.execute("INSERT INTO notes (text, created) VALUES (?, 0)", (text,))
    await anyio.sleep(seconds)
    return {"done": True}


@server.tool(reads=("notes",), returns="every note")
def dump(db: sqlite3.Connection) -> list:
    """Every note, in id order."""
    return [list(r) for r in db.execute("SELECT id, text, created, lucky FROM notes ORDER BY id")]

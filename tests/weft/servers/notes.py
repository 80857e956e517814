"""Test server: notes in SQLite, a clean (shareable) module."""
import sqlite3
import time
from typing import Annotated

import anyio
from pydantic import Field

from treadle.weft.runtime.server import ToolError, WeftServer

SCHEMA = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"
server = WeftServer("notes", backend="sqlite", schema=SCHEMA)


@server.tool(writes=("notes",), returns="the new note's id", args_to_state={"text": "notes.text"})
def add_note(db: sqlite3.Connection, text: Annotated[str, Field(min_length=1)], tag: str | None = None) -> dict:
    """Add a note."""
    cur = db.execute("INSERT INTO notes (text, tag) VALUES (?, ?)", (text, tag))
    return {"id": cur.lastrowid}


@server.tool(reads=("notes",), returns="all notes")
def list_notes(db: sqlite3.Connection) -> list:
    """List notes in id order."""
    return [{"id": i, "text": t, "tag": g} for i, t, g in db.execute("SELECT id, text, tag FROM notes ORDER BY id")]


@server.tool(writes=("notes",))
def add_then_fail(db: sqlite3.Connection, text: str) -> dict:
    """Insert, then fail: the insert must be rolled back."""
    db.execute("INSERT INTO notes (text) VALUES (?)", (text,))
    raise ToolError(f"refusing note {text!r}")


@server.tool()
def explode(db: sqlite3.Connection) -> str:
    """An unexpected exception (a bug in the tool)."""
    return str(1 / 0)


@server.tool()
async def slow(db: sqlite3.Connection, seconds: float = 5.0) -> str:
    """Sleep (cooperatively)."""
    await anyio.sleep(seconds)
    return "done"


@server.tool()
def slow_sync(db: sqlite3.Connection, seconds: float = 1.0) -> str:
    """Block a worker thread (cannot be cancelled)."""
    time.sleep(seconds)
    return "done"


@server.tool(writes=("notes",))
def add_then_exit(db: sqlite3.Connection, text: str) -> dict:
    """Insert, then call sys.exit: rolled back, reported as an execution error, the runtime lives on."""
    import sys

    db.execute("INSERT INTO notes (text) VALUES (?)", (text,))
    sys.exit(4)

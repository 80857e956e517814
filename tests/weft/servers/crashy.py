"""Test server with a tool that kills its process (crash over stdio/HTTP)."""
import os
import sqlite3

from treadle.weft.runtime.server import WeftServer

server = WeftServer("crashy", backend="sqlite", schema="CREATE TABLE t (a INTEGER);")


@server.tool(writes=("t",))
def put(db: sqlite3.Connection, a: int) -> dict:
    """Insert a."""
    db.execute("INSERT INTO t VALUES (?)", (a,))
    return {"n": db.execute("SELECT count(*) FROM t").fetchone()[0]}


@server.tool()
def die(db: sqlite3.Connection) -> str:
    """Kill the server process."""
    os._exit(3)

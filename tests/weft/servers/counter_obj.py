"""Test server: object state for transactional rollback and abandoned (timed-out) calls."""
import time

import anyio

from treadle.weft.runtime.determinism import session_random
from treadle.weft.runtime.server import ToolError, WeftServer


class Counter:
    def __init__(self):
        self.n = 0
        self.log = []


server = WeftServer("counter", backend="object", state_class=Counter)


@server.tool(writes=("n", "log"), returns="the new count")
def bump(c: Counter, by: int = 1) -> int:
    """Add ``by``."""
    c.n += by
    c.log.append(by)
    return c.n


@server.tool(writes=("n", "log"))
def bump_then_fail(c: Counter) -> int:
    """Change the state (and draw from the session random source), then fail."""
    c.n += 100
    c.log.append(session_random().random())
    raise ToolError("failed after writing")


@server.tool(writes=("n", "log"))
def bump_then_block(c: Counter, seconds: float) -> int:
    """Write, block the thread, write again."""
    c.n += 1000
    time.sleep(seconds)
    c.n += 1000
    c.log.append("late")
    return c.n


@server.tool(writes=("n", "log"))
async def abump_then_block(c: Counter, seconds: float) -> int:
    """Write, sleep cooperatively, write again."""
    c.n += 1000
    await anyio.sleep(seconds)
    c.n += 1000
    return c.n


@server.tool(reads=("n",))
async def wait(c: Counter, seconds: float) -> int:
    """Sleep cooperatively, read."""
    await anyio.sleep(seconds)
    return c.n


@server.tool(reads=("n",))
def wait_sync(c: Counter, seconds: float) -> int:
    """Block a worker thread, read."""
    time.sleep(seconds)
    return c.n


@server.tool(reads=("n",))
async def block_loop(c: Counter, seconds: float) -> int:
    """A badly written async tool: blocks the worker's event loop (nothing can cancel it)."""
    time.sleep(seconds)
    return c.n

"""Test server that writes a module global (`global`): its calls are serialised across sessions."""
import time

from treadle.weft.runtime.server import WeftServer


class Box:
    def __init__(self):
        self.n = 0


server = WeftServer("global-counter", backend="object", state_class=Box)
calls = 0


@server.tool(writes=("n",))
def bump(box: Box, sleep_s: float = 0.1) -> dict:
    """Sleep, then count (module global and instance)."""
    global calls
    calls += 1
    time.sleep(sleep_s)
    box.n += 1
    return {"n": box.n}

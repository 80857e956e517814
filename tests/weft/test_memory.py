"""Closed sessions free their memory (tracemalloc, flat over many create/close cycles)."""
import gc
import tracemalloc

import anyio
import pytest

from treadle.weft.envs import shop
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.state import Snapshot


async def _cycles(rt, h, snap, n, *, call):
    for _ in range(n):
        own = Snapshot(snap.kind, bytes(bytearray(snap.data)), snap.env)  # each session its own image, as in use
        sid = await rt.create_session(h, own)
        del own
        if call:
            await rt.call_tool(sid, "get_order", {"order_id": 1})
        await rt.close(sid)


def _growth_per_cycle(n_warm: int, n: int, *, call: bool) -> tuple[float, int]:
    snap = shop.initial_snapshot()

    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            await _cycles(rt, h, snap, n_warm, call=call)
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                await _cycles(rt, h, snap, n, call=call)
                gc.collect()
                after = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            assert rt.sessions() == [] and not rt._closed_logs
            return (after - before) / n, snap.nbytes
    return anyio.run(main)


def test_closed_sessions_leave_nothing_behind():
    per_cycle, snap_bytes = _growth_per_cycle(50, 400, call=False)
    assert snap_bytes > 30_000  # each session had its own database image
    assert per_cycle < 64, f"{per_cycle:.0f} B kept per closed session"


def test_closed_sessions_after_calls_leave_only_call_statistics():
    per_cycle, _ = _growth_per_cycle(50, 400, call=True)
    # one latency sample per call stays in the per-tool statistics (a float in a list); nothing per session
    assert per_cycle < 128, f"{per_cycle:.0f} B kept per closed session"


@pytest.mark.slow
def test_memory_flat_over_10000_create_close_cycles():
    per_cycle, _ = _growth_per_cycle(200, 10_000, call=False)
    assert per_cycle < 16, f"{per_cycle:.1f} B kept per closed session"

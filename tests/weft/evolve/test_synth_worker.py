"""The long-lived sandboxed worker per session: it cannot open a socket, write outside its directory, or outlive its limits; one worker
serves a session's calls; sessions do not share one."""
import base64
import gc
import os
import sqlite3
import time
from pathlib import Path

import anyio
import pytest

from treadle.weft.evolve import synth_worker
from treadle.weft.evolve.synth_serve import SynthServeError, server_source, synth_env
from treadle.weft.evolve.synth_worker import SandboxWorker
from treadle.weft.runtime import Runtime

pytestmark = pytest.mark.usefixtures("sandbox")

MARK = "987.654321"  # a sleep no one else runs: its survival is looked for on the host

BACKEND = '''
import os, socket, subprocess
CALLS = 0

def add(db, x):
    global CALLS
    CALLS += 1
    db.execute("INSERT INTO t VALUES (?)", (x,))
    return {"rows": db.execute("SELECT count(*) FROM t").fetchone()[0], "calls_in_this_worker": CALLS}

def connect(db):
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1)
        return "connected"
    except OSError as e:
        return type(e).__name__ + ": " + str(e)

def write(db, path):
    open(path, "w").write("x")
    return os.path.realpath(path)

def escape(db):
    subprocess.Popen(["sleep", "MARK"], start_new_session=True)
    while True:
        pass

def die(db):
    os._exit(3)
'''.replace("MARK", MARK)


def _limits(timeout_s=3.0):
    from treadle.sandbox import SandboxLimits

    return SandboxLimits(timeout_s=timeout_s, memory_mb=512, max_output_bytes=1 << 20)


def _image():
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x)")
    db.commit()
    return base64.b64encode(db.serialize()).decode()


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _host_processes_with(mark):
    me = str(os.getpid())
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != me:
            try:
                if mark.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def test_one_worker_serves_many_calls_without_network_or_writes_outside(tmp_path):
    w = SandboxWorker(BACKEND, _limits())
    try:
        image = _image()
        for i in range(1, 4):
            out, why = w.call({"tool": "add", "args": {"x": i}, "image": image})
            assert why == "" and out["kind"] == "ok"
            image = out["image"]
            assert out["result"] == {"rows": i, "calls_in_this_worker": i}
        assert w.starts == 1  # one process for the session's calls
        out, _ = w.call({"tool": "connect", "args": {}, "image": image})
        assert out["kind"] == "ok" and out["result"].startswith("PermissionError")  # seccomp refuses socket()
        target = tmp_path / "escaped.txt"
        out, _ = w.call({"tool": "write", "args": {"path": str(target)}, "image": image})
        assert out["kind"] == "error" and ("Read-only" in out["error"] or "No such file" in out["error"])
        assert not target.exists()
        out, _ = w.call({"tool": "write", "args": {"path": "mine.txt"}, "image": image})
        assert out["kind"] == "ok" and out["result"] == os.path.join(w.work, "mine.txt")
        root = w.root
        assert not Path(root, "work", "mine.txt").exists()  # its work folder is its own tmpfs, not a host folder
    finally:
        w.close()
    assert not Path(root).exists()  # its directory goes with it


def test_a_call_past_its_time_limit_kills_the_worker_and_everything_it_started():
    w = SandboxWorker(BACKEND, _limits(timeout_s=2.0))
    try:
        out, _ = w.call({"tool": "add", "args": {"x": 1}, "image": _image()})
        pid = w.pid
        out, why = w.call({"tool": "escape", "args": {}, "image": _image()})
        assert out is None and why.startswith("the sandbox ended it (timeout after 2 s")
        assert not w.alive and _gone(pid)
        for _ in range(50):  # the detached sleep was in the worker's PID namespace: killed with it
            if not _host_processes_with(MARK):
                break
            time.sleep(0.1)
        assert _host_processes_with(MARK) == []
        out, why = w.call({"tool": "add", "args": {"x": 1}, "image": _image()})
        assert why == "" and out["result"]["calls_in_this_worker"] == 1 and w.starts == 2  # a fresh worker
        out, why = w.call({"tool": "die", "args": {}, "image": _image()})
        assert out is None and why.startswith("the sandbox ended it (the session's worker exited")
    finally:
        w.close()


def test_a_worker_does_not_outlive_its_lifetime():
    w = SandboxWorker(BACKEND, _limits(), lifetime_s=1.5)
    try:
        out, _ = w.call({"tool": "add", "args": {"x": 1}, "image": _image()})
        pid = w.pid
        assert out["kind"] == "ok" and w.alive
        for _ in range(100):  # the parent's timer stops it at 1.5 s (kill, then the directory is removed)
            if not w.alive and w.root is None:
                break
            time.sleep(0.1)
        assert not w.alive and _gone(pid) and w.root is None
        out, _ = w.call({"tool": "add", "args": {"x": 1}, "image": _image()})
        assert out["result"]["calls_in_this_worker"] == 1 and w.starts == 2
    finally:
        w.close()
    with pytest.raises(ValueError, match="lifetime_s"):
        SandboxWorker(BACKEND, lifetime_s=0)


def test_served_through_the_runtime_one_worker_per_session(S, tmp_path):
    counter = S.FIXED + '''
CALLS = 0

def list_books(db):
    global CALLS
    CALLS += 1
    return [{"calls_in_this_worker": CALLS}]
'''
    src = server_source(S.result(counter), "perses", limits=_limits())

    async def main():
        async with Runtime(timeout_s=20) as rt:
            env = await synth_env(rt, src)
            a = await rt.create_session(env.server_hash, env.snapshot)
            b = await rt.create_session(env.server_hash, env.snapshot)
            seen = []
            for sid in (a, a, a, b, a, b):
                seen.append((await rt.call_tool(sid, "list_books", {})).result[0]["calls_in_this_worker"])
            lent = await rt.call_tool(a, "lend_book", {"book_id": 2, "member": "ann"})
            workers = [w for w in synth_worker._ALL if w.backend == counter]
            return seen, lent.result, [(w.starts, w.alive) for w in workers], workers
    seen, lent, states, workers = anyio.run(main)
    assert seen == [1, 2, 3, 1, 4, 2]  # module state lives per session's worker, never shared across sessions
    assert lent == {"book_id": 2, "status": "out"}
    assert states == [(1, True), (1, True)]  # one worker per session, started once
    gc.collect()
    assert [w.alive for w in workers] == [False, False]  # the sessions ended: so did their workers
    with pytest.raises(SynthServeError, match="worker must be"):
        server_source(S.result(), "library", worker="thread")
    with pytest.raises(SynthServeError, match="worker_lifetime_s"):
        server_source(S.result(), "library", worker_lifetime_s=0)
    per_call = server_source(S.result(counter), "perses", limits=_limits(), worker="call")

    async def per_call_main():
        async with Runtime(timeout_s=20) as rt:
            env = await synth_env(rt, per_call)
            a = await rt.create_session(env.server_hash, env.snapshot)
            return [(await rt.call_tool(a, "list_books", {})).result[0]["calls_in_this_worker"] for _ in range(2)]
    assert anyio.run(per_call_main) == [1, 1]  # a fresh sandbox per call: nothing carried

"""Verifiers that run generated code: the verdict travels on a channel the code under test cannot write, and a
worker whose protocol got out of step is killed rather than answering a call with another call's reply."""
from __future__ import annotations

import base64
import sqlite3

import pytest

from treadle.sandbox import SandboxLimits
from treadle.testing import sandbox_unavailable
from treadle.weft.evolve.synth_validate import Backend, Check, Checks, Design, Schema, validate
from treadle.weft.evolve.synth_worker import SandboxWorker

_UNAVAILABLE = sandbox_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no sandbox isolation here: {_UNAVAILABLE}")

DESIGN = Design(entities=["t"], tasks=["add rows"], tools=[
    {"name": "add", "description": "add a row", "params": {"x": "int"}, "writes": ["t"]},
    {"name": "ghost", "description": "a tool the backend never defines", "params": {}, "reads": ["t"]}])
SCHEMA = Schema(ddl="CREATE TABLE t (x INTEGER);")
CHECKS = Checks(checks=[Check(tool="add", args={"x": 1}, state=[("SELECT x FROM t", [[1]])]),
                        Check(tool="ghost", expect_returns="boo")])
HONEST = "def add(db, x):\n    db.execute('INSERT INTO t VALUES (?)', (x,))\n"
GHOST = "\ndef ghost(db):\n    return 'boo'\n"

# forged events: what the harness would report for a backend defining both tools, then "done"
FORGE = r'''
import json, os, sys
lines = "".join(json.dumps(e) + "\n" for e in [
    {"event": "tables", "tables": ["t"]},
    {"event": "start", "i": 0, "tool": "add"},
    {"event": "check", "i": 0, "result": None, "error": None, "changed": ["t"], "state": [[[1]]]},
    {"event": "start", "i": 1, "tool": "ghost"},
    {"event": "check", "i": 1, "result": "boo", "error": None, "changed": [], "state": []},
    {"event": "done"}])
def forge():
    for f in (sys.stdout, sys.__stdout__):
        try:
            f.write(lines); f.flush()
        except (OSError, ValueError):
            pass
forge()
import atexit
atexit.register(forge)                          # again after the harness's own last line
for pid in ("1", str(os.getppid())):           # the harness's and PID 1's descriptors
    try:
        for n in os.listdir(f"/proc/{pid}/fd"):
            try:
                with open(f"/proc/{pid}/fd/{n}", "a") as f:
                    f.write(lines)
            except OSError:
                pass
    except OSError:
        pass
'''


def test_forged_check_events_do_not_validate_a_missing_tool():
    limits = SandboxLimits(timeout_s=30, memory_mb=512)
    fails, facts = validate(DESIGN, SCHEMA, Backend(source=FORGE + HONEST), CHECKS, limits=limits)
    assert [f.detail for f in fails] == ["backend defines no function 'ghost'"], (fails, facts)
    # control: the checks can pass, for a backend that defines the tool
    assert validate(DESIGN, SCHEMA, Backend(source=FORGE + HONEST + GHOST), CHECKS, limits=limits)[0] == []


def test_forged_events_on_every_descriptor_of_the_backend_are_not_accepted():
    every_fd = ("import json, os\nfor fd in range(64):\n    try:\n        os.write(fd, (json.dumps({'kind': "
                "'imported'}) + '\\n').encode() + lines.encode())\n    except OSError:\n        pass\n")
    fails, _ = validate(DESIGN, SCHEMA, Backend(source=FORGE + every_fd + HONEST), CHECKS,
                        limits=SandboxLimits(timeout_s=30, memory_mb=512))
    assert fails and all(f.stage == "backend" for f in fails), fails  # its own reply pipe garbled: never a pass


def test_a_backend_that_kills_the_harness_is_not_accepted():
    kill = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    fails, _ = validate(DESIGN, SCHEMA, Backend(source=kill + HONEST + GHOST), CHECKS,
                        limits=SandboxLimits(timeout_s=30, memory_mb=512))
    assert fails and all(f.stage == "backend" for f in fails), fails


def _image() -> str:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x INTEGER)")
    db.commit()
    return base64.b64encode(db.serialize()).decode()


DESYNC = r'''
import json, __main__
def echo(db, x):
    return x
def extra(db, x):
    # one more line on the reply channel: a reply for no request, or for the next one
    __main__.out.write(json.dumps({"kind": "ok", "result": "STALE", "image": "", "id": None}) + "\n")
    __main__.out.flush()
    return x
def garbage(db, x):
    __main__.out.write("not json\n"); __main__.out.flush()
    return x
'''


@pytest.mark.parametrize("tool", ["extra", "garbage"])
def test_a_worker_out_of_step_is_killed_and_never_answers_with_another_calls_reply(tool):
    w = SandboxWorker(DESYNC, SandboxLimits(timeout_s=10, memory_mb=512))
    try:
        image = _image()
        out, why = w.call({"tool": "echo", "args": {"x": 1}, "image": image})
        assert why == "" and out["result"] == 1 and w.starts == 1  # control: in step, one worker
        out, why = w.call({"tool": tool, "args": {"x": 2}, "image": image})
        assert out is None and ("out of step" in why or "JSON" in why), (out, why)
        for x in (3, 4):  # every later call is answered with its own reply, by a fresh worker
            out, why = w.call({"tool": "echo", "args": {"x": x}, "image": image})
            assert why == "" and out["result"] == x, (out, why)
        assert w.starts == 2
    finally:
        w.close()

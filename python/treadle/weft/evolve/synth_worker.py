"""A long-lived sandboxed worker per session for a synthesised backend (instead of one sandbox per tool call).

:mod:`~treadle.weft.evolve.synth_serve` runs a generated backend function in :mod:`treadle.sandbox`. One
sandbox per call costs a process start and the namespace set-up every call (~0.45 s on a 2-core machine).
A :class:`SandboxWorker` is started once per session (lazily, at its first tool call) in the same sandbox
(:func:`treadle.sandbox.isolation_mode`: its own network namespace with no usable device and a seccomp
filter refusing ``socket()`` but ``AF_UNIX``; a read-only root but its own temporary directory and private
``/tmp``; its own PID namespace): the generated module is imported once and each call is one JSON line
in and one out (the call's database image in, the result and new image out), so a call costs the
function's own time. The parent enforces every limit:

- **per call**: ``limits.timeout_s`` wall-clock; past it the worker's whole process group (and, through
  ``unshare --kill-child``, its PID namespace) is killed, the call fails, and the next call starts a
  fresh worker;
- **per worker**: ``lifetime_s`` wall-clock (a timer kills it) and as many CPU seconds (``RLIMIT_CPU``),
  ``limits.memory_mb`` for the whole sandbox (a memory cgroup), its work folder and ``/tmp`` (size-capped
  tmpfs), open files and file sizes (``RLIMIT_*``), processes (a pids cgroup where one can be made), a
  reply at most ``max_reply_bytes`` and answering the request it was sent (a reply out of step kills it);
- the session ending (its :class:`~treadle.weft.runtime.determinism.SessionEnv` collected) or this process
  exiting stops it; :meth:`SandboxWorker.close` removes its directory.

What a per-call sandbox gave and a session worker does not: the backend's module state (globals) lives
as long as the worker, so it may carry something from one call of the session to the next (never to
another session: one worker per session). Its results are checked by the serving process exactly as
before (same schema, only declared tables changed), whatever the worker says.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import secrets
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

__all__ = ["APPLY_CALL", "WORKER_MAIN", "SandboxWorker", "session_worker"]

# one generated tool call on a copy of the session's database image, shared by the per-call sandbox script
# (synth_serve) and the session worker below: the new image is returned only when the function returned
APPLY_CALL = r'''
import base64, sqlite3
def apply_call(fn, spec, done):
    db = sqlite3.connect(":memory:")
    db.deserialize(base64.b64decode(spec["image"]))
    try:
        result = fn(db, **spec["args"])
        db.commit()
    except Exception as e:
        db.rollback()
        done(kind="error", error=f"{type(e).__name__}: {e}")
    else:
        done(kind="ok", result=result, image=base64.b64encode(db.serialize()).decode())
    db.close()
'''

WORKER_MAIN = APPLY_CALL + r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")       # the reply channel; the backend's own prints go to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
ns = {"__name__": "generated_backend"}
try:
    exec(compile(open("backend.py").read(), "backend.py", "exec"), ns)
    broken = None
except BaseException as e:
    broken = f"{type(e).__name__}: {e}"
rid = None
def done(**kw):
    out.write(json.dumps({**kw, "id": rid}, default=str) + "\n")
    out.flush()
for line in sys.stdin:
    spec = json.loads(line)
    rid = spec.pop("id", None)
    if broken is not None:
        done(kind="import_error", error=broken)
        continue
    fn = ns.get(spec["tool"])
    if not callable(fn):
        done(kind="missing")
        continue
    apply_call(fn, spec, done)
'''


class SandboxWorker:
    """One sandboxed worker process serving calls of one generated backend (see the module docstring).

    Args:
        backend: the generated module's source.
        limits: :class:`treadle.sandbox.SandboxLimits` (``timeout_s`` per call; memory, files, processes).
        lifetime_s: wall-clock seconds a worker lives at most (and CPU seconds it may use).
        max_reply_bytes: the longest reply line read back (a longer one ends the worker and fails the call).

    Raises:
        ValueError: ``lifetime_s`` or ``max_reply_bytes`` not positive.
    """

    def __init__(self, backend: str, limits: Any = None, *, lifetime_s: float = 600.0,
                 max_reply_bytes: int = 64 << 20) -> None:
        from treadle.sandbox import SandboxLimits

        if not lifetime_s > 0 or not max_reply_bytes > 0:
            raise ValueError(f"lifetime_s and max_reply_bytes must be > 0, got {lifetime_s}, {max_reply_bytes}")
        self.backend = backend
        self.limits = limits or SandboxLimits()
        self.lifetime_s = float(lifetime_s)
        self.max_reply_bytes = int(max_reply_bytes)
        self.proc: subprocess.Popen | None = None
        self.root: str | None = None
        self.work: str | None = None
        self.started = 0.0
        self.starts = 0
        self._process: Any = None  # the treadle.sandbox.SandboxProcess
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()
        self._calls = 0  # request ids: a reply must name the request it answers

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        """Start a fresh worker (closing the current one, if any).

        Raises:
            SandboxUnavailableError: no isolation works here.
        """
        from treadle import sandbox as sb

        with self._lock:
            self.close()
            self._process = sb.start_process([sys.executable, "-I", "main.py"], limits=self.limits,
                                             cpu_s=math.ceil(self.lifetime_s) + 1,
                                             files={"main.py": WORKER_MAIN, "backend.py": self.backend})
            self.proc, self.root, self.work = self._process.proc, self._process.root, self._process.work
            self.started = time.monotonic()
            self.starts += 1
            self._timer = threading.Timer(self.lifetime_s, self._expire, args=(self.proc,))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if self.proc is proc:
                self.close()

    def close(self) -> None:
        """Kill the worker's process group (its PID namespace goes with it) and remove its directory."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._process is not None:
                self._process.kill()
                self._process = None
            self.proc = None
            self.root = self.work = None

    def _stderr_tail(self) -> str:
        return "" if self._process is None else self._process.stderr_tail()

    def call(self, request: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """Send one request line and read one reply line within ``limits.timeout_s``: ``(reply, '')``, or
        ``(None, why)`` when the worker timed out, ended, or replied something else (it is then stopped; the
        next call starts a fresh one). Starts the worker first when none is running.

        Each request carries a fresh id that its reply must echo, and a reply is exactly one line: a reply
        naming another request (a line left over from an earlier call), bytes after the reply's line, or a
        reply that is not one JSON object mean the protocol is out of step; the worker is then killed, so a
        later call never receives an earlier call's reply."""
        with self._lock:
            if not self.alive:
                self.start()
            proc = self.proc
            self._calls += 1
            rid = f"{self._calls}-{secrets.token_hex(8)}"  # unpredictable: no line written earlier can name it
            try:
                proc.stdin.write((json.dumps({**request, "id": rid}) + "\n").encode())
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                why = f"the sandbox ended it (the session's worker exited: {self._stderr_tail() or 'no message'})"
                self.close()
                return None, why
            deadline = time.monotonic() + self.limits.timeout_s
            buf = bytearray()
            fd = proc.stdout.fileno()
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close()
                    return None, (f"the sandbox ended it (timeout after {self.limits.timeout_s:g} s: the session's "
                                  "worker was killed; the next call starts a fresh one)")
                ready, _, _ = select.select([fd], [], [], left)
                if not ready:
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    why = f"the sandbox ended it (the session's worker exited: {self._stderr_tail() or 'no message'})"
                    self.close()
                    return None, why
                buf += chunk
                if len(buf) > self.max_reply_bytes:
                    self.close()
                    return None, f"the reply exceeded {self.max_reply_bytes} bytes; the worker was killed"
            line, _, rest = bytes(buf).partition(b"\n")
            try:
                out = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                out = None
            if not isinstance(out, dict):
                self.close()
                return None, "the worker replied something other than one JSON object; it was killed"
            if rest or out.pop("id", None) != rid:
                self.close()
                return None, ("the worker's reply does not answer this call (a line of another call, or more than one "
                              "line): the protocol is out of step; it was killed, the next call starts a fresh one")
            return out, ""


_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ALL: weakref.WeakSet = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()


def session_worker(session: Any, backend: str, limits: Any = None, *, lifetime_s: float = 600.0) -> SandboxWorker:
    """The worker of ``session`` (any weak-referenceable object, e.g. the call's
    :class:`~treadle.weft.runtime.determinism.SessionEnv`) for ``backend``; made on first use, stopped when the session
    object is collected or this process exits; a worker of another backend source is replaced."""
    with _REGISTRY_LOCK:  # tool calls of different sessions may run in different threads
        w = _SESSIONS.get(session)
        if w is not None and w.backend == backend:
            return w
        if w is not None:
            w.close()
        w = SandboxWorker(backend, limits, lifetime_s=lifetime_s)
        _SESSIONS[session] = w
        _ALL.add(w)
        weakref.finalize(session, w.close)
        return w


@atexit.register
def _close_all() -> None:
    for w in list(_ALL):
        w.close()

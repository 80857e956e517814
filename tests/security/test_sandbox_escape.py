"""Sandbox escapes through every resource treadle.sandbox claims to limit, counted per sandbox (six processes
of one sandbox together), each with a control showing the probe can fail."""
from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from treadle import sandbox, sandbox_cgroup
from treadle.sandbox import SandboxLimits, run_python
from treadle.testing import sandbox_unavailable

_UNAVAILABLE = sandbox_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no sandbox isolation here: {_UNAVAILABLE}")

# six children of one sandbox each try to take `each` of something; the parent prints what they got in total
_SIX = r"""
import os, sys, time
r, w = os.pipe()
kids = []
for i in range(6):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.close(r)
        got = take(i)
        os.write(w, ("%d\n" % got).encode())
        time.sleep(HOLD)
        os._exit(0)
    kids.append(pid)
os.close(w)
total, reports = 0, 0
with os.fdopen(r) as f:
    deadline = time.monotonic() + 20
    for line in f:
        total += int(line); reports += 1
        if reports == len(kids) or time.monotonic() > deadline:
            break
alive = sum(os.waitpid(p, os.WNOHANG)[0] == 0 for p in kids)
print("total", total, "alive", alive)
for p in kids:
    try:
        os.kill(p, 9)
    except OSError:
        pass
"""


def _six(take: str, hold: float = 0.0) -> str:
    return f"import os\nHOLD = {hold}\n{take}\n{_SIX}"


def _totals(stdout: str) -> tuple[int, int]:
    words = stdout.split()
    return int(words[words.index("total") + 1]), int(words[words.index("alive") + 1])


# -- the host side never resolves a path inside the sandbox --------------------------------------------------
def test_collect_follows_no_link_in_any_component_and_reads_only_regular_files():
    secret_dir = Path(tempfile.mkdtemp(prefix="treadle-sec-", dir=Path.home()))
    try:
        (secret_dir / "secret.txt").write_text("host secret")
        assert (secret_dir / "secret.txt").read_text() == "host secret"  # control: the host can read it
        code = f"""
import os
os.symlink({str(secret_dir)!r}, "out")                       # a host folder, through a folder component
os.symlink({str(secret_dir / 'secret.txt')!r}, "direct")     # a host file, as the last component
os.makedirs("d/e")
os.symlink("/usr", "d/e/usr")                                # a folder that exists inside, deeper down
os.symlink("..", "d/up")
os.mkfifo("fifo")                                            # would block a reader forever
os.makedirs("ok/sub")
open("ok/sub/x.txt", "w").write("mine")
"""
        r = run_python(code, collect=["out/secret.txt", "direct", "d/e/usr/lib/os-release", "d/up/ok/sub/x.txt",
                                      "fifo", "ok/sub/x.txt", "ok"])
        assert r.ok, r.stderr
        assert r.files == {"ok/sub/x.txt": "mine"}
    finally:
        for p in sorted(secret_dir.rglob("*"), reverse=True):
            p.unlink()
        secret_dir.rmdir()


def test_collect_happens_after_every_process_of_the_sandbox_is_gone():
    # a child left running would otherwise swap a collected file for a link between a check and the read
    code = r"""
import os, time
open("out.txt", "w").write("final")
if os.fork() == 0:
    time.sleep(0.5)
    os.remove("out.txt"); os.symlink("/etc/passwd", "out.txt")
    time.sleep(30)
"""
    r = run_python(code, collect=["out.txt"], limits=SandboxLimits(timeout_s=20))
    assert r.ok and r.files == {"out.txt": "final"}, (r.files, r.stderr)
    assert r.duration_s < 20  # the lingering child was killed, not waited for


def test_the_host_keeps_no_view_of_the_work_folder():
    import sys

    p = sandbox.start_process([sys.executable, "-I", "-c", "open('made.txt', 'w').write('x'); print('ok', "
                               "flush=True); import time; time.sleep(30)"])
    try:
        assert p.proc.stdout.readline().strip() == b"ok"
        assert not Path(p.root, "work", "made.txt").exists()
        assert "made.txt" not in os.listdir(p.root)
    finally:
        p.kill()


# -- disk: the work folder (and TMPDIR), /tmp and /dev/shm are capped per sandbox ----------------------------
_WRITE = r"""
import os
def take(i):
    got = 0
    try:
        with open(os.path.join(WHERE, "f%d" % i), "wb") as f:
            for _ in range(4):
                f.write(b"x" * (1 << 20)); f.flush(); got += 1
    except OSError:
        pass
    return got
"""


@pytest.mark.parametrize("where", ["'.'", "os.environ['TMPDIR']", "'/tmp'", "'/dev/shm'"])
def test_six_processes_cannot_write_more_than_the_folder_size(where):
    small = SandboxLimits(work_mb=8, tmp_mb=8, timeout_s=60)
    r = run_python(_six(f"WHERE = {where}\n{_WRITE}"), limits=small)
    assert r.ok, r.stderr
    total, _ = _totals(r.stdout)
    assert total <= 8, r.stdout  # MiB written by all six together
    big = SandboxLimits(work_mb=64, tmp_mb=64, timeout_s=60)  # control: the same code writes 24 MiB when allowed
    r = run_python(_six(f"WHERE = {where}\n{_WRITE}"), limits=big)
    assert r.ok and _totals(r.stdout)[0] == 24, r.stdout + r.stderr


def test_stdout_of_six_processes_is_capped_by_the_file_size_limit():
    code = _six("import os, sys\ndef take(i):\n    os.write(1, b'y' * (1 << 20))\n    return 1\n")
    r = run_python(code, limits=SandboxLimits(max_file_mb=1, max_output_bytes=16 << 20, timeout_s=60))
    assert r.stdout.count("y") <= 1 << 20, len(r.stdout)
    r = run_python(code, limits=SandboxLimits(max_file_mb=16, max_output_bytes=16 << 20, timeout_s=60))
    assert r.stdout.count("y") == 6 << 20  # control


# -- memory: one limit for all the sandbox's processes -------------------------------------------------------
_HOLD = "def take(i):\n    global keep\n    keep = b'\\x01' * (40 << 20)\n    return 40\n"


def test_six_forked_processes_cannot_hold_more_than_memory_mb_in_total():
    if sandbox_cgroup.own_cgroup("memory") is None:
        pytest.skip("no writable memory cgroup here: the sandbox refuses fork instead "
                    "(test_without_a_memory_cgroup_the_sandbox_is_one_process)")
    r = run_python(_six(_HOLD, hold=3), limits=SandboxLimits(memory_mb=128, timeout_s=60))
    assert r.memory_limited == "cgroup"
    _, alive = _totals(r.stdout)
    assert alive * 40 <= 128, r.stdout  # at most three children hold their 40 MiB at once
    r = run_python(_six(_HOLD, hold=3), limits=SandboxLimits(memory_mb=512, timeout_s=60))
    assert _totals(r.stdout)[1] == 6, r.stdout + r.stderr  # control: all six hold it under a higher limit


def test_an_out_of_memory_kill_is_a_memory_limit_result():
    if sandbox_cgroup.own_cgroup("memory") is None:
        pytest.skip("no writable memory cgroup here")
    code = "import os\nkeep = []\nfor _ in range(40):\n    keep.append(b'\\x01' * (8 << 20))\n"  # 320 MiB resident
    r = run_python(code, limits=SandboxLimits(memory_mb=96, timeout_s=60))
    assert not r.ok and r.termination in ("memory_limit", "exit"), r  # the kernel's kill, or a MemoryError
    if r.termination == "exit":
        assert "MemoryError" in r.stderr


def test_without_a_memory_cgroup_the_sandbox_is_one_process(monkeypatch):
    real = sandbox_cgroup.own_cgroup
    monkeypatch.setattr(sandbox_cgroup, "own_cgroup", lambda c: None if c == "memory" else real(c))
    code = r"""
import os, subprocess, sys, threading
try:
    os.fork(); print("FORKED")
except OSError as e:
    print("fork refused", e.errno)
try:
    subprocess.run([sys.executable, "-c", "pass"]); print("SPAWNED")
except OSError as e:
    print("spawn refused", e.errno)
t = threading.Thread(target=lambda: print("thread ok")); t.start(); t.join()
try:
    keep = b"x" * (200 << 20)
    print("ALLOCATED")
except MemoryError:
    print("memory refused")
"""
    r = run_python(code, limits=SandboxLimits(memory_mb=128, timeout_s=30))
    assert r.memory_limited == "single_process"
    assert r.stdout.split("\n")[:4] == ["fork refused 1", "spawn refused 1", "thread ok", "memory refused"], r
    monkeypatch.setattr(sandbox_cgroup, "own_cgroup", real)
    r = run_python(code, limits=SandboxLimits(memory_mb=512, timeout_s=30))  # control: with a cgroup, fork works
    assert "FORKED" in r.stdout and "SPAWNED" in r.stdout, r


# -- processes and wall clock --------------------------------------------------------------------------------
def test_processes_are_capped_per_sandbox_across_parents():
    if sandbox_cgroup.own_cgroup("pids") is None:
        pytest.skip("no writable pids cgroup here: only the timeout bounds the number of processes")
    take = ("import os, time\ndef take(i):\n    time.sleep(0.5)\n    n = 0\n    for _ in range(10):\n        try:\n"
            "            if os.fork() == 0:\n                time.sleep(30); os._exit(0)\n            n += 1\n"
            "        except OSError:\n            break\n    return n\n")
    r = run_python(_six(take, hold=1), limits=SandboxLimits(max_processes=24, timeout_s=60))
    total, _ = _totals(r.stdout)
    assert r.pids_limited and total + 6 + 1 <= 24, r.stdout + r.stderr  # grandchildren + children + parent
    r = run_python(_six(take, hold=1), limits=SandboxLimits(max_processes=256, timeout_s=60))
    assert _totals(r.stdout)[0] == 60, r.stdout  # control


def test_the_timeout_ends_every_process_of_the_sandbox():
    import sys
    import time

    mark = f"treadle-sec-busy-{os.getpid()}-{time.monotonic_ns()}"  # in every process's command line
    code = ("import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n        while True:\n            pass\n"
            "time.sleep(300)\n")
    r = sandbox.run_command([sys.executable, "main.py", mark], files={"main.py": code},
                            limits=SandboxLimits(timeout_s=3))
    assert r.termination == "timeout"
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark.encode() in (d / "cmdline").read_bytes():
                    left.append(d.name)
            except OSError:
                pass
    assert left == []


# -- sockets and the sandbox's own PID 1 ---------------------------------------------------------------------
def test_no_socket_reaches_a_unix_socket_even_inside_the_read_paths(tmp_path):
    path = str(tmp_path / "host.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    dgram_path = str(tmp_path / "host-dgram.sock")
    dsrv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dsrv.bind(dgram_path)
    code = f"""
import socket
for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
    try:
        c = socket.socket(socket.AF_UNIX, kind); c.connect({path!r}); print("CONNECTED")
    except OSError as e:
        print("socket refused", e.errno)
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b"x", {dgram_path!r}); print("SENT")
except OSError as e:
    print("dgram pair refused", e.errno)
print(open({str(tmp_path / 'readable.txt')!r}).read())
"""
    (tmp_path / "readable.txt").write_text("readable")
    try:
        r = run_python(code, read_paths=[str(tmp_path)])
        c = socket.socket(socket.AF_UNIX)  # control: the host connects
        c.connect(path)
        c.close()
    finally:
        srv.close()
        dsrv.close()
    assert r.ok, r.stderr
    assert r.stdout.split("\n")[:4] == ["socket refused 1", "socket refused 1", "dgram pair refused 1", "readable"]


def test_the_sandboxs_pid_1_descriptors_and_status_cannot_be_written():
    code = r"""
import os
opened = []
for n in os.listdir("/proc/1/fd"):
    try:
        with open("/proc/1/fd/" + n, "w") as f:
            f.write("exit 0")
        opened.append(n)
    except OSError:
        pass
print("opened", opened)
raise SystemExit(3)
"""
    r = run_python(code)
    assert r.stdout.strip() == "opened []" and r.returncode == 3, r


_HARNESS = r"""
import ctypes, os, subprocess, sys
fd = int(os.environ["TREADLE_SANDBOX_REPORT_FD"])
if PROTECT:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)      # PR_SET_DUMPABLE = 0
child = '''
import os, sys
me, fd = sys.argv[1], sys.argv[2]
for path in ("/proc/%s/fd/%s" % (me, fd), "/proc/%s/mem" % me):
    try:
        with open(path, "rb" if path.endswith("mem") else "wb") as f:
            if not path.endswith("mem"):
                f.write(b"FORGED")
        print("OPENED", path)
    except OSError as e:
        print("refused", e.errno)
'''
print(subprocess.run([sys.executable, "-c", child, str(os.getpid()), str(fd)], capture_output=True, text=True,
                     close_fds=True).stdout)
os.write(fd, b"real")
"""


def test_a_non_dumpable_harness_keeps_its_report_channel_from_its_child():
    r = run_python("PROTECT = True\n" + _HARNESS, report=True)
    assert r.ok and r.stdout.split() == ["refused", "13", "refused", "13"] and r.report == "real", r
    r = run_python("PROTECT = False\n" + _HARNESS, report=True)  # control: a dumpable harness is reachable
    assert "OPENED" in r.stdout, r

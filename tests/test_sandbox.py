"""treadle.sandbox: no network, no reads of the host beyond its read paths, no writes outside its directory,
no dangerous syscalls, no life past the time limit; each restriction with a control that shows it can fail."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from treadle import sandbox
from treadle.sandbox import SandboxLimits, SandboxUnavailableError, run_command, run_python
from treadle.sandbox_cgroup import own_cgroup
from treadle.testing import sandbox_unavailable

_UNAVAILABLE = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no sandbox isolation here: {_UNAVAILABLE}")


@needs_sandbox
def test_runs_code_in_a_fresh_directory_and_collects_files():
    r = run_python("import os\nprint(os.getcwd())\nopen('out.txt', 'w').write('hello')\nprint(open('in.txt').read())",
                   files={"in.txt": "given"}, collect=["out.txt", "absent.txt"])
    assert r.ok, r.stderr
    cwd, given = r.stdout.split()
    assert "treadle-sandbox-" in cwd and cwd != os.getcwd()
    assert given == "given"
    assert r.files == {"out.txt": "hello"}
    assert not Path(cwd).exists()  # removed afterwards


@needs_sandbox
def test_cannot_connect_to_a_server_on_the_parents_loopback():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    srv.settimeout(5)
    t = threading.Thread(target=lambda: accepted.append(_accept(srv)))
    t.start()
    code = (f"import socket\n"
            f"try:\n    s = socket.socket()\n    s.settimeout(2)\n    s.connect(('127.0.0.1', {port}))\n"
            f"    print('CONNECTED')\n"
            f"except OSError as e:\n    print('refused', e.errno)\n"
            f"try:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n    print('CONNECTED')\n"
            f"except OSError as e:\n    print('refused', e.errno)\n")
    r = run_python(code)
    t.join()
    srv.close()
    assert r.ok, r.stderr
    assert "CONNECTED" not in r.stdout
    assert r.stdout.count("refused") == 2
    assert accepted == [None]  # the parent's server never saw a connection
    # control: the same code outside the sandbox does connect (so the test can fail)
    srv2 = socket.socket()
    srv2.bind(("127.0.0.1", 0))
    srv2.listen(1)
    c = socket.create_connection(srv2.getsockname(), timeout=2)
    c.close()
    srv2.close()


def _accept(srv):
    try:
        conn, _ = srv.accept()
        conn.close()
        return "accepted"
    except OSError:
        return None


@needs_sandbox
@pytest.mark.parametrize("where", ["tmp", "home", "read_path"])
def test_cannot_write_outside_its_directory(tmp_path, where):
    if where != "tmp":  # a folder outside /tmp (whose host copy the private /tmp hides anyway)
        tmp_path = Path(tempfile.mkdtemp(prefix="treadle-sandbox-test-", dir=Path.home()))
    target = tmp_path / "victim.txt"
    target.write_text("original")
    code = f"""
import os
results = []
for path in [{str(target)!r}, {str(tmp_path / 'new.txt')!r}, '/treadle-escape.txt', '/usr/treadle-escape.txt',
             '/etc/passwd']:
    try:
        with open(path, 'a') as f:
            f.write('pwned')
        results.append('WROTE ' + path)
    except OSError as e:
        results.append('blocked %d' % e.errno)
try:
    os.unlink({str(target)!r})
    results.append('WROTE unlink')
except OSError as e:
    results.append('blocked %d' % e.errno)
print('\\n'.join(results))
"""
    try:
        r = run_python(code, read_paths=[str(tmp_path)] if where == "read_path" else ())
        assert r.ok, r.stderr
        assert "WROTE" not in r.stdout, r.stdout
        assert target.read_text() == "original"
        assert not (tmp_path / "new.txt").exists()
        assert not Path("/treadle-escape.txt").exists() and not Path("/usr/treadle-escape.txt").exists()
        lines = r.stdout.split()
        if where == "read_path":  # visible, and read-only: EROFS, not merely hidden
            assert lines[1] == "30" and lines[3] == "30", r.stdout
        else:  # not even there: ENOENT
            assert lines[1] == "2" and lines[3] == "2", r.stdout
    finally:
        if where != "tmp":
            shutil.rmtree(tmp_path)


@needs_sandbox
def test_tmp_is_private_writable_and_gone_after_the_run():
    name = f"treadle-sandbox-test-{uuid.uuid4().hex}"
    code = f"""
import os
open('/tmp/{name}', 'w').write('inside')
open('/dev/shm/{name}', 'w').write('inside')
import sys, treadle
# not the mount points of the sandbox's own read-only binds (the work dir, this Python, treadle's package,
# which live under /tmp when the checkout does, e.g. a CI clone in /tmp)
mine = [os.getcwd(), os.path.realpath(sys.executable), sys.prefix, os.path.dirname(treadle.__file__)]
others = [e for e in os.listdir('/tmp') if not any(p.startswith('/tmp/' + e + '/') for p in mine)]
print(others, open('/tmp/{name}').read())
"""
    r = run_python(code)
    assert r.ok, r.stderr
    assert r.stdout.split() == [f"['{name}']", "inside"]  # the host's /tmp is not visible, only its own file
    assert not Path("/tmp", name).exists() and not Path("/dev/shm", name).exists()
    r = run_python(f"import os\nprint(os.path.exists('/tmp/{name}'))")
    assert r.stdout.strip() == "False"  # a second run starts with an empty /tmp
    r = run_python("open('/tmp/big', 'wb').write(b'x' * (3 << 20))", limits=SandboxLimits(tmp_mb=1))
    assert not r.ok and "No space left" in r.stderr  # the private /tmp is bounded by tmp_mb


@needs_sandbox
def test_cannot_read_the_hosts_files_outside_the_read_paths(tmp_path):
    secret_dir = Path(tempfile.mkdtemp(prefix="treadle-sandbox-test-", dir=Path.home()))
    try:
        (secret_dir / "secret.txt").write_text("s3cret")
        repo_file = Path(__file__).resolve().parents[1] / "pyproject.toml"  # next to the package, not in it
        probes = [str(secret_dir / "secret.txt"), "/etc/shadow", str(repo_file), "/var/log", "/run", "/home"]
        for p in probes[:3]:  # control: the host can read them (so the test can fail)
            assert Path(p).exists(), p
        code = f"""
import os
for p in {probes!r}:
    try:
        if os.path.isdir(p):
            print('READ', p, os.listdir(p))
        else:
            print('READ', p, open(p).read()[:10])
    except OSError as e:
        print('hidden', e.errno)
import treadle, pydantic, sys            # this interpreter's packages stay importable
print('imports ok', sys.prefix)
"""
        r = run_python(code)
        assert r.ok, r.stderr
        assert "READ" not in r.stdout and r.stdout.count("hidden 2") == len(probes), r.stdout
        assert "imports ok" in r.stdout
        # what read_paths names becomes readable (read-only: see the write test)
        r = run_python(f"print(open({str(secret_dir / 'secret.txt')!r}).read())", read_paths=[str(secret_dir)])
        assert r.ok and r.stdout.strip() == "s3cret", r.stderr
    finally:
        shutil.rmtree(secret_dir)


@needs_sandbox
@pytest.mark.parametrize("name, call, expect", [
    ("socket AF_INET", "libc.socket(2, 1, 0)", "-1 1"),
    ("socket AF_INET6", "libc.socket(10, 1, 0)", "-1 1"),
    ("socket AF_NETLINK", "libc.socket(16, 3, 0)", "-1 1"),
    ("unshare CLONE_NEWUSER", "libc.unshare(0x10000000)", "-1 1"),
    ("unshare CLONE_NEWNET", "libc.unshare(0x40000000)", "-1 1"),
    ("ptrace TRACEME", "libc.ptrace(0, 0, None, None)", "-1 1"),
    ("mount", "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)", "-1 1"),
    ("keyctl", "libc.syscall(250, 0, 0, 0, 0, 0)", "-1 1"),
    ("bpf", "libc.syscall(321, 0, 0, 0)", "-1 1"),
    ("io_uring_setup", "libc.syscall(425, 1, None)", "-1 1"),
    ("userfaultfd", "libc.syscall(323, 0)", "-1 1"),
    ("perf_event_open", "libc.syscall(298, None, 0, -1, -1, 0)", "-1 1"),
    ("clone with CLONE_NEWPID", "libc.syscall(56, 0x20000000 | 17, None, None, None, None)", "-1 1"),
    ("clone3", "libc.syscall(435, None, 0)", "-1 38"),
])
def test_seccomp_refuses_dangerous_syscalls(name, call, expect):
    if os.uname().machine != "x86_64" and "syscall(" in call:
        pytest.skip("raw syscall numbers are x86_64's")
    code = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nrc = {call}\nprint(rc, ctypes.get_errno())"
    r = run_python(code)
    assert r.ok, r.stderr
    assert r.stdout.strip() == expect, (name, r.stdout)


@needs_sandbox
def test_what_programs_need_still_works_under_the_filter():
    code = """
import multiprocessing, socket, subprocess, sys, tempfile
a, b = socket.socketpair()                 # a connected AF_UNIX stream pair is allowed
a.send(b'x'); print(b.recv(1))
print(subprocess.run([sys.executable, '-c', 'print(6*7)'], capture_output=True, text=True).stdout.strip())
with tempfile.NamedTemporaryFile() as f:
    print(f.name.startswith('/'))
def sq(x):
    return x * x
if __name__ == '__main__':
    with multiprocessing.get_context('fork').Pool(2) as p:   # needs a writable /dev/shm
        print(p.map(sq, [1, 2, 3]))
"""
    r = run_python(code, limits=SandboxLimits(timeout_s=60))
    assert r.ok, r.stderr
    assert r.stdout.split("\n")[:4] == ["b'x'", "42", "True", "[1, 4, 9]"], r.stdout


@needs_sandbox
def test_cannot_reach_unix_sockets_of_the_host(tmp_path):
    path = str(tmp_path / "host.sock")
    srvs = []
    for addr in (path, "\0treadle-sandbox-test-" + uuid.uuid4().hex):
        s = socket.socket(socket.AF_UNIX)
        s.bind(addr)
        s.listen(1)
        srvs.append(s)
    code = f"""
import socket
for addr in [{path!r}, {srvs[1].getsockname()!r}]:
    try:
        c = socket.socket(socket.AF_UNIX)
        c.connect(addr)
        print('CONNECTED')
    except OSError as e:
        print('refused', e.errno)
"""
    r = run_python(code, read_paths=[str(tmp_path)])  # even a socket inside the read paths
    for s in srvs:  # control: outside the sandbox both connect
        c = socket.socket(socket.AF_UNIX)
        c.connect(s.getsockname())
        c.close()
        s.close()
    assert r.ok, r.stderr
    assert "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2, r.stdout


@needs_sandbox
def test_cannot_undo_the_read_only_mounts_from_a_new_user_namespace():
    # the attack: create a user namespace (full capabilities inside it) and remount / writable
    code = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
ok = libc.unshare(0x10000000 | 0x20000)
print('unshare', ok, ctypes.get_errno())
rc = libc.mount(None, b'/', None, ctypes.c_ulong(32 | 4096), None)   # MS_REMOUNT|MS_BIND, without MS_RDONLY
print('remount', rc, ctypes.get_errno())
try:
    open('/treadle-escape', 'w')
    print('WROTE')
except OSError as e:
    print('blocked', e.errno)
"""
    r = run_python(code)
    assert r.ok, r.stderr
    assert "remount -1" in r.stdout and "WROTE" not in r.stdout, r.stdout
    assert not Path("/treadle-escape").exists()


@needs_sandbox
def test_timeout_kills_the_whole_tree_including_setsid_children():
    marker = f"treadle-sandbox-test-{uuid.uuid4().hex}"
    code = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', {marker!r}], start_new_session=True)
print('spawned', flush=True)
while True:
    pass
"""
    t0 = time.monotonic()
    r = run_python(code, limits=SandboxLimits(timeout_s=2))
    assert time.monotonic() - t0 < 20
    assert r.termination == "timeout" and r.returncode is None and not r.ok
    assert "spawned" in r.stdout
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def _processes_with(marker: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                    found.append(int(d))
            except OSError:
                pass
    return found


@needs_sandbox
def test_memory_and_file_size_limits():
    r = run_python("x = bytearray(600 * 1024 * 1024)\nprint('ALLOCATED')", limits=SandboxLimits(memory_mb=256))
    assert r.returncode != 0 and "ALLOCATED" not in r.stdout and "MemoryError" in r.stderr
    r = run_python("open('big', 'wb').write(b'x' * (4 << 20))\nprint('WROTE')", limits=SandboxLimits(max_file_mb=1))
    # Python ignores SIGXFSZ, so the write fails with EFBIG; a program that does not gets the signal
    assert r.returncode == 1 and "WROTE" not in r.stdout and "File too large" in r.stderr
    r = run_command(["sh", "-c", "exec head -c 4194304 /dev/zero > big"],
                    limits=SandboxLimits(max_file_mb=1, max_output_bytes=2 << 20), collect=["big"])
    assert r.termination == "file_size_limit" and len(r.files["big"]) == 1 << 20
    r = run_python("import os\nfds = [os.open('/dev/null', os.O_RDONLY) for _ in range(100)]\nprint('OPENED')",
                   limits=SandboxLimits(max_open_files=16))
    assert "OPENED" not in r.stdout and "Too many open files" in r.stderr


@needs_sandbox
def test_cpu_limit_and_output_cap():
    r = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=30, cpu_s=1))
    assert r.termination == "cpu_limit" and r.returncode == -24 and r.duration_s < 25
    r = run_python("print('y' * 5000)", limits=SandboxLimits(max_output_bytes=100))
    assert r.ok and r.stdout == "y" * 100


@needs_sandbox
def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("TREADLE_SECRET_TOKEN", "s3cret")
    r = run_python("import os\nprint(os.environ.get('TREADLE_SECRET_TOKEN'), os.environ['EXTRA'])", env={"EXTRA": "1"})
    assert r.stdout.split() == ["None", "1"]


@needs_sandbox
def test_nonzero_exit_and_stdin():
    r = run_python("import sys\ndata = sys.stdin.read()\nsys.exit(len(data))", stdin="abc")
    assert r.termination == "exit" and r.returncode == 3 and not r.ok
    r = run_command(["sh", "-c", "kill -KILL $$"])
    assert r.termination == "signal" and r.returncode == -9


@pytest.mark.parametrize("kwargs, match", [
    ({"argv": []}, "argv must be a non-empty list"),
    ({"argv": ["python", ""]}, "argv must be a non-empty list"),
    ({"argv": ["true"], "files": {"../x": ""}}, "relative path"),
    ({"argv": ["true"], "files": {"/etc/x": ""}}, "relative path"),
    ({"argv": ["true"], "collect": ["../../etc/passwd"]}, "relative path"),
    ({"argv": ["true"], "read_paths": ["relative/dir"]}, "absolute path"),
    ({"argv": ["true"], "read_paths": ["/"]}, "other than '/'"),
    ({"argv": ["true"], "read_paths": ["/treadle-no-such-dir"]}, "does not exist"),
])
def test_bad_arguments_raise_before_running(kwargs, match, monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_mode", lambda: pytest.fail("must not probe or run"))
    with pytest.raises(ValueError, match=match):
        run_command(**kwargs)


def test_bad_limits():
    with pytest.raises(ValueError):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError):
        SandboxLimits(memory_mb=1)
    with pytest.raises(ValueError):
        SandboxLimits(bogus=1)


def test_unavailable_isolation_is_a_clear_error_never_an_unsandboxed_run(monkeypatch):
    sandbox.isolation_mode.cache_clear()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    try:
        with pytest.raises(SandboxUnavailableError, match="unshare"):
            run_python("print(1)")
    finally:
        sandbox.isolation_mode.cache_clear()


@needs_sandbox
def test_missing_program_is_a_result_with_a_clear_message():
    r = run_command(["treadle-no-such-program"])
    assert r.returncode == 125 and "exec 'treadle-no-such-program'" in r.stderr


_FORKS = """
import os, time
pids = []
try:
    for i in range(60):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        pids.append(pid)
except OSError as e:
    print('refused', e.errno)
print('forked', len(pids))
for p in pids:
    os.kill(p, 9)
"""


@needs_sandbox
def test_process_count_is_capped_where_a_pids_cgroup_can_be_made():
    if own_cgroup("pids") is None:
        pytest.skip("no writable pids cgroup here: only the timeout bounds a fork bomb (SandboxResult.pids_limited)")
    r = run_python(_FORKS, limits=SandboxLimits(max_processes=16, timeout_s=30))
    assert r.ok and r.pids_limited, r.stderr
    assert "refused 11" in r.stdout and int(r.stdout.split()[-1]) < 16  # EAGAIN once 16 processes exist
    r = run_python(_FORKS, limits=SandboxLimits(max_processes=256, timeout_s=30))  # control: the code can fork
    assert r.ok and r.stdout.split() == ["forked", "60"], r.stdout + r.stderr
    mine = f"treadle-sandbox-{os.getpid()}-"  # (other processes' sandboxes may be running meanwhile)
    leftovers = [d for d in os.listdir(own_cgroup("pids")) if d.startswith(mine)]
    assert leftovers == []  # each run's cgroup is removed


@needs_sandbox
def test_start_process_is_a_long_lived_sandboxed_process_that_kill_removes():
    """The public API the session worker uses: a process spoken to over pipes, in the sandbox (no network, its own
    directory), killed with its directory and process group by ``kill`` (idempotent)."""
    import sys

    code = ("import os, socket, sys\n"
            "for line in sys.stdin:\n"
            "    try:\n        socket.create_connection(('1.1.1.1', 80), timeout=1); net = 'net'\n"
            "    except OSError:\n        net = 'no-net'\n"
            "    sys.stdout.write(f'{line.strip()} {net} {os.getcwd()}\\n'); sys.stdout.flush()\n")
    p = sandbox.start_process([sys.executable, "-I", "main.py"], files={"main.py": code},
                              limits=SandboxLimits(timeout_s=5), cpu_s=30)
    try:
        for word in ("a", "b"):  # the same process answers both
            p.proc.stdin.write(f"{word}\n".encode())
            p.proc.stdin.flush()
            assert p.proc.stdout.readline().decode().split() == [word, "no-net", p.work]
        assert p.alive and os.path.isdir(p.root)
    finally:
        p.kill()
    assert not p.alive and not os.path.exists(p.root)
    p.kill()  # idempotent


def test_start_process_refuses_bad_input_before_starting_anything():
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(ValueError, match="argv"):
        sandbox.start_process([])
    with pytest.raises(ValueError, match="files key"):
        sandbox.start_process(["python3"], files={"../x.py": ""})
    with pytest.raises(ValueError, match="cpu_s"):
        sandbox.start_process(["python3"], cpu_s=0)
    assert not {d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith("treadle-sandbox-proc-")}

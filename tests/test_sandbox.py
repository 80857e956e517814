"""treadle.sandbox: no network, no writes outside its directory, no life past the time limit."""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from treadle import sandbox
from treadle.sandbox import SandboxLimits, SandboxUnavailableError, run_command, run_python

try:
    sandbox.isolation_mode()
    _UNAVAILABLE = None
except SandboxUnavailableError as e:  # e.g. CI runners with unprivileged user namespaces disabled
    _UNAVAILABLE = str(e)
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
    code = (f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
            f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('CONNECTED')\n"
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
def test_cannot_write_outside_its_directory(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("original")
    code = f"""
import os
results = []
for path in [{str(target)!r}, {str(tmp_path / 'new.txt')!r}, '/tmp/treadle-sandbox-escape.txt', os.path.expanduser('~root/x')]:
    try:
        with open(path, 'w') as f:
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
    r = run_python(code)
    assert r.ok, r.stderr
    assert "WROTE" not in r.stdout, r.stdout
    assert target.read_text() == "original"
    assert not (tmp_path / "new.txt").exists()
    assert not Path("/tmp/treadle-sandbox-escape.txt").exists()


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
    r = run_command(["sh", "-c", "exec head -c 4194304 /dev/zero > big"], limits=SandboxLimits(max_file_mb=1, max_output_bytes=2 << 20),
                    collect=["big"])
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

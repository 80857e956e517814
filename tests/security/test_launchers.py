"""Every way the code base starts a sandboxed process runs it under every limit of the sandbox, read from inside
the child itself (/proc/self/limits, seccomp and no_new_privs, namespaces, cgroups, folder sizes, sockets): a
launcher that drops one limit fails here. A static check keeps the list of launchers complete."""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from treadle import sandbox, sandbox_cgroup
from treadle.sandbox import SandboxLimits
from treadle.testing import sandbox_unavailable

_UNAVAILABLE = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no sandbox isolation here: {_UNAVAILABLE}")

LIMITS = SandboxLimits(timeout_s=20, memory_mb=384, max_open_files=48, max_file_mb=3, tmp_mb=5, work_mb=7,
                       max_processes=40, max_output_bytes=1 << 20)

PROBE = r'''
def _probe():
    import os, re, socket
    lim = {}
    for line in open("/proc/self/limits").read().splitlines()[1:]:
        name, soft = re.split(r"\s{2,}", line.strip())[:2]
        lim[name] = soft
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    def size_mb(p):
        s = os.statvfs(p)
        return s.f_blocks * s.f_frsize >> 20
    socks = []
    for family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
        try:
            socket.socket(family).close(); socks.append("open")
        except OSError as e:
            socks.append(e.errno)
    return {"as": lim["Max address space"], "cpu": lim["Max cpu time"], "nofile": lim["Max open files"],
            "fsize": lim["Max file size"], "seccomp": status["Seccomp"].strip(), "nnp": status["NoNewPrivs"].strip(),
            "ns": {n: os.readlink("/proc/self/ns/" + n) for n in ("net", "mnt", "pid", "user")},
            "cgroups": [l for l in open("/proc/self/cgroup").read().splitlines() if re.search(r":(memory|pids):", l)
                        or l.startswith("0::")],
            "work_mb": size_mb("."), "tmpdir_mb": size_mb(os.environ.get("TMPDIR", ".")), "tmp_mb": size_mb("/tmp"),
            "shm_mb": size_mb("/dev/shm"), "sockets": socks, "host": [p for p in HOST_FILES if os.path.exists(p)]}
'''.replace("HOST_FILES", repr(("/etc/shadow", str(Path(__file__).resolve()), str(Path.home() / ".bashrc"))))


def _check(found: dict, limits: SandboxLimits, cpu_s: int) -> None:
    """Every limit the sandbox claims, as the child saw it."""
    assert found["as"] == str(limits.memory_mb << 20), found
    assert found["nofile"] == str(limits.max_open_files)
    assert found["fsize"] == str(int(limits.max_file_mb * (1 << 20)))
    assert found["cpu"] == str(cpu_s)
    assert found["seccomp"] == "2" and found["nnp"] == "1"  # a seccomp filter, no_new_privs
    for name, link in found["ns"].items():  # its own network, mount, PID and user namespaces
        assert link != os.readlink(f"/proc/self/ns/{name}"), name
    for ctrl in ("memory", "pids"):
        if sandbox_cgroup.own_cgroup(ctrl) is not None:  # a fresh cgroup of its own, wherever one can be made
            assert any(f":{ctrl}:" in line and "treadle-sandbox-" in line for line in found["cgroups"]) or \
                any(line.startswith("0::") and "treadle-sandbox-" in line for line in found["cgroups"]), found
    assert (found["work_mb"], found["tmpdir_mb"], found["tmp_mb"], found["shm_mb"]) == \
        (limits.work_mb, limits.work_mb, limits.tmp_mb, limits.tmp_mb)
    assert found["sockets"] == [1, 1, 1] and found["host"] == []  # EPERM for every family; no host file


def _default_cpu(limits: SandboxLimits) -> int:
    return limits.cpu_s or math.ceil(limits.timeout_s) + 1


def _last_json(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, text
    return json.loads(lines[-1])


# -- the launchers ---------------------------------------------------------------------------------------------
@needs_sandbox
def test_run_command_and_run_python():
    code = PROBE + "import json\nprint(json.dumps(_probe()))\n"
    r = sandbox.run_command([sys.executable, "-I", "-c", code], limits=LIMITS)
    _check(_last_json(r.stdout), LIMITS, _default_cpu(LIMITS))
    r = sandbox.run_python(code, limits=LIMITS)
    _check(_last_json(r.stdout), LIMITS, _default_cpu(LIMITS))


@needs_sandbox
@pytest.mark.parametrize("mode", ["userns", "root"])
def test_each_isolation_mode(monkeypatch, mode):
    if mode == "root" and os.geteuid() != 0:
        pytest.skip("the root isolation mode needs root")
    if mode == "userns" and sandbox.isolation_mode() != "userns":
        pytest.skip("unprivileged user namespaces are not available here (the sandbox runs in root mode)")
    monkeypatch.setattr(sandbox, "isolation_mode", lambda: mode)
    r = sandbox.run_python(PROBE + "import json\nprint(json.dumps(_probe()))\n", limits=LIMITS)
    assert r.isolation == mode
    _check(_last_json(r.stdout), LIMITS, _default_cpu(LIMITS))


@needs_sandbox
def test_start_process():
    code = PROBE + "import json\nprint(json.dumps(_probe()), flush=True)\nimport time\ntime.sleep(30)\n"
    p = sandbox.start_process([sys.executable, "-I", "-c", code], limits=LIMITS, cpu_s=17)
    try:
        _check(json.loads(p.proc.stdout.readline()), LIMITS, 17)
        if p.memory_limited == "cgroup":  # the host side of the same cgroup: its limit is memory_mb
            d = p._cgroups.memory
            limit = next(Path(d, n).read_text() for n in ("memory.max", "memory.limit_in_bytes") if Path(d, n).exists())
            assert int(limit) == LIMITS.memory_mb << 20
    finally:
        p.kill()


@pytest.fixture
def run_results(monkeypatch):
    """Every SandboxResult of treadle.sandbox.run_command (what run_python and its callers go through)."""
    seen = []
    real = sandbox.run_command

    def spy(*args, **kwargs):
        r = real(*args, **kwargs)
        seen.append(r)
        return r

    monkeypatch.setattr(sandbox, "run_command", spy)
    return seen


@needs_sandbox
def test_rsi_coding_verifier(run_results):
    from treadle.rsi.coding import CodingTask, run_tests

    task = CodingTask(seed_id="probe/0", prompt="def f():\n    \"\"\"One.\"\"\"\n", entry_point="f",
                      tests="def check(c):\n    assert c() == 1\n", reference="    return 1\n")
    solution = "def f():\n    return 1\n" + PROBE + "import json, sys\nsys.stderr.write(json.dumps(_probe()) + '\\n')\n"
    run_tests(task, solution, LIMITS)
    [r] = run_results
    _check(_last_json(r.stderr), LIMITS, _default_cpu(LIMITS))


@needs_sandbox
def test_synthesis_validation_backend_process(run_results):
    from treadle.weft.evolve.synth_validate import Backend, Check, Checks, Design, Schema, validate

    design = Design(entities=["t"], tasks=["probe"], tools=[{"name": "probe", "description": "probe", "reads": ["t"]}])
    backend = PROBE + "import json, sys\nsys.stderr.write(json.dumps(_probe()) + '\\n')\ndef probe(db):\n    return 1\n"
    validate(design, Schema(ddl="CREATE TABLE t (x INTEGER);"), Backend(source=backend),
             Checks(checks=[Check(tool="probe")]), limits=LIMITS)
    [r] = run_results
    _check(_last_json(r.stderr), LIMITS, _default_cpu(LIMITS))  # the generated backend's own process


@needs_sandbox
@pytest.mark.parametrize("worker", ["call", "session"])
def test_served_synthesised_environment(worker):
    from treadle.weft.evolve.synth_serve import server_source, synth_env
    from treadle.weft.evolve.synth_validate import Backend, Design, Schema
    from treadle.weft.runtime import Runtime

    design = Design(entities=["t"], tasks=["probe"], tools=[{"name": "probe", "description": "probe", "reads": ["t"]}])
    result = SimpleNamespace(accepted=True, design=design, schema_=Schema(ddl="CREATE TABLE t (x INTEGER);"),
                             backend=Backend(source=PROBE + "def probe(db):\n    return _probe()\n"))
    src = server_source(result, "probe_env", limits=LIMITS, worker=worker, worker_lifetime_s=30)

    async def main():
        async with Runtime() as rt:
            env = await synth_env(rt, src)
            sid = await rt.create_session(env.server_hash, env.snapshot)
            out = await rt.call_tool(sid, "probe", {})
            assert out.ok, out
            return out.result

    found = anyio.run(main)
    _check(found, LIMITS, _default_cpu(LIMITS) if worker == "call" else 31)


# -- the list of launchers is complete -------------------------------------------------------------------------
COVERED = {  # module -> what it starts sandboxed processes with (each exercised above)
    "rsi/coding.py": {"run_python("},
    "weft/evolve/synth_validate.py": {"run_python("},
    "weft/evolve/synth_serve.py": {"run_python(", "session_worker("},
    "weft/evolve/synth_worker.py": {"start_process(", "SandboxWorker("},
}
_LAUNCH = re.compile(r"\b(run_command\(|run_python\(|start_process\(|SandboxWorker\(|session_worker\(|_launch\(|"
                     r"[\"']unshare[\"'])")


def test_every_launcher_in_the_code_base_is_covered():
    root = Path(sandbox.__file__).parent
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in ("sandbox.py", "sandbox_cgroup.py"):
            continue
        for line in path.read_text().splitlines():
            code = line.split("#", 1)[0]
            if re.match(r"\s*(def|class) ", code):
                continue
            for m in _LAUNCH.finditer(code):
                if "``" not in code and ":func:" not in code and ":class:" not in code:
                    found.setdefault(rel, set()).add(m.group(1))
    assert found == COVERED, ("a module starts sandboxed processes in a way this file does not test; add a test "
                              f"that reads its child's limits from inside, then list it in COVERED: {found}")

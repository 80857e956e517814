"""Check chosen mutants of a measured area against chosen tests, without a whole mutmut run.

Usage (after ``tests/mutation/mutate.py AREA`` has made ``build/mutate/AREA/``)::

    python tests/mutation/check_mutants.py AREA [--survivors] [NAME ...] [--tests FILE ...] [-k EXPR]

``--survivors`` takes every mutant that mutmut's last run of AREA left alive ("survived" or "no
tests"); NAMEs add more (a NAME ending in ``*`` is a prefix). The tests default to the area's tests
(``mutate.py --list``) plus any given with ``--tests``; the repo's ``tests/`` is copied into the
scratch folder first, so new test files are seen. Like mutmut, the package and pytest are imported
once and each mutant runs in a forked child with ``MUTANT_UNDER_TEST`` set; a mutant is killed when
the child's pytest fails (or runs past ``--timeout`` seconds). Prints one line per mutant and writes
``build/mutate/AREA/check.json`` (killed / survived names). Used to confirm that a new test kills the
survivors it was written for, and that a survivor listed as equivalent passes every test.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from mutate import AREAS, REPO  # noqa: E402


def _statuses(work: Path) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True, check=True)
    res = {}
    for line in out.stdout.splitlines():
        if ":" in line:
            name, status = (s.strip() for s in line.rsplit(":", 1))
            res[name] = status
    return res


def _run_one(name: str, args: list[str], timeout: float) -> str:
    pid = os.fork()
    if pid == 0:  # child: run pytest quietly with the mutant switched on
        os.environ["MUTANT_UNDER_TEST"] = name
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        import pytest

        os._exit(int(pytest.main(args)))
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return "survived" if code == 0 else ("killed" if code in (1, 2, 3) or code < 0 else f"error rc={code}")
        if time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.05)


class _InProcess:
    """pytest plugin: after collection, runs the selected tests once per mutant in this process (the
    trampolines read ``MUTANT_UNDER_TEST`` at each call), stopping a mutant at its first failing test.
    Far faster than a fork and a fresh pytest session per mutant; state a mutant leaves behind (a
    cache) could leak into the next, so a surprising result is worth rechecking with the fork mode."""

    def __init__(self, names, timeout, out):
        self.names, self.timeout, self.out, self.result = names, timeout, out, {}

    def pytest_runtestloop(self, session):
        from _pytest.runner import runtestprotocol

        items = session.items
        for i, name in enumerate(self.names, 1):
            os.environ["MUTANT_UNDER_TEST"] = name
            start, status = time.monotonic(), "survived"
            for j, item in enumerate(items):
                reports = runtestprotocol(item, log=False, nextitem=items[j + 1] if j + 1 < len(items) else None)
                if any(r.failed for r in reports):
                    status = "killed"
                    break
                if time.monotonic() - start > self.timeout:
                    status = "timeout"
                    break
            # tear down whatever the last item left (module fixtures) before the next mutant
            session._setupstate.teardown_exact(None)
            self.result.setdefault(status, []).append(name)
            print(f"[{i}/{len(self.names)}] {name}: {status}", file=self.out, flush=True)
        os.environ["MUTANT_UNDER_TEST"] = ""
        return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("area", choices=list(AREAS))
    p.add_argument("names", nargs="*", help="mutant names (a trailing * matches a prefix)")
    p.add_argument("--survivors", action="store_true", help="every mutant the last mutmut run left alive")
    p.add_argument("--tests", nargs="*", default=[], help="more test files (relative to the repo)")
    p.add_argument("--only", action="store_true", help="run only the --tests files, not the area's own tests")
    p.add_argument("-k", default=None, help="pytest -k expression (default: the area's own selection)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--in-process", action="store_true",
                   help="one pytest session for all mutants (fast; see _InProcess) instead of a fork per mutant")
    a = p.parse_args(argv)

    work = REPO / "build" / "mutate" / a.area
    mutants = work / "mutants"
    if not mutants.exists():
        p.error(f"{mutants} does not exist; run tests/mutation/mutate.py {a.area} first")
    shutil.copytree(REPO / "tests", mutants / "tests", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    statuses = _statuses(work)
    chosen = [n for n, s in statuses.items() if s in ("survived", "no tests")] if a.survivors else []
    for n in a.names:
        chosen += [m for m in statuses if (m.startswith(n[:-1]) if n.endswith("*") else m == n)]
    chosen = list(dict.fromkeys(chosen))
    files, tests, select = AREAS[a.area]
    tests = ([] if a.only else [t for t in tests if (REPO / t).exists()]) + a.tests
    if a.k is not None:
        select = ["-k", a.k]
    args = [*tests, *select, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]

    os.chdir(mutants)
    sys.path.insert(0, str(mutants / "src"))
    os.environ.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="",
                      PYTHONPATH=str(mutants / "src"))
    import importlib

    import pytest  # noqa: F401  (imported once, like mutmut does, so each child starts warm)
    import torch  # noqa: F401

    for f in files:  # the mutated modules are large (every mutant's copy): compile them once, here
        importlib.import_module(f[:-3].replace("/", "."))

    if a.in_process:
        plugin = _InProcess(chosen, a.timeout, os.fdopen(os.dup(1), "w"))  # pytest captures fd 1 itself
        pytest.main([a for a in args if a != "-x"], plugins=[plugin])
        (work / "check.json").write_text(json.dumps(plugin.result, indent=1))
        print({k: len(v) for k, v in plugin.result.items()})
        return 0
    result: dict[str, list[str]] = {}
    for i, name in enumerate(chosen, 1):
        status = _run_one(name, args, a.timeout)
        result.setdefault(status, []).append(name)
        print(f"[{i}/{len(chosen)}] {name}: {status}", flush=True)
    (work / "check.json").write_text(json.dumps(result, indent=1))
    print({k: len(v) for k, v in result.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

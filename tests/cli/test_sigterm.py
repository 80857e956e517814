"""SIGTERM (``kill PID``, ``timeout``) acts as Ctrl-C in every ``treadle`` command: the run is recorded as
interrupted, the command says what was saved and how to resume, and child processes are stopped."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest


def _default_sigterm() -> None:
    """``preexec_fn``: SIGTERM at its default in the child (an ignored signal would be inherited across exec)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])


def _wait_for(pred, timeout, proc=None, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command exited {proc.returncode} before {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# a demo whose only section sleeps (started through the real entry point, treadle.cli:main)
SLEEPY_DEMO = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import treadle.demo as demo
    def sleepy(run_dir, quick, console):
        Path(run_dir).mkdir(parents=True)
        (Path(run_dir) / "started").write_text("")
        time.sleep(120)
    mod = type(sys)("sleepy_section"); mod.run = sleepy; sys.modules["sleepy_section"] = mod
    demo.SECTIONS[:] = [("sleepy", "sleepy_section:run")]
    sys.argv = ["treadle", "demo", "--sections", "sleepy", "--out", sys.argv[1]]
    from treadle.cli import main
    main()
""")


def test_sigterm_records_the_run_as_interrupted(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SLEEPY_DEMO, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_default_sigterm,
                            env={**os.environ, "TREADLE_CACHE": str(tmp_path / "cache"), "COLUMNS": "300"})
    try:
        _wait_for(lambda: (out / "sleepy" / "started").exists(), 120, proc, "the section started")
        assert json.loads((out / "run.json").read_text())["status"] == "running"
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, text
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert "Interrupted. Saved:" in text and "rerun" in text and "Traceback" not in text, text


def test_sigterm_ignored_by_the_parent_stays_ignored():
    code = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); from treadle.cli import "
            "_sigterm_as_interrupt; _sigterm_as_interrupt(); print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "True", res.stderr


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
@pytest.mark.parametrize("phase", ["starting", "serving"])
def test_sigterm_to_llm_serve_stops_transformers_serve(tmp_path, phase):
    from treadle.llm.server import _healthy, free_port
    from treadle.llm.tiny_checkpoint import save_untrained_checkpoint

    path, _ = save_untrained_checkpoint(tmp_path / "ckpt")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "treadle", "llm", "serve", "--model", str(path), "--port",
                             str(port), "--startup-timeout", "300"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_default_sigterm,
                            env={**os.environ, "TREADLE_CACHE": str(tmp_path / "cache"), "COLUMNS": "300"})
    kids: list[int] = []
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        if phase == "serving":
            _wait_for(lambda: any("base URL" in ln for ln in lines), 300, proc, "the server was up")
            assert _healthy(f"http://127.0.0.1:{port}/health")
        else:
            _wait_for(lambda: bool(_children(proc.pid)), 120, proc, "transformers serve was started")
        kids = _children(proc.pid)
        assert kids
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        reader.join(10)
        text = "".join(lines)
        _wait_for(lambda: not any(_alive(k) for k in kids), 30, None, f"the server child(ren) {kids} to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)
    assert "Traceback" not in text and ("stopping" if phase == "serving" else "Interrupted") in text, text

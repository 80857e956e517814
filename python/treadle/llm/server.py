"""A real local OpenAI-compatible endpoint: ``transformers serve`` (the ``transformers[serving]`` extra:
FastAPI + Uvicorn) on 127.0.0.1 over a local checkpoint, the embedded tiny model by default.

``transformers serve PATH`` pins the server to that checkpoint; requests must name the model exactly
as ``PATH`` (:attr:`LocalServer.model`). It serves ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` and ``/health``; it ignores ``n``, ``logprobs`` and ``response_format`` (the client
asks for one sample per request and extracts JSON tolerantly, so neither matters). Without
``continuous_batching`` it decodes one request at a time.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LocalServer", "ServerStartError", "local_server", "resolve_model_path", "free_port"]


class ServerStartError(RuntimeError):
    """The local server exited or did not become healthy in time (the message holds its log's tail)."""


@dataclass(frozen=True)
class LocalServer:
    """A running local server: ``base_url`` (``http://127.0.0.1:PORT/v1``), ``model`` (the name requests
    must use), ``pid`` of the server process, ``log`` file path."""

    base_url: str
    model: str
    pid: int
    log: Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """The checkpoint folder to serve: ``model``, else ``$TREADLE_MODEL``, else the embedded tiny model
    (trained on first use, see ``treadle model train-tiny``). Raises ``FileNotFoundError`` /
    :class:`treadle.models.CheckpointError` for a missing or unusable folder."""
    from treadle.models.tiny import check_checkpoint, default_checkpoint_dir, train_tiny

    if model is None and os.environ.get("TREADLE_MODEL"):
        model = os.environ["TREADLE_MODEL"]
    if model is None:
        p = default_checkpoint_dir()
        if not p.exists():
            train_tiny(None, p)
    else:
        p = Path(model).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"no model checkpoint at {p}")
    check_checkpoint(p)
    return p.resolve()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    # SIGTERM, not SIGINT: uvicorn shuts down gracefully on both, and a SIGINT that the parent ignores (a
    # script that runs us with `&`) is inherited as ignored by the server, which would then sit out the grace
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextlib.contextmanager
def local_server(model: str | os.PathLike | None = None, *, port: int | None = None, host: str = "127.0.0.1",
                 startup_timeout_s: float = 180.0, device: str = "cpu", continuous_batching: bool = False,
                 log: str | os.PathLike | None = None):
    """Start ``transformers serve`` over ``model`` on ``host:port``, wait for ``/health``, yield a
    :class:`LocalServer`, stop it on exit (SIGTERM, then SIGKILL after 10 s).

    Args:
        model: local checkpoint folder (see :func:`resolve_model_path`; None -> the embedded tiny model).
        port: TCP port (None -> a free one). host: bind address (loopback by default).
        startup_timeout_s: how long to wait for ``/health``.
        device: torch device of the server (``cpu``, ``cuda:0``, ``auto``).
        continuous_batching: ``--continuous-batching`` (paged attention; concurrent requests are decoded
            together instead of one after another; its first request is slow while it warms up).
        log: file for the server's output (default: a temp file).

    Raises:
        ServerStartError: the server exited or was not healthy within ``startup_timeout_s``.
        FileNotFoundError / CheckpointError: ``model`` is missing or not a usable checkpoint.
    """
    path = resolve_model_path(model)
    port = free_port(host) if port is None else int(port)
    if log is None:
        fd, name = tempfile.mkstemp(prefix="treadle-llm-serve-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    else:
        log_path = Path(log)
    cmd = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; "
           "sys.argv[0] = 'transformers'; sys.exit(main())",
           "serve", str(path), "--host", host, "--port", str(port), "--device", device]
    if continuous_batching:
        cmd.append("--continuous-batching")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        health = f"http://{host}:{port}/health"
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(health):
            if proc.poll() is not None:
                raise ServerStartError(f"transformers serve exited with code {proc.returncode} before becoming "
                                       f"healthy; log {log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"transformers serve not healthy at {health} after {startup_timeout_s:.0f} s; "
                                       f"log {log_path}:\n{_tail(log_path)}")
            time.sleep(0.25)
        yield LocalServer(base_url=f"http://{host}:{port}/v1", model=str(path), pid=proc.pid, log=log_path)
    except BaseException:
        _stop(proc)
        raise  # the log (named in the message) is kept for a failed start or run
    _stop(proc)
    if log is None:
        log_path.unlink(missing_ok=True)

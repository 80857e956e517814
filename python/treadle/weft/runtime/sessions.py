"""A session's bookkeeping and the binding of sessions to a connected MCP server (runtime-internal)."""
from __future__ import annotations

import socket
import subprocess
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from mcp import Client

from treadle.weft.runtime.checkpoint import CheckpointRecord
from treadle.weft.runtime.determinism import SessionEnv
from treadle.weft.runtime.registry import ServerSpec
from treadle.weft.runtime.records import LogEntry
from treadle.weft.runtime.server import ToolError, WeftServer
from treadle.weft.runtime.state import Snapshot, StateBackend
from treadle.untrusted import loads_json

Transport = Literal["inproc", "stdio", "http"]
TRANSPORTS = ("inproc", "stdio", "http")


@dataclass(eq=False)
class _Binding:
    """A connected MCP client plus what it serves (one shared server, or one session)."""

    spec: ServerSpec
    transport: Transport
    module: types.ModuleType | None = None
    weft: WeftServer | None = None
    states: dict[str, Any] = field(default_factory=dict)  # session id -> state handle (inproc)
    envs: dict[str, SessionEnv] = field(default_factory=dict)  # session id -> its clock and random source
    client: Client | None = None
    closed: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    dead: str = ""  # why the connection is gone (crash), "" while alive
    process: subprocess.Popen | None = None
    tmpdir: tempfile.TemporaryDirectory | None = None
    tmpdir_args: list[str] = field(default_factory=list)  # serve.py arguments (remote transports)
    url: str = ""  # streamable HTTP endpoint (http transport)
    task_started: bool = False

    def resolve(self, sid: str | None) -> Any:
        try:
            return self.states[sid]
        except KeyError:
            raise ToolError(f"unknown or closed session {sid!r}") from None

    def resolve_env(self, sid: str | None) -> SessionEnv | None:
        return self.envs.get(sid)


@dataclass(eq=False)
class _Session:
    id: str
    spec: ServerSpec
    transport: Transport
    initial: Snapshot
    binding: _Binding
    state: StateBackend | None  # None for remote transports
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    log: list[LogEntry] = field(default_factory=list)
    closed: bool = False
    generation: int | None = None  # checkpoint generation owned by this runtime
    fenced: bool = False  # a newer generation took the session over: stop writing
    interrupted: bool = False
    turn: int | None = None
    dirty_at: float | None = None
    flushing: int = 0  # flushes in progress or waiting for flush_lock
    flush_lock: anyio.Lock = field(default_factory=anyio.Lock)  # one flush at a time, in order
    flusher: bool = False  # a debounce loop is running
    last_checkpoint: CheckpointRecord | None = None
    available: frozenset[str] | None = None  # tools offered to the agent now (None: all)
    busy: bool = False  # a tool call is in flight (views of the state would be half-done)
    # remote transports: the successful calls since the initial snapshot (name, arguments, result), replayed
    # on a restarted server process to roll an abandoned call back to the state before it
    replay: list[tuple[str, dict[str, Any], Any]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result_payload(res: Any) -> tuple[Any, str]:
    text = "".join(getattr(c, "text", "") for c in (res.content or []))
    if res.structured_content is not None:
        return res.structured_content, text
    try:  # a tool result is server output: nesting bounded, an over-long integer is text, never a raise
        return loads_json(text, duplicates=True, what="tool result"), text
    except ValueError:
        return text, text

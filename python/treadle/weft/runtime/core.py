"""The :class:`Runtime`: lifetime, server bindings, sessions (create, fork, diff, reset, close) and
tool dispatch (argument checks, transactions, time limits, statistics). Checkpoints and verification
are mixed in from :mod:`~treadle.weft.runtime.checkpointing` and
:mod:`~treadle.weft.runtime.verification`."""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from contextlib import AsyncExitStack, nullcontext
from pathlib import Path
from typing import Any, Literal

import anyio
import jsonschema
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from treadle.weft.runtime.callparse import ToolCall, parse_call
from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.errors import (
    CallParseError,
    ErrorKind,
    SessionBusyError,
    SessionClosedError,
    UnknownSessionError,
    UnsupportedOperationError,
    WeftError,
)
from treadle.weft.runtime.registry import Registry, ServerSpec, release_module
from treadle.weft.runtime.checkpointing import CheckpointingMixin
from treadle.weft.runtime.records import LogEntry, ToolOutcome
from treadle.weft.runtime.sessions import TRANSPORTS, Transport, _Binding, _Session, free_port, result_payload
from treadle.weft.runtime.verification import VerificationMixin
from treadle.weft.runtime.server import SESSION_META_KEY
from treadle.weft.runtime.state import Snapshot, StateBackend, StateDiff
from treadle.weft.runtime.stats import ToolStats

__all__ = ["Runtime", "Transport"]



class Runtime(CheckpointingMixin, VerificationMixin):
    """Sessions, tool dispatch, statistics and checkpoints over a :class:`Registry`.

    Args:
        registry: server registry (a new empty one by default).
        checkpoint_store: where mutating sessions are checkpointed (None: no checkpoints).
        debounce_s: quiet time after the last mutating call before a checkpoint is written (seconds).
        timeout_s: per-call limit in seconds. A call past it is abandoned at the limit (outcome
            ``timeout``): the session is detached from it and rolled back to its state before the call
            (in-process: from a snapshot taken before the call; an isolated server also gets a fresh
            module import). Remote sessions (stdio/http) keep the same contract by replay: their server
            process is killed, restarted from the initial snapshot, and the session's earlier successful
            calls are replayed (the session clock and random source start over with the snapshot, so
            tools that use them replay exactly); when a replayed call returns something else than the
            first time (a tool reading the process clock), the session is left at its initial snapshot
            and the outcome's text says so. Sync tools run on the event
            loop's bounded worker-thread pool (``max_threads``), async tools concurrently.
        transport: default transport of new sessions.
        max_threads: worker threads for sync tools (the event loop's default thread limiter), >= 1.

    Use as ``async with Runtime(...) as rt``: the runtime owns a task group (client connections,
    checkpoint writers) for its lifetime.
    """

    def __init__(self, registry: Registry | None = None, *, checkpoint_store: CheckpointStore | None = None,
                 debounce_s: float = 0.05, timeout_s: float = 10.0, transport: Transport = "inproc",
                 max_threads: int = 40):
        if registry is not None and not isinstance(registry, Registry):
            raise TypeError(f"registry must be a treadle.weft.runtime.registry.Registry, got {type(registry).__name__}")
        if checkpoint_store is not None and not isinstance(checkpoint_store, CheckpointStore):
            raise TypeError(f"checkpoint_store must be a CheckpointStore, got {type(checkpoint_store).__name__}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(debounce_s, (int, float)) and debounce_s >= 0):
            raise ValueError(f"debounce_s must be >= 0 seconds, got {debounce_s!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(max_threads, int) or isinstance(max_threads, bool) or max_threads < 1:
            raise ValueError(f"max_threads must be an int >= 1 (worker threads for sync tools), got {max_threads!r}")
        self.max_threads = max_threads
        self.registry = registry or Registry()
        self.store = checkpoint_store
        self.debounce_s = float(debounce_s)
        self.timeout_s = float(timeout_s)
        self.transport: Transport = transport
        self.stats = ToolStats()
        self.events: list[LogEntry] = []  # runtime-level events (registration and creation failures)
        self._sessions: dict[str, _Session] = {}
        self._closed_logs: dict[str, list[LogEntry]] = {}  # closed with keep_log=True
        self._shared: dict[str, _Binding] = {}
        self._shared_lock = anyio.Lock()
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
        self._schema_ok: weakref.WeakKeyDictionary[Snapshot, set[str]] = weakref.WeakKeyDictionary()
        self._hidden: set[str] = set()  # verifier-private sessions: not in stats, dropped after use
        self._server_locks: dict[str, anyio.Lock] = {}
        self._seq = 0
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    # -- lifetime ------------------------------------------------------------------------------
    async def __aenter__(self) -> Runtime:
        anyio.to_thread.current_default_thread_limiter().total_tokens = self.max_threads  # this event loop's pool
        self._stack = AsyncExitStack()
        await self._stack.__aenter__()
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            for sid in [s.id for s in self._sessions.values() if not s.closed]:
                try:
                    await self.close(sid)
                except Exception as err:  # noqa: BLE001  (close every session even if one fails)
                    self._event(None, event="close", ok=False, error_kind=ErrorKind.infrastructure,
                                message=f"{sid}: {type(err).__name__}: {err}")
            for b in list(self._shared.values()):
                await self._close_binding(b)
            self._shared.clear()
        finally:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            stack, self._stack, self._tg = self._stack, None, None
            if stack is not None:
                await stack.__aexit__(*exc)

    def _require_open(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise RuntimeError("use the runtime inside `async with Runtime(...) as rt:`")
        return self._tg

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _event(self, session: _Session | None, **kw: Any) -> LogEntry:
        entry = LogEntry(seq=self._next_seq(), time=time.time(), session_id=session.id if session else None, **kw)
        (session.log if session is not None else self.events).append(entry)
        return entry

    # -- registry ------------------------------------------------------------------------------
    def register(self, server: Any, *, isolation: Literal["shared", "isolated"] | None = None) -> str:
        """Register a server module (see :meth:`Registry.register`); failures are also logged in ``events``."""
        try:
            h = self.registry.register(server, isolation=isolation)
        except WeftError as err:
            self._event(None, event="register", ok=False, error_kind=ErrorKind.infrastructure,
                        message=f"{type(err).__name__}: {err}")
            raise
        self._event(None, event="register", message=h)
        return h

    # -- bindings ------------------------------------------------------------------------------
    async def _binding_task(self, b: _Binding, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        started = False
        try:
            async with AsyncExitStack() as stack:
                if b.transport == "inproc":
                    target: Any = b.weft.build(b.resolve, b.resolve_env)
                elif b.transport == "stdio":
                    params = StdioServerParameters(command=sys.executable, args=b.tmpdir_args, env=dict(os.environ))
                    target = stdio_client(params, errlog=stack.enter_context(open(os.devnull, "w")))  # noqa: SIM115
                else:
                    target = b.url
                b.client = await stack.enter_async_context(Client(target, read_timeout_seconds=None))
                task_status.started()
                started = True
                await b.closed.wait()
        except Exception as err:  # noqa: BLE001  (a dying server must not take the runtime down)
            b.dead = f"{type(err).__name__}: {err}"
            if not started:
                raise
        finally:
            b.done.set()

    async def _open_binding(self, b: _Binding) -> _Binding:
        tg = self._require_open()
        if b.transport == "http":
            await self._spawn_http(b)
        b.task_started = True
        await tg.start(self._binding_task, b)
        return b

    async def _close_binding(self, b: _Binding) -> None:
        b.closed.set()
        if b.task_started:
            with anyio.move_on_after(10):
                await b.done.wait()
        if b.process is not None and b.process.poll() is None:
            b.process.terminate()
            try:
                await anyio.to_thread.run_sync(b.process.wait, 10)
            except subprocess.TimeoutExpired:
                b.process.kill()
        if b.module is not None:
            release_module(b.module)
        if b.tmpdir is not None:
            b.tmpdir.cleanup()

    async def _shared_binding(self, spec: ServerSpec) -> _Binding:
        async with self._shared_lock:
            b = self._shared.get(spec.hash)
            if b is None or b.dead:
                module, weft = self.registry.load(spec.hash)
                b = await self._open_binding(_Binding(spec=spec, transport="inproc", module=module, weft=weft))
                self._shared[spec.hash] = b
            return b

    def _write_remote_files(self, b: _Binding, sid: str, snapshot: Snapshot) -> list[str]:
        b.tmpdir = tempfile.TemporaryDirectory(prefix="weft-session-")
        d = Path(b.tmpdir.name)
        (d / "server.py").write_text(b.spec.source, encoding="utf-8")
        (d / "snapshot.bin").write_bytes(snapshot.data)
        return ["-m", "treadle.weft.runtime.serve", "--server-file", str(d / "server.py"), "--snapshot",
                str(d / "snapshot.bin"), "--kind", snapshot.kind, "--session-id", sid,
                "--env", json.dumps(snapshot.env.as_dict())]

    async def _spawn_http(self, b: _Binding) -> None:
        port = free_port()
        b.process = subprocess.Popen([sys.executable, *b.tmpdir_args, "--transport", "http", "--port", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        b.url = f"http://127.0.0.1:{port}/mcp"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if b.process.poll() is not None:
                raise WeftError(f"HTTP server for session exited with code {b.process.returncode} before listening")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                await anyio.sleep(0.05)
        b.process.kill()
        raise WeftError(f"HTTP server did not listen on 127.0.0.1:{port} within 30 s")

    async def _bind_session(self, spec: ServerSpec, sid: str, transport: Transport, snapshot: Snapshot,
                            state: StateBackend | None) -> tuple[_Binding, StateBackend | None]:
        """Connect a session: returns its binding and its in-process state (built if ``state`` is None)."""
        if transport == "inproc":
            if spec.isolation == "shared":
                b = await self._shared_binding(spec)
            else:
                module, weft = self.registry.load(spec.hash)
                b = await self._open_binding(_Binding(spec=spec, transport="inproc", module=module, weft=weft))
            if state is None:
                state = b.weft.new_state(snapshot)
            b.states[sid] = state.handle
            b.envs[sid] = state.env
            return b, state
        b = _Binding(spec=spec, transport=transport)
        b.tmpdir_args = self._write_remote_files(b, sid, snapshot)
        try:
            await self._open_binding(b)
        except BaseException:
            await self._close_binding(b)
            raise
        return b, None

    async def _unbind(self, s: _Session) -> None:
        s.binding.states.pop(s.id, None)
        s.binding.envs.pop(s.id, None)
        if s.binding is not self._shared.get(s.spec.hash):
            await self._close_binding(s.binding)

    # -- sessions ------------------------------------------------------------------------------
    def _check_snapshot(self, spec: ServerSpec, snapshot: Snapshot) -> None:
        if spec.hash in self._schema_ok.get(snapshot, ()):
            return
        if spec.hash in self._shared:
            self._shared[spec.hash].weft.check_snapshot(snapshot)
        else:
            module, weft = self.registry.load(spec.hash)
            try:
                weft.check_snapshot(snapshot)
            finally:
                release_module(module)
        self._schema_ok.setdefault(snapshot, set()).add(spec.hash)

    async def create_session(self, server_hash: str, snapshot: Snapshot, *, session_id: str | None = None,
                             transport: Transport | None = None) -> str:
        """Open a session of a registered server with private state cloned from ``snapshot``.

        Args:
            server_hash: hash returned by :meth:`register` (or a unique prefix).
            snapshot: the immutable initial state; checked against the server's schema (once per
                server and snapshot object).
            session_id: optional id (``[A-Za-z0-9_-]``); a random one by default.
            transport: ``"inproc"`` / ``"stdio"`` / ``"http"`` (default: the runtime's).

        Returns:
            The session id.

        Raises:
            UnknownServerError: no such server.
            TypeError: ``snapshot`` is not a Snapshot.
            SnapshotSchemaError: the snapshot does not match the server's schema.
            ValueError: bad ``session_id`` / ``transport``, or the id is in use.
            ServerImportError / WeftError: the server could not be started (also logged in ``events``).
        """
        self._require_open()
        spec = self.registry.spec(server_hash)
        transport = transport or self.transport
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"snapshot must be a treadle.weft.runtime.state.Snapshot, got {type(snapshot).__name__}")
        sid = session_id or uuid.uuid4().hex[:16]
        if not isinstance(sid, str) or not sid.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"session_id must be letters, digits, '-' and '_', got {sid!r}")
        if sid in self._sessions and not self._sessions[sid].closed:
            raise ValueError(f"session id {sid!r} is already open")
        try:
            self._check_snapshot(spec, snapshot)
            binding, state = await self._bind_session(spec, sid, transport, snapshot, None)
        except WeftError as err:
            self._event(None, event="create", ok=False, error_kind=ErrorKind.infrastructure,
                        message=f"{spec.hash[:12]}: {type(err).__name__}: {err}")
            raise
        s = _Session(id=sid, spec=spec, transport=transport, initial=snapshot, binding=binding, state=state)
        self._sessions[sid] = s
        self._closed_logs.pop(sid, None)
        self._event(s, event="create", message=f"server {spec.name} {spec.hash[:12]} via {transport}")
        return sid

    def _session(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            if session_id in self._closed_logs:
                raise SessionClosedError(f"session {session_id!r} is closed")
            raise UnknownSessionError(f"no session {session_id!r} (closed sessions are forgotten unless closed "
                                      f"with keep_log=True)")
        if s.closed:
            raise SessionClosedError(f"session {session_id!r} is closed")
        return s

    def sessions(self) -> list[str]:
        """Ids of the open sessions."""
        return [sid for sid, s in self._sessions.items() if not s.closed]

    def server_of(self, session_id: str) -> ServerSpec:
        return self._session(session_id).spec

    def log(self, session_id: str) -> list[LogEntry]:
        """The session's log (a copy); after close only if it was closed with ``keep_log=True``."""
        s = self._sessions.get(session_id)
        if s is None:
            if session_id in self._closed_logs:
                return list(self._closed_logs[session_id])
            raise UnknownSessionError(f"no session {session_id!r}")
        return list(s.log)

    def is_interrupted(self, session_id: str) -> bool:
        """True when the session was restored from a checkpoint (its rollout was interrupted)."""
        return self._session(session_id).interrupted

    # -- tool calls ----------------------------------------------------------------------------
    def _validator(self, spec: ServerSpec, tool: dict[str, Any]) -> jsonschema.protocols.Validator:
        key = (spec.hash, tool["name"])
        v = self._validators.get(key)
        if v is None:
            schema = dict(tool["input_schema"])
            schema.setdefault("additionalProperties", False)
            v = jsonschema.Draft202012Validator(schema)
            self._validators[key] = v
        return v

    async def call(self, session_id: str, call: str | ToolCall) -> ToolOutcome:
        """Dispatch a call string (parsed with :func:`~treadle.weft.runtime.callparse.parse_call`) or a ToolCall.

        A string that is not one call with literal arguments gives an ``invalid_args`` outcome.
        """
        if isinstance(call, ToolCall):
            return await self.call_tool(session_id, call.name, call.arguments)
        s = self._session(session_id)
        order = {t["name"]: list(t["input_schema"].get("properties", {})) for t in s.spec.tools}
        try:
            parsed = parse_call(call, param_order=order)
        except (CallParseError, TypeError) as err:
            return self._finish(s, ToolCall(name="<unparsed>", arguments={"text": str(call)[:500]}), None,
                                ErrorKind.invalid_args, f"{err}", None)
        return await self.call_tool(session_id, parsed.name, parsed.arguments)

    async def call_tool(self, session_id: str, name: str, arguments: dict[str, Any] | None = None) -> ToolOutcome:
        """Call tool ``name`` with ``arguments`` in a session; never raises for tool-level failures.

        Arguments are validated against the tool's JSON input schema (no extra properties) before
        dispatch, so ``invalid_args`` and ``unknown_tool`` never touch state. Calls on one session
        are serialised; calls on different sessions run concurrently.

        Raises:
            UnknownSessionError / SessionClosedError: the session does not exist or is closed.
        """
        s = self._session(session_id)
        if not isinstance(name, str):
            return self._finish(s, ToolCall(name=repr(name)), None, ErrorKind.unknown_tool,
                                f"tool name must be a str, got {type(name).__name__}", None)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return self._finish(s, ToolCall(name=name), None, ErrorKind.invalid_args,
                                f"arguments must be a JSON object (dict), got {type(arguments).__name__}", None)
        call = ToolCall(name=name, arguments=arguments)
        tool = s.spec.tool(name)
        if tool is None or (s.available is not None and name not in s.available):
            return self._finish(s, call, None, ErrorKind.unknown_tool,
                                f"unknown tool {name!r}; available: {self.available_tools(session_id)}", None)
        errors = sorted(self._validator(s.spec, tool).iter_errors(arguments), key=lambda e: list(e.path))
        if errors:
            msg = "; ".join(f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors[:5])
            return self._finish(s, call, None, ErrorKind.invalid_args, f"arguments do not match {name}'s schema: {msg}",
                                None)
        server_lock = self._server_lock(s.spec) if s.transport == "inproc" else None
        async with s.lock, (server_lock or nullcontext()):
            if s.closed:
                raise SessionClosedError(f"session {session_id!r} is closed")
            b = s.binding
            if b.dead:
                return self._finish(s, call, None, ErrorKind.crash, f"server connection is gone: {b.dead}", None)
            pre = s.state.snapshot() if s.state is not None else None  # every call is a transaction
            t0 = time.perf_counter()
            s.busy = True
            try:
                with anyio.fail_after(self.timeout_s):
                    res = await b.client.call_tool(name, arguments, meta={SESSION_META_KEY: s.id})
            except TimeoutError:
                lat = (time.perf_counter() - t0) * 1e3
                how = await self._abandon(s, pre)
                return self._finish(s, call, None, ErrorKind.timeout,
                                    f"{name} exceeded {self.timeout_s:g} s: abandoned; {how}", lat)
            except Exception as err:  # noqa: BLE001  (transport failures are typed, never raised)
                lat = (time.perf_counter() - t0) * 1e3
                if b.transport != "inproc":
                    b.dead = b.dead or f"{type(err).__name__}: {err}"
                    if b.process is not None and b.process.poll() is None:
                        b.process.kill()
                    return self._finish(s, call, None, ErrorKind.crash, f"server died during {name}: {b.dead}", lat)
                if pre is not None:
                    s.state.restore(pre)
                return self._finish(s, call, None, ErrorKind.infrastructure, f"{type(err).__name__}: {err}", lat)
            finally:
                s.busy = False
            lat = (time.perf_counter() - t0) * 1e3
            payload, text = result_payload(res)
            late = lat > self.timeout_s * 1e3
            how = "rolled back"
            if (late or res.is_error) and pre is not None:
                s.state.restore(pre)  # object state rolls back like SQLite (and the clock/random source too)
            if late and s.state is None:  # remote: roll back as an abandoned call is
                how = await self._abandon(s, None)
            elif s.state is None and not res.is_error:
                s.replay.append((name, copy.deepcopy(arguments), payload))
        if late:
            return self._finish(s, call, None, ErrorKind.timeout,
                                f"{name} returned after {lat / 1e3:.3g} s > {self.timeout_s:g} s; "
                                + how, lat)
        if res.is_error:
            kind = ErrorKind.invalid_args if "validation error" in text and text.startswith(
                f"Error executing tool {name}: ") else ErrorKind.execution_error
            return self._finish(s, call, None, kind, text, lat)
        out = self._finish(s, call, payload, None, text, lat)
        if tool["contract"]["writes"] and s.state is not None and self.store is not None and not s.fenced:
            self._mark_dirty(s)
        return out

    async def _abandon(self, s: _Session, pre: Snapshot | None) -> str:
        """Detach a session from a call that ran past its time limit (it may still be running and writing):
        in-process sessions get a fresh state from ``pre`` (their state before the call; an isolated
        server also a fresh module import), remote ones a restarted server process (from the initial
        snapshot). Returns what was done, for the outcome's text."""
        if s.transport == "inproc" and pre is not None:
            if s.spec.isolation == "shared":
                new = s.binding.weft.new_state(pre)
                s.binding.states[s.id] = new.handle
                s.binding.envs[s.id] = new.env
                s.state = new  # the abandoned call keeps the old state object; nobody reads it again
            else:
                await self._unbind(s)
                s.binding, s.state = await self._bind_session(s.spec, s.id, "inproc", pre, None)
            self._event(s, event="reset", message="call abandoned at its time limit: state rolled back")
            return "session state rolled back to before the call"
        await self._unbind(s)
        s.binding, s.state = await self._bind_session(s.spec, s.id, s.transport, s.initial, None)
        n = len(s.replay)
        diverged = await self._replay_remote(s)
        if not diverged:
            self._event(s, event="reset", message=f"call abandoned at its time limit: server process restarted, "
                                                  f"{n} earlier call(s) replayed")
            return (f"server process restarted from the initial snapshot and the session's {n} earlier successful "
                    "call(s) replayed: state rolled back to before the call")
        await self._unbind(s)  # the replay does not reproduce the state: start over from the initial snapshot
        s.binding, s.state = await self._bind_session(s.spec, s.id, s.transport, s.initial, None)
        s.replay = []
        self._event(s, event="reset", message=f"call abandoned at its time limit: {diverged}; session reset to "
                                              "its initial snapshot")
        return f"server process restarted; {diverged}: the session was reset to its initial snapshot"

    async def _replay_remote(self, s: _Session) -> str:
        """Replay a remote session's successful calls (``s.replay``) on its fresh server process, each within
        the time limit, outside the log and statistics. Returns "" when every call returned what it
        returned the first time, else why the replay is not faithful (a tool that reads the process
        clock or a global random source, a failure, a timeout)."""
        for k, (name, arguments, expected) in enumerate(s.replay):
            try:
                with anyio.fail_after(self.timeout_s):
                    res = await s.binding.client.call_tool(name, arguments, meta={SESSION_META_KEY: s.id})
            except Exception as err:  # noqa: BLE001  (TimeoutError or a dead server: the replay failed)
                return f"replaying earlier call {k} ({name}) failed: {type(err).__name__}: {err}"
            payload, _ = result_payload(res)
            if res.is_error or payload != expected:
                return f"replaying earlier call {k} ({name}) returned something else than the first time"
        return ""

    def _server_lock(self, spec: ServerSpec) -> anyio.Lock | None:
        """Calls of a server that writes process-global state (``global_write`` findings: ``global``
        statements, attributes of imported modules) are serialised across its in-process sessions:
        a separate module import does not isolate a third-party module's globals."""
        if "global_write" not in spec.report.kinds():
            return None
        lock = self._server_locks.get(spec.hash)
        if lock is None:
            lock = self._server_locks[spec.hash] = anyio.Lock()
        return lock

    def _finish(self, s: _Session, call: ToolCall, result: Any, kind: ErrorKind | None, text: str,
                latency_ms: float | None) -> ToolOutcome:
        entry = self._event(s, event="call", tool=call.name, arguments=call.arguments, ok=kind is None,
                            error_kind=kind, message="" if kind is None else text[:2000], latency_ms=latency_ms)
        if s.id not in self._hidden:
            self.stats.record(s.spec.hash, call.name, latency_ms, kind, server_name=s.spec.name)
        return ToolOutcome(session_id=s.id, seq=entry.seq, call=call, ok=kind is None, result=result, text=text,
                           error_kind=kind, latency_ms=latency_ms)

    async def list_tools(self, session_id: str) -> list[dict[str, Any]]:
        """Tool definitions (name, description, JSON input schema) the session's agent may call, via MCP
        (restricted by :meth:`set_available_tools`)."""
        s = self._session(session_id)
        res = await s.binding.client.list_tools()
        return [{"name": t.name, "description": t.description or "", "input_schema": t.input_schema}
                for t in res.tools if s.available is None or t.name in s.available]

    def set_available_tools(self, session_id: str, names: list[str] | set[str] | None) -> None:
        """Offer only ``names`` to the agent from now on (None: every tool of the server); calls to
        other tools get ``unknown_tool``. E.g. BFCL's functions withheld until a later turn.

        Raises:
            ValueError: a name is not a tool of the session's server.
        """
        s = self._session(session_id)
        if names is None:
            s.available = None
            return
        unknown = set(names) - set(s.spec.tool_names)
        if unknown:
            raise ValueError(f"set_available_tools: {sorted(unknown)} are not tools of server {s.spec.name}")
        s.available = frozenset(names)

    def available_tools(self, session_id: str) -> list[str]:
        """Names of the tools the agent may call in the session now."""
        s = self._session(session_id)
        return [n for n in s.spec.tool_names if s.available is None or n in s.available]

    # -- state operations ----------------------------------------------------------------------
    def _local_state(self, s: _Session, op: str) -> StateBackend:
        if s.state is None:
            raise UnsupportedOperationError(f"{op} needs in-process state; session {s.id} uses {s.transport!r}")
        if s.busy:
            raise SessionBusyError(f"{op} of session {s.id} while a tool call is in flight would see a half-done "
                                   f"call; await rt.idle({s.id!r}) first (or use await rt.snapshot_idle(...))")
        return s.state

    async def idle(self, session_id: str) -> None:
        """Wait until the session has no tool call in flight (views taken right after are consistent)."""
        s = self._session(session_id)
        async with s.lock:
            pass

    async def snapshot_idle(self, session_id: str) -> Snapshot:
        """:meth:`snapshot` taken between calls (waits for a call in flight to finish)."""
        s = self._session(session_id)
        async with s.lock:
            return self._local_state(s, "snapshot").snapshot()

    def state(self, session_id: str) -> Any:
        """The session's state handle (privileged: for verifiers and tests, never exposed to tools)."""
        return self._local_state(self._session(session_id), "state access").handle

    def snapshot(self, session_id: str) -> Snapshot:
        """An immutable snapshot of the session's current state."""
        return self._local_state(self._session(session_id), "snapshot").snapshot()

    def diff(self, session_id: str, other: str | Snapshot | None = None) -> StateDiff:
        """Differences from the session's *initial* snapshot to its current state, or, with ``other``
        (a session id or snapshot), from this session's current state to ``other``."""
        s = self._session(session_id)
        state = self._local_state(s, "diff")
        if other is None:
            base = s.binding.weft.new_state(s.initial)
            try:
                return base.diff(state)
            finally:
                base.close()
        if isinstance(other, str):
            return state.diff(self._local_state(self._session(other), "diff"))
        return state.diff(other)

    async def reset(self, session_id: str) -> None:
        """Restore the session to its initial snapshot (byte-identical state); the log is kept.

        Isolated sessions also get a fresh module import (class attributes start over); remote
        sessions restart their server process.
        """
        s = self._session(session_id)
        async with s.lock:
            if s.transport == "inproc" and s.spec.isolation == "shared":
                s.state.restore(s.initial)
            else:
                await self._unbind(s)
                if s.state is not None:
                    s.state.close()
                s.binding, s.state = await self._bind_session(s.spec, s.id, s.transport, s.initial, None)
            s.replay = []
            s.dirty_at = None
        self._event(s, event="reset")
        if self.store is not None and s.state is not None and not s.fenced:
            self._mark_dirty(s)

    async def fork(self, session_id: str, *, session_id_new: str | None = None) -> str:
        """A new session whose state is a copy of this session's *current* state (same initial snapshot,
        so ``reset`` of the fork returns to the original start) and the same tool offer
        (:meth:`set_available_tools`; changing either session's offer afterwards leaves the other's
        alone). Returns the new id."""
        s = self._session(session_id)
        if s.state is None:
            raise UnsupportedOperationError(f"fork needs in-process state; session {s.id} uses {s.transport!r}")
        sid = session_id_new or uuid.uuid4().hex[:16]
        if sid in self._sessions and not self._sessions[sid].closed:
            raise ValueError(f"session id {sid!r} is already open")
        async with s.lock:  # between calls: never a half-done call's state
            state = self._local_state(s, "fork")
            if s.spec.isolation == "shared":
                new_state = state.fork()
                binding, new_state = await self._bind_session(s.spec, sid, "inproc", s.initial, new_state)
            else:  # own module import; instance state copied from a snapshot of the current state
                binding, new_state = await self._bind_session(s.spec, sid, "inproc", state.snapshot(), None)
        f = _Session(id=sid, spec=s.spec, transport="inproc", initial=s.initial, binding=binding, state=new_state,
                     available=s.available)  # the agent's tool offer is session state the fork inherits
        self._sessions[sid] = f
        self._event(f, event="fork", message=f"forked from {s.id}")
        self._event(s, event="fork", message=f"forked into {sid}")
        return sid

    async def close(self, session_id: str, *, keep_log: bool = False) -> None:
        """Close a session: flush a pending checkpoint, release its state, binding and snapshots.

        Afterwards nothing of the session stays in the runtime (memory is flat over any number of
        create/close cycles) unless ``keep_log=True``: then its log alone stays readable through
        :meth:`log` (until :meth:`forget`) and calls on it raise ``SessionClosedError``; without it,
        the id is unknown (``UnknownSessionError``) and may be reused.
        """
        s = self._session(session_id)
        if s.dirty_at is not None and not s.fenced:
            await self._flush(s)
        async with s.lock:
            s.closed = True
            await self._unbind(s)
            if s.state is not None:
                s.state.close()
        self._event(s, event="close")
        if self._sessions.get(session_id) is s:
            del self._sessions[session_id]
        if keep_log:
            self._closed_logs[session_id] = s.log
        s.state = s.binding = s.initial = s.last_checkpoint = None  # a flusher task may still hold `s`
        s.replay = []

    def forget(self, session_id: str) -> None:
        """Drop the log a closed session kept (``close(..., keep_log=True)``)."""
        if self._closed_logs.pop(session_id, None) is None:
            raise UnknownSessionError(f"no closed session {session_id!r} with a kept log")


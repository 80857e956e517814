"""``WeftServer``: an MCP server whose typed tool functions operate on a session's private state.

A server module declares one ``WeftServer`` named ``server`` and registers tools with
``@server.tool(reads=..., writes=..., returns=...)``. Each tool is a typed function whose *first*
parameter receives the session's state handle (a ``sqlite3.Connection`` or the state object); the
remaining parameters (type hints + pydantic ``Field``) become the tool's JSON input schema through
the official ``mcp`` SDK (``MCPServer``). Example::

    server = WeftServer("shop", backend="sqlite", schema=DDL)

    @server.tool(reads=("orders",), returns="the order as a dict")
    def get_order(db: sqlite3.Connection, order_id: int) -> dict: ...

:meth:`WeftServer.build` returns one ``MCPServer`` that serves *many* sessions: the runtime sends the
session id in the request's ``_meta`` (:data:`SESSION_META_KEY`) and the server resolves it to that
session's state. A tool's return value is sent as one JSON text block. SQLite tools are atomic:
the wrapper commits when the tool returns and rolls back
when it raises. Deliberate tool failures should raise :class:`ToolError` (the agent sees the message).
Seed: WEFT section 4.1 (contracts: argument -> state mapping, reads, writes, returns).
"""
from __future__ import annotations

import inspect
import json
import logging
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.mcpserver.tools import Tool
from mcp.types import ToolAnnotations
from pydantic_core import to_jsonable_python

from treadle.weft.runtime.determinism import bind_env, unbind_env
from treadle.weft.runtime.object_state import ObjectState, check_object_schema
from treadle.weft.runtime.sqlite_state import SqliteState, check_schema
from treadle.weft.runtime.state import BackendKind, Snapshot, StateBackend

_log = logging.getLogger("treadle.weft.tools")

SESSION_META_KEY = "treadle.weft/session"
"""Request ``_meta`` key carrying the session id from the runtime to the server."""

__all__ = ["SESSION_META_KEY", "ToolContract", "ToolError", "WeftServer"]


@dataclass(frozen=True)
class ToolContract:
    """What a tool does to state (seed: WEFT 4.1 "contracts").

    Attributes:
        name: tool name.
        reads: tables (SQLite) or attributes (object state) the tool reads.
        writes: tables/attributes it may change; empty = read-only (no checkpoint after the call).
        returns: what the result holds, in words.
        args_to_state: argument name -> the ``table.column`` (or attribute path) it refers to.
    """

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    returns: str = ""
    args_to_state: Mapping[str, str] = field(default_factory=dict)

    @property
    def mutating(self) -> bool:
        return bool(self.writes)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "reads": list(self.reads), "writes": list(self.writes), "returns": self.returns,
                "args_to_state": dict(self.args_to_state)}


def _to_json_text(value: Any) -> str:
    """Tool results travel as one JSON text block (the runtime parses it back); values JSON cannot hold
    (e.g. ``mpmath.mpf``) are sent as their ``str``."""
    return json.dumps(to_jsonable_python(value, fallback=str), ensure_ascii=False)


def _as_names(value: Any, what: str, tool: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{what} of tool {tool!r} must be a tuple of str, got {value!r}")
    return tuple(value)


class WeftServer:
    """A set of typed tools over one kind of session state.

    Args:
        name: server name (shown to MCP clients).
        backend: ``"sqlite"`` (tools get a ``sqlite3.Connection``) or ``"object"`` (tools get the state
            object).
        schema: for ``"sqlite"``, the DDL that snapshots must match.
        state_class: for ``"object"``, the class whose declared attributes snapshots must match.
        instructions: optional server instructions for MCP clients.

    Raises:
        ValueError: unknown backend, or the backend's schema/state_class is missing.
    """

    def __init__(self, name: str, *, backend: BackendKind = "sqlite", schema: str | None = None,
                 state_class: type | None = None, instructions: str | None = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if backend not in ("sqlite", "object"):
            raise ValueError(f"backend must be 'sqlite' or 'object', got {backend!r}")
        if backend == "sqlite" and not isinstance(schema, str):
            raise ValueError("a 'sqlite' WeftServer needs schema= (the DDL its snapshots must match)")
        if backend == "object" and not isinstance(state_class, type):
            raise ValueError("an 'object' WeftServer needs state_class= (the class of its state object)")
        self.name = name
        self.backend: BackendKind = backend
        self.schema = schema
        self.state_class = state_class
        self.instructions = instructions
        self._tools: dict[str, tuple[Callable[..., Any], ToolContract, str]] = {}
        self._schemas: dict[str, dict[str, Any]] = {}

    # -- declaration -------------------------------------------------------------------------
    def tool(self, fn: Callable[..., Any] | None = None, *, name: str | None = None, reads: Any = (),
             writes: Any = (), returns: str = "", args_to_state: Mapping[str, str] | None = None,
             description: str | None = None, input_schema: dict[str, Any] | None = None):
        """Register a tool (decorator, with or without arguments). See :class:`ToolContract`.

        ``input_schema`` replaces the JSON schema derived from the type hints (for tools whose
        documentation comes from elsewhere, e.g. BFCL function docs); the runtime validates
        arguments against it.

        Raises:
            TypeError: ``fn`` takes no state parameter, or a contract field has the wrong type.
            ValueError: a tool of that name exists already, or ``args_to_state`` names unknown arguments.
        """

        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            tool_name = name or f.__name__
            params = list(inspect.signature(f).parameters.values())
            if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD):
                raise TypeError(f"tool {tool_name!r}: the first parameter must receive the session state")
            if tool_name in self._tools:
                raise ValueError(f"tool {tool_name!r} is already registered on server {self.name!r}")
            if any(p.name == "weft_ctx" for p in params):
                raise ValueError(f"tool {tool_name!r}: the parameter name 'weft_ctx' is reserved")
            a2s = dict(args_to_state or {})
            unknown = set(a2s) - {p.name for p in params[1:]}
            if unknown:
                raise ValueError(f"tool {tool_name!r}: args_to_state names unknown arguments {sorted(unknown)}")
            contract = ToolContract(tool_name, _as_names(reads, "reads", tool_name),
                                    _as_names(writes, "writes", tool_name), returns, a2s)
            if input_schema is not None and not isinstance(input_schema, dict):
                raise TypeError(f"input_schema of tool {tool_name!r} must be a dict (JSON Schema)")
            self._tools[tool_name] = (f, contract, description or inspect.getdoc(f) or "")
            if input_schema is not None:
                self._schemas[tool_name] = input_schema
            return f

        return register(fn) if fn is not None else register

    @property
    def tool_names(self) -> list[str]:
        return sorted(self._tools)

    @property
    def contracts(self) -> dict[str, ToolContract]:
        return {n: c for n, (_, c, _) in sorted(self._tools.items())}

    # -- state -------------------------------------------------------------------------------
    def check_snapshot(self, snapshot: Snapshot) -> None:
        """Raise :class:`~treadle.weft.runtime.errors.SnapshotSchemaError` if ``snapshot`` does not fit this server."""
        if self.backend == "sqlite":
            check_schema(snapshot, self.schema)
        else:
            check_object_schema(snapshot, self.state_class)

    def new_state(self, snapshot: Snapshot) -> StateBackend:
        """A private state cloned from ``snapshot`` (no schema check; see :meth:`check_snapshot`)."""
        if self.backend == "sqlite":
            return SqliteState(snapshot)
        return ObjectState(snapshot, self.state_class)

    # -- MCP ---------------------------------------------------------------------------------
    def _wrap(self, tool_name: str, resolve: Callable[[str | None], Any],
              resolve_env: Callable[[str | None], Any] | None = None) -> Callable[..., Any]:
        fn, _, _ = self._tools[tool_name]
        try:
            sig = inspect.signature(fn, eval_str=True)  # resolve `from __future__ import annotations` strings
        except Exception:  # noqa: BLE001  (unresolvable annotations: let the SDK report them)
            sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        state_param = params[0].name
        try:
            hints = inspect.get_annotations(fn, eval_str=True)
        except Exception:  # noqa: BLE001  (unresolvable string annotations: let the SDK report them)
            hints = dict(getattr(fn, "__annotations__", {}))
        is_async = inspect.iscoroutinefunction(fn)
        sqlite_backend = self.backend == "sqlite"

        def session_state(ctx: Context) -> tuple[Any, Any]:
            """The session's state handle, and the token binding its clock/random source to this call."""
            meta = ctx.request_context.meta or {}
            sid = meta.get(SESSION_META_KEY) if isinstance(meta, Mapping) else None
            state = resolve(sid)
            return state, bind_env(resolve_env(sid) if resolve_env is not None else None)

        def crashed(err: BaseException) -> BaseException:
            """A deliberate ToolError passes; anything else (a bug in the tool) is logged as one line through
            ``logging`` (traceback at DEBUG) and reported to the agent as a ToolError, so the SDK does not
            print a full traceback on the training process's stderr."""
            if isinstance(err, ToolError) and not isinstance(err, UnexpectedToolError):
                return err
            what = f"exit({err.code!r})" if isinstance(err, SystemExit) else f"{type(err).__name__}: {err}"
            _log.warning("tool %s of server %s crashed: %s", tool_name, self.name, what,
                         exc_info=err if _log.isEnabledFor(logging.DEBUG) else None)
            return ToolError(what)

        def finish(state: Any, ok: bool) -> None:
            if sqlite_backend and isinstance(state, sqlite3.Connection):
                if ok:
                    state.commit()
                elif state.in_transaction:
                    state.rollback()

        if is_async:
            async def wrapper(weft_ctx: Context, **kwargs: Any) -> Any:
                state, token = session_state(weft_ctx)
                try:
                    out = await fn(state, **kwargs)
                except (Exception, SystemExit) as err:  # noqa: BLE001  (SystemExit: must not stop the worker)
                    finish(state, False)
                    raise crashed(err) from None
                except BaseException:
                    finish(state, False)
                    raise
                finally:
                    unbind_env(token)
                finish(state, True)
                return _to_json_text(out)
        else:
            def body(weft_ctx: Context, kwargs: dict[str, Any]) -> Any:
                state, token = session_state(weft_ctx)
                try:
                    out = fn(state, **kwargs)
                except (Exception, SystemExit) as err:  # noqa: BLE001  (SystemExit: must not stop the worker)
                    finish(state, False)
                    raise crashed(err) from None
                except BaseException:
                    finish(state, False)
                    raise
                finally:
                    unbind_env(token)
                finish(state, True)
                return _to_json_text(out)

            async def wrapper(weft_ctx: Context, **kwargs: Any) -> Any:
                # sync tools run on the event loop's bounded worker-thread pool; a call cancelled past its
                # time limit is abandoned (the thread finishes on a state the runtime has detached)
                return await anyio.to_thread.run_sync(body, weft_ctx, kwargs, abandon_on_cancel=True)

        ctx_param = inspect.Parameter("weft_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context)
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[1:]]
        new_sig = sig.replace(parameters=[ctx_param, *rest], return_annotation=str)
        wrapper.__signature__ = new_sig  # type: ignore[attr-defined]
        wrapper.__annotations__ = ({k: v for k, v in hints.items() if k not in (state_param, "return")}
                                   | {"weft_ctx": Context, "return": str})
        wrapper.__name__ = tool_name
        wrapper.__qualname__ = tool_name
        wrapper.__doc__ = fn.__doc__
        wrapper.__module__ = fn.__module__
        return wrapper

    def mcp_tools(self, resolve: Callable[[str | None], Any],
                  resolve_env: Callable[[str | None], Any] | None = None) -> list[Tool]:
        """The SDK ``Tool`` objects of this server, bound to ``resolve(session_id) -> state handle`` and
        (optional) ``resolve_env(session_id) -> SessionEnv`` (the session's clock and random source)."""
        out = []
        for tool_name in sorted(self._tools):
            _, contract, desc = self._tools[tool_name]
            out.append(tool := Tool.from_function(
                self._wrap(tool_name, resolve, resolve_env), name=tool_name, description=desc,
                annotations=ToolAnnotations(read_only_hint=not contract.mutating,
                                            destructive_hint=contract.mutating, idempotent_hint=not contract.mutating),
                structured_output=False,
            ))
            if tool_name in self._schemas:
                tool.parameters = self._schemas[tool_name]
        return out

    def build(self, resolve: Callable[[str | None], Any],
              resolve_env: Callable[[str | None], Any] | None = None) -> MCPServer:
        """An ``MCPServer`` serving these tools; ``resolve`` maps the request's session id to a state handle.

        ``resolve`` should raise :class:`ToolError` for an unknown session id.
        """
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            return MCPServer(self.name, instructions=self.instructions, tools=self.mcp_tools(resolve, resolve_env),
                             log_level="ERROR")
        finally:  # MCPServer() calls logging.basicConfig: leave the host process's logging as it was
            root.handlers[:] = handlers
            root.setLevel(level)

    def tool_definitions(self) -> list[dict[str, Any]]:
        """``[{"name", "description", "input_schema", "contract"}]`` sorted by name (hashed by the registry)."""

        def unbound(_sid: str | None) -> Any:
            raise ToolError("no session state bound")

        return [{"name": t.name, "description": t.description or "", "input_schema": t.parameters,
                 "contract": self._tools[t.name][1].as_dict()} for t in self.mcp_tools(unbound)]

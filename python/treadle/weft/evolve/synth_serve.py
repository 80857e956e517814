"""Serve a certified synthesised environment through the WEFT runtime (seed: WEFT 4.1, "the tool layer served
by the runtime"), with its generated code kept in the sandbox.

:func:`server_source` turns an accepted :class:`~treadle.weft.evolve.synth.SynthResult` into the source of a
small, trusted WEFT server module (SQLite backend) that the runtime registers like any other: its tools
are the design's tools (JSON input schemas from the designed parameters, contracts from the designed
reads/writes/returns), its sessions get private state, reset, fork, diff, checkpoints and every view and
harness of the rollouts. The generated artefacts travel in that module as *data*; nothing of them is
executed in the serving process:

- the initial database (:func:`initial_snapshot`) is built by running the generated DDL and seed rows
  in a :func:`treadle.sandbox.run_python` worker; the schema the runtime checks snapshots against is
  read back from that database's ``sqlite_master`` (``CREATE`` statements only: an ``ATTACH`` or
  ``PRAGMA`` in the generated DDL never runs here);
- each tool call runs the generated backend function in a sandboxed worker (no network, read-only
  filesystem but its own temporary directory, time and memory limits enforced by the parent) on a copy
  of the session's database image; the worker hands back the result and the new image. By default
  (``worker="session"``) one long-lived worker serves all calls of a session
  (:mod:`~treadle.weft.evolve.synth_worker`: killed and restarted after a call past its time limit,
  stopped at its lifetime or when the session ends); ``worker="call"`` starts a fresh sandbox per call
  (and so does a call made outside the runtime, with no session bound);
- the serving process then checks the new image before adopting it: same schema, and only tables the
  tool's contract declares in ``writes`` changed (a write elsewhere, a dropped table or a new trigger is
  refused as a tool error and the session's state is left as it was). The call is atomic like every
  WEFT tool call: a failure leaves no change.

What the sandbox does not cover is listed in :mod:`treadle.sandbox` (reads are not restricted). One
sandbox per call costs about 0.38 s on a 2-core machine; the session's worker about 2.4 ms a call after
its first (~0.25 s, the start). A session worker keeps the generated module's globals between the
session's calls (never across sessions); its results are checked the same way.
"""
from __future__ import annotations

import base64
import inspect
import json
import sqlite3
from typing import Any

from treadle.weft.evolve.synth_worker import APPLY_CALL
from treadle.weft.runtime.server import ToolError, WeftServer
from treadle.weft.runtime.state import Snapshot

__all__ = ["JSON_TYPES", "SynthServeError", "initial_snapshot", "server_source", "serve_spec", "synth_env",
           "synth_server"]

JSON_TYPES = {"string": "string", "str": "string", "text": "string", "integer": "integer", "int": "integer",
              "number": "number", "float": "number", "boolean": "boolean", "bool": "boolean", "array": "array",
              "list": "array", "object": "object", "dict": "object"}
"""Designed parameter types (lower-case) -> JSON Schema types; any other type leaves the parameter untyped."""


class SynthServeError(ValueError):
    """The synthesised environment cannot be served: not accepted by validation, an artefact missing, or its
    schema or seed rows fail when built in the sandbox."""


_BUILD = r'''
import base64, json, sqlite3
spec = json.load(open("build.json"))
db = sqlite3.connect(":memory:")
out = {}
try:
    db.executescript(spec["ddl"]); db.executescript(spec["seed"]); db.commit()
    out = {"ok": True, "image": base64.b64encode(db.serialize()).decode()}
except Exception as e:
    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
open("out.json", "w").write(json.dumps(out))
'''

_CALL = APPLY_CALL + r'''
import json
spec = json.load(open("call.json"))
def done(**kw):
    open("out.json", "w").write(json.dumps(kw, default=str))
ns = {"__name__": "generated_backend"}
try:
    exec(compile(open("backend.py").read(), "backend.py", "exec"), ns)
except BaseException as e:
    done(kind="import_error", error=f"{type(e).__name__}: {e}"); raise SystemExit(0)
fn = ns.get(spec["tool"])
if not callable(fn):
    done(kind="missing"); raise SystemExit(0)
apply_call(fn, spec, done)
'''


def _limits(spec: dict[str, Any]) -> Any:
    from treadle.sandbox import SandboxLimits

    return SandboxLimits(**spec.get("limits", {}))


def _run(spec: dict[str, Any], source: str, files: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """Run ``source`` sandboxed; (its ``out.json``, '') or (None, why the worker gave nothing back)."""
    from treadle.sandbox import run_python

    res = run_python(source, limits=_limits(spec), files=files, collect=["out.json"], python_args=("-I",))
    text = res.files.get("out.json")
    if text is not None:
        try:
            out = json.loads(text)
        except json.JSONDecodeError:
            out = None
        if isinstance(out, dict):
            return out, ""
    if res.termination != "exit":
        return None, f"the sandbox ended it ({res.termination} after {res.duration_s:.1f} s)"
    return None, f"the worker exited with {res.returncode} and no result: {res.stderr.strip()[-300:]}"


def _execute(spec: dict[str, Any], call: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """One call of the generated backend: in the session's long-lived worker (``spec["worker"] == "session"``
    and the call is served by the runtime, which binds the session), else in a fresh sandbox."""
    if spec.get("worker") == "session":
        from treadle.weft.runtime.determinism import bound_env
        from treadle.weft.evolve.synth_worker import session_worker

        session = bound_env()
        if session is not None:
            return session_worker(session, spec["backend"], _limits(spec),
                                  lifetime_s=spec.get("worker_lifetime_s", 600.0)).call(call)
    return _run(spec, _CALL, {"call.json": json.dumps(call), "backend.py": spec["backend"]})


def _schema_sql(con: sqlite3.Connection) -> list[tuple[str, str, str]]:
    return [tuple(r) for r in con.execute(
        "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY type, name")]


def _open_image(data: bytes) -> sqlite3.Connection:
    con = sqlite3.connect(":memory:")
    try:
        con.deserialize(data)
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError:
        con.close()
        raise
    return con


def serve_spec(result: Any, name: str, *, limits: Any = None, worker: str = "session",
               worker_lifetime_s: float = 600.0) -> dict[str, Any]:
    """What the served module holds: the accepted artefacts, the schema read back from the sandbox, the limits.

    Args:
        result: an accepted :class:`~treadle.weft.evolve.synth.SynthResult` (validated by execution).
        name: the server's name (``[A-Za-z0-9_-]``, shown to MCP clients).
        limits: :class:`treadle.sandbox.SandboxLimits` of each tool call (default 5 s, 512 MiB); keep
            ``timeout_s`` below the runtime's per-call ``timeout_s``.
        worker: ``"session"``: the calls of one session run in one long-lived sandboxed worker
            (:mod:`~treadle.weft.evolve.synth_worker`, at most ``worker_lifetime_s`` seconds, restarted
            after a call that times out); ``"call"``: a fresh sandbox per call (~0.45 s each).

    Raises:
        SynthServeError: ``result`` was not accepted, misses an artefact, or its DDL / seed rows fail in the
            sandbox or create something other than tables, indexes, views and triggers.
        treadle.sandbox.SandboxUnavailableError: no sandbox here (generated code never runs unsandboxed).
    """
    from treadle.sandbox import SandboxLimits

    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name):
        raise SynthServeError(f"name must be a non-empty [A-Za-z0-9_-] string, got {name!r}")
    if not getattr(result, "accepted", False):
        raise SynthServeError("only an accepted (validated by execution) synthesised environment can be served; "
                              "this one was not accepted")
    if result.design is None or result.schema_ is None or result.backend is None:
        raise SynthServeError("the synthesised environment misses its design, schema or backend")
    if worker not in ("session", "call"):
        raise SynthServeError(f"worker must be 'session' or 'call', got {worker!r}")
    if not isinstance(worker_lifetime_s, (int, float)) or not worker_lifetime_s > 0:
        raise SynthServeError(f"worker_lifetime_s must be > 0 seconds, got {worker_lifetime_s!r}")
    limits = limits or SandboxLimits(timeout_s=5, memory_mb=512, max_output_bytes=16 << 20)
    spec = {"name": name, "tools": [t.model_dump() for t in result.design.tools], "backend": result.backend.source,
            "limits": limits.model_dump(exclude_none=True), "worker": worker,
            "worker_lifetime_s": float(worker_lifetime_s)}
    out, why = _run(spec, _BUILD, {"build.json": json.dumps({"ddl": result.schema_.ddl, "seed": result.schema_.seed})})
    if out is None or not out.get("ok"):
        raise SynthServeError(f"the schema and seed rows do not build in the sandbox: {why or out.get('error')}")
    con = _open_image(base64.b64decode(out["image"]))
    try:
        entries = _schema_sql(con)
    finally:
        con.close()
    odd = [f"{t} {n}" for t, n, sql in entries
           if t not in ("table", "index", "view", "trigger") or sql.lstrip().upper().startswith("CREATE VIRTUAL")]
    if odd:
        raise SynthServeError(f"the schema creates {odd}; only plain tables, indexes, views and triggers are served")
    tables = [n for t, n, _ in entries if t == "table"]
    unknown = sorted({w for t in result.design.tools for w in (*t.reads, *t.writes)} - set(tables))
    if unknown:
        raise SynthServeError(f"tool contracts name tables {unknown} that the built schema lacks (tables: {tables})")
    order = {"table": 0, "index": 1, "view": 2, "trigger": 3}
    spec["ddl"] = ";\n".join(sql for _, _, sql in sorted(entries, key=lambda e: (order[e[0]], e[1]))) + ";"
    spec["image"] = out["image"]
    return spec


def server_source(result: Any, name: str, *, limits: Any = None, worker: str = "session",
                  worker_lifetime_s: float = 600.0) -> str:
    """Source of the WEFT server module serving ``result`` (register it with ``Runtime.register``).

    Same arguments and errors as :func:`serve_spec`. Content-addressed like every server: the same
    artefacts, name and limits give the same source and hash.
    """
    spec = serve_spec(result, name, limits=limits, worker=worker, worker_lifetime_s=worker_lifetime_s)
    return ("# Generated by treadle.weft.evolve.synth_serve: the tool layer of a certified synthesised environment.\n"
            "# The generated backend and schema below are data: they run only in treadle.sandbox workers.\n"
            "import json as _weft_json\n"
            "from treadle.weft.evolve.synth_serve import synth_server as _weft_synth_server\n"
            f"_WEFT_SPEC = {json.dumps(spec)!r}\n"
            "server = _weft_synth_server(_weft_json.loads(_WEFT_SPEC))\n")


def initial_snapshot(source_or_spec: str | dict[str, Any]) -> Snapshot:
    """The initial state (seed rows, built in the sandbox) of a :func:`server_source` module or :func:`serve_spec`."""
    spec = source_or_spec
    if isinstance(spec, str):
        marker = "_WEFT_SPEC = "
        line = next((x for x in spec.splitlines() if x.startswith(marker)), None)
        if line is None:
            raise SynthServeError("not a treadle.weft.evolve.synth_serve server module")
        import ast

        spec = json.loads(ast.literal_eval(line[len(marker):]))
    return Snapshot("sqlite", base64.b64decode(spec["image"]))


def _input_schema(params: dict[str, str]) -> dict[str, Any]:
    props = {}
    for p, typ in params.items():
        t = JSON_TYPES.get(str(typ).strip().lower())
        props[p] = {"type": t} if t else {}
    return {"type": "object", "properties": props, "required": list(params), "additionalProperties": False}


def _call(spec: dict[str, Any], tool: dict[str, Any], db: sqlite3.Connection, args: dict[str, Any]) -> Any:
    """One tool call: the generated function in a sandboxed worker on a copy of ``db``; its new image is adopted
    only when the schema is unchanged and every changed table is in the contract's ``writes``."""
    from treadle.weft.runtime.sqlite_state import diff_connections

    name = tool["name"]
    call = {"tool": name, "args": args, "image": base64.b64encode(db.serialize()).decode()}
    out, why = _execute(spec, call)
    if out is None:
        raise ToolError(f"{name} did not return: {why}")
    kind = out.get("kind")
    if kind == "import_error":
        raise ToolError(f"the generated backend does not import: {out.get('error')}")
    if kind == "missing":
        raise ToolError(f"the generated backend defines no function {name!r}")
    if kind == "error":
        raise ToolError(str(out.get("error"))[:2000])
    if kind != "ok" or not isinstance(out.get("image"), str):
        raise ToolError(f"{name}: the sandboxed worker gave back no result")
    try:
        new = _open_image(base64.b64decode(out["image"]))
    except (sqlite3.DatabaseError, ValueError) as err:
        raise ToolError(f"{name}: the worker's database image is unreadable ({err}); state left unchanged") from None
    try:
        if _schema_sql(new) != _schema_sql(db):
            raise ToolError(f"{name} changed the database schema; refused, state left unchanged")
        changed = sorted(diff_connections(db, new).tables)
        undeclared = [t for t in changed if t not in tool["writes"]]
        if undeclared:
            raise ToolError(f"{name} changed {undeclared}, not declared in its contract's writes {tool['writes']}; "
                            "refused, state left unchanged")
        image = new.serialize()
    finally:
        new.close()
    if changed:
        db.deserialize(image)
    return out.get("result")


def _tool_function(spec: dict[str, Any], tool: dict[str, Any]) -> Any:
    """A tool function ``(db, *, <designed params>)`` that runs the generated function sandboxed."""
    params = [inspect.Parameter("db", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY, annotation=Any) for p in tool["params"]]

    def call(db: sqlite3.Connection, **kwargs: Any) -> Any:
        return _call(spec, tool, db, kwargs)

    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__annotations__ = {p: Any for p in tool["params"]}
    call.__name__ = tool["name"]
    return call


def synth_server(spec: dict[str, Any]) -> WeftServer:
    """The :class:`WeftServer` of a :func:`serve_spec` (what a :func:`server_source` module declares)."""
    server = WeftServer(spec["name"], backend="sqlite", schema=spec["ddl"],
                        instructions="A synthesised environment; its tools run sandboxed.")
    for tool in spec["tools"]:
        server.tool(_tool_function(spec, tool), name=tool["name"], reads=tuple(tool["reads"]),
                    writes=tuple(tool["writes"]),
                    returns=tool.get("returns", ""), description=tool["description"],
                    input_schema=_input_schema(tool["params"]))
    return server


async def synth_env(rt: Any, source: str) -> Any:
    """Register a :func:`server_source` module in ``rt``; its :class:`~treadle.weft.rollouts.sessions.Env`
    (hash, initial snapshot, tools) for rollouts, certification and composition."""
    from treadle.weft.rollouts.sessions import env_of

    return await env_of(rt, source, initial_snapshot(source))

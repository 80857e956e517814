"""Execution validation of a synthesised environment, in the sandbox, with failures localised to one stage.

Seed: WEFT 4.1 (stateful environment synthesis: execution validation with normal and boundary calls;
queries checked against state, updates against the database diff and a read-back). Generated code is
untrusted: the schema, seed rows, backend and checks run only inside :func:`treadle.sandbox.run_python`
(own network namespace, read-only filesystem but for its work directory, time and memory limits
enforced by the parent), never in this process. The harness script that drives them is ours; it
reports one JSON line per check as it goes, so a backend that never returns is still localised to
the tool it was running. The harness and the backend are two processes and the harness reports on a
channel the backend cannot write (a host file outside the sandbox, held only by the non-dumpable
harness): a backend that prints or writes forged events changes nothing of the verdict.

Localisation (:class:`Stage`): the DDL or seed rows fail, or a check's state query names a missing
table or column -> ``schema``; a contract names a table the schema lacks, or a call changes a table
its contract does not declare -> ``contract``; the backend does not import, lacks a tool, runs past
the time limit, raises where a normal call should succeed, succeeds where a boundary call should
fail, or its returns or state disagree with a check -> ``backend``.
"""
from __future__ import annotations

import json
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.runtime.verify import contains


class Stage(str, Enum):
    """The synthesised artefact a validation failure is blamed on (the only one revised)."""

    design = "design"
    schema = "schema"
    contract = "contract"
    backend = "backend"
    checks = "checks"


class ToolDesign(BaseModel):
    """One tool: its name, what it does, its parameters (name -> JSON type) and its contract."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z_][a-z0-9_]*$")
    description: str
    params: dict[str, str] = Field(default_factory=dict)
    reads: list[str] = Field(default_factory=list)
    writes: list[str] = Field(default_factory=list)
    returns: str = ""


class Design(BaseModel):
    """The designer's output: shared entities, business tasks (first), tools with contracts."""

    model_config = ConfigDict(extra="forbid")
    entities: list[str]
    tasks: list[str]
    tools: list[ToolDesign] = Field(min_length=1)


class Schema(BaseModel):
    """SQLite DDL and seed rows."""

    model_config = ConfigDict(extra="forbid")
    ddl: str = Field(min_length=1)
    seed: str = ""


class Backend(BaseModel):
    """Python source defining one function ``def <tool>(db, **params)`` per tool (``db``: sqlite3.Connection)."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1)


class Check(BaseModel):
    """One validation call: a normal call must succeed, a boundary call must raise; returns must contain
    ``expect_returns``; each ``state`` query must return exactly its rows afterwards (the read-back)."""

    model_config = ConfigDict(extra="forbid")
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    kind: str = Field("normal", pattern="^(normal|boundary)$")
    expect_returns: Any = None
    state: list[tuple[str, list[list[Any]]]] = Field(default_factory=list)


class Checks(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checks: list[Check] = Field(min_length=1)


class Failure(BaseModel):
    """One localised validation failure."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: Stage
    detail: str
    check: int | None = None


# The harness (trusted, no generated Python) and the generated backend run in two processes of one sandbox.
# The harness reports on a channel only it holds (run_python(report=True): a host file outside the sandbox):
# it closes that descriptor in the backend's process and makes itself non-dumpable first, so that no other
# process of the sandbox can open /proc/<harness>/fd/* or /proc/<harness>/mem. The backend only answers calls
# over its own pipe (result, error and the new database image); what a check observed (tables changed, state
# read back) is computed by the harness from that image. The backend's prints go to stderr.
_HARNESS = r'''
import base64, ctypes, json, os, sqlite3, subprocess, sys
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)              # PR_SET_DUMPABLE = 0
report = os.fdopen(int(os.environ.pop("TREADLE_SANDBOX_REPORT_FD")), "w")
spec = json.load(open("spec.json"))
def emit(**kw):
    report.write(json.dumps(kw, default=str) + "\n"); report.flush()
db = sqlite3.connect(":memory:")
try:
    db.executescript(spec["ddl"]); db.executescript(spec["seed"]); db.commit()
except Exception as e:
    emit(event="schema_error", error=f"{type(e).__name__}: {e}"); sys.exit(0)
tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
emit(event="tables", tables=tables)
backend = subprocess.Popen([sys.executable, "-I", "backend_main.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           close_fds=True)
def answer():
    line = backend.stdout.readline(spec["max_reply_bytes"])
    try:
        out = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return out if isinstance(out, dict) else None
def ask(req):
    try:
        backend.stdin.write((json.dumps(req) + "\n").encode()); backend.stdin.flush()
    except OSError:
        return None
    return answer()
first = answer()
if first is None or first.get("kind") != "imported":
    error = first.get("error") if isinstance(first, dict) else None
    emit(event="import_error", error=str(error or "the backend process ended before it imported")); sys.exit(0)
def dump(con):
    out = {}
    for t in tables:
        try:
            out[t] = [list(r) for r in con.execute(f'SELECT * FROM "{t}" ORDER BY 1')]
        except Exception as e:
            out[t] = f"{type(e).__name__}: {e}"
    return out
for i, c in enumerate(spec["checks"]):
    emit(event="start", i=i, tool=c["tool"])
    rep = ask({"tool": c["tool"], "args": c["args"], "image": base64.b64encode(db.serialize()).decode()})
    if rep is None:
        emit(event="ended", i=i); sys.exit(0)
    if rep.get("kind") == "missing":
        emit(event="check", i=i, missing=True); continue
    before = dump(db)
    new = sqlite3.connect(":memory:")
    try:
        new.deserialize(base64.b64decode(str(rep.get("image"))))
        new.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except Exception as e:
        emit(event="ended", i=i, error=f"the backend returned no database image: {type(e).__name__}: {e}")
        sys.exit(0)
    db = new
    after = dump(db)
    state = []
    for sql, _ in c["state"]:
        try:
            state.append([list(r) for r in db.execute(sql)])
        except Exception as e:
            state.append({"error": f"{type(e).__name__}: {e}"})
    err = rep.get("error")
    emit(event="check", i=i, result=rep.get("result"), error=None if err is None else str(err),
         changed=[t for t in tables if before[t] != after[t]], state=state)
emit(event="done")
'''

# The generated backend's process: imports it, then answers one JSON line per call (no knowledge of the checks).
_BACKEND_MAIN = r'''
import base64, json, os, sqlite3, sys
out = os.fdopen(os.dup(1), "w")       # the reply pipe; the backend's own prints go to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
def done(**kw):
    out.write(json.dumps(kw, default=str) + "\n"); out.flush()
ns = {"__name__": "generated_backend"}
try:
    exec(compile(open("backend.py").read(), "backend.py", "exec"), ns)
except BaseException as e:
    done(kind="import_error", error=f"{type(e).__name__}: {e}"); sys.exit(0)
done(kind="imported")
for line in sys.stdin:
    spec = json.loads(line)
    fn = ns.get(spec["tool"])
    if not callable(fn):
        done(kind="missing"); continue
    db = sqlite3.connect(":memory:")
    db.deserialize(base64.b64decode(spec["image"]))
    try:
        result = fn(db, **spec["args"]); db.commit(); err = None
    except Exception as e:
        db.rollback(); result = None; err = f"{type(e).__name__}: {e}"
    done(kind="done", result=result, error=err, image=base64.b64encode(db.serialize()).decode())
    db.close()
'''


def validate(design: Design, schema: Schema, backend: Backend, checks: Checks, *, limits: Any = None
             ) -> tuple[list[Failure], dict[str, Any]]:
    """Run the checks against the generated backend in the sandbox; return (failures, raw run facts).

    Raises:
        treadle.sandbox.SandboxUnavailableError: no sandbox on this machine (generated code never runs
            unsandboxed).
    """
    from treadle.sandbox import SandboxLimits, run_python

    limits = limits or SandboxLimits(timeout_s=10, memory_mb=512)
    failures: list[Failure] = []
    spec = {"ddl": schema.ddl, "seed": schema.seed, "checks": [c.model_dump(mode="json") for c in checks.checks],
            "max_reply_bytes": 64 << 20}
    res = run_python(_HARNESS, limits=limits, files={"spec.json": json.dumps(spec), "backend.py": backend.source,
                                                     "backend_main.py": _BACKEND_MAIN},
                     python_args=("-I",), report=True)
    events = []
    for line in res.report.splitlines():  # the harness's channel: nothing the backend prints is read as an event
        try:
            e = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(e, dict):
            events.append(e)
    facts = {"termination": res.termination, "returncode": res.returncode, "stderr": res.stderr[-2000:]}
    kinds = {e.get("event") for e in events}
    if "schema_error" in kinds:
        err = next(e for e in events if e["event"] == "schema_error")["error"]
        return [Failure(stage=Stage.schema, detail=f"DDL or seed rows fail: {err}")], facts
    tables = next((e["tables"] for e in events if e.get("event") == "tables"), [])
    for t in design.tools:
        for name in {*t.reads, *t.writes} - set(tables):
            failures.append(Failure(stage=Stage.contract, detail=f"tool {t.name!r} names table {name!r}, which the "
                                                                 f"schema does not have (tables: {tables})"))
    if "import_error" in kinds:
        err = next(e for e in events if e["event"] == "import_error")["error"]
        return [*failures, Failure(stage=Stage.backend, detail=f"backend does not import: {err}")], facts
    tools = {t.name: t for t in design.tools}
    done = {e["i"]: e for e in events if e.get("event") == "check"}
    started = [e for e in events if e.get("event") == "start"]
    ended = {e.get("i"): str(e.get("error") or "") for e in events if e.get("event") == "ended"}
    for i, c in enumerate(checks.checks):
        tool = tools.get(c.tool)
        if tool is None:
            failures.append(Failure(stage=Stage.checks, check=i, detail=f"check names unknown tool {c.tool!r}"))
            continue
        e = done.get(i)
        if e is None:
            if i in ended:
                failures.append(Failure(stage=Stage.backend, check=i, detail=f"{c.tool} did not answer: the backend "
                                        f"process ended or replied garbage ({ended[i] or 'no reply'})"))
            elif started and started[-1]["i"] == i and res.termination != "exit":
                failures.append(Failure(stage=Stage.backend, check=i, detail=f"{c.tool} did not return: the sandbox "
                                        f"ended it ({res.termination} after {res.duration_s:.1f} s)"))
            elif res.termination != "exit" or "done" not in kinds:
                failures.append(Failure(stage=Stage.backend, check=i, detail="not run: the backend run ended early"))
            continue
        if e.get("missing"):
            failures.append(Failure(stage=Stage.backend, check=i, detail=f"backend defines no function {c.tool!r}"))
            continue
        undeclared = sorted(set(e["changed"]) - set(tool.writes))
        if undeclared:
            failures.append(Failure(stage=Stage.contract, check=i,
                                    detail=f"{c.tool} changed {undeclared}, not declared in its writes {tool.writes}"))
        if c.kind == "normal" and e["error"]:
            failures.append(Failure(stage=Stage.backend, check=i, detail=f"normal call {c.tool}({c.args}) raised "
                                                                         f"{e['error'][:200]}"))
            continue
        if c.kind == "boundary":
            if not e["error"]:
                failures.append(Failure(stage=Stage.backend, check=i,
                                        detail=f"boundary call {c.tool}({c.args}) succeeded; it must fail"))
            elif e["changed"]:
                failures.append(Failure(stage=Stage.backend, check=i,
                                        detail=f"failed call {c.tool} left changes in {e['changed']}"))
            continue
        if c.expect_returns is not None and not contains(e["result"], c.expect_returns):
            failures.append(Failure(stage=Stage.backend, check=i, detail=f"{c.tool} returned {str(e['result'])[:200]}, "
                                                                         f"expected to contain {c.expect_returns}"))
        for (sql, expected), got in zip(c.state, e["state"]):
            if isinstance(got, dict):
                failures.append(Failure(stage=Stage.schema, check=i, detail=f"state query fails: {got['error']}: {sql}"))
            elif got != expected:
                failures.append(Failure(stage=Stage.backend, check=i, detail=f"after {c.tool}: {sql} gave {got}, "
                                                                             f"expected {expected}"))
    return failures, facts

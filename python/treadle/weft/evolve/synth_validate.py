"""Execution validation of a synthesised environment, in the sandbox, with failures localised to one stage.

Seed: WEFT 4.1 (stateful environment synthesis: execution validation with normal and boundary calls;
queries checked against state, updates against the database diff and a read-back). Generated code is
untrusted: the schema, seed rows, backend and checks run only inside :func:`treadle.sandbox.run_python`
(own network namespace, read-only filesystem but for its work directory, time and memory limits
enforced by the parent), never in this process. The harness script that drives them is ours; it
reports one JSON line per check as it goes, so a backend that never returns is still localised to
the tool it was running.

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

from treadle.weft.verify import contains


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


_HARNESS = r'''
import json, sqlite3, sys
spec = json.load(open("spec.json"))
def emit(**kw):
    sys.stdout.write(json.dumps(kw, default=str) + "\n"); sys.stdout.flush()
db = sqlite3.connect("state.db")
try:
    db.executescript(spec["ddl"]); db.executescript(spec["seed"]); db.commit()
except Exception as e:
    emit(event="schema_error", error=f"{type(e).__name__}: {e}"); sys.exit(0)
tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
emit(event="tables", tables=tables)
ns = {"__name__": "generated_backend"}
try:
    exec(compile(open("backend.py").read(), "backend.py", "exec"), ns)
except BaseException as e:
    emit(event="import_error", error=f"{type(e).__name__}: {e}"); sys.exit(0)
def dump():
    return {t: [list(r) for r in db.execute(f"SELECT * FROM {t} ORDER BY 1")] for t in tables}
for i, c in enumerate(spec["checks"]):
    fn = ns.get(c["tool"])
    if not callable(fn):
        emit(event="check", i=i, missing=True); continue
    emit(event="start", i=i, tool=c["tool"])
    before = dump()
    try:
        out = fn(db, **c["args"]); db.commit(); err = None
    except Exception as e:
        db.rollback(); out = None; err = f"{type(e).__name__}: {e}"
    after = dump()
    state = []
    for sql, _ in c["state"]:
        try:
            state.append([list(r) for r in db.execute(sql)])
        except Exception as e:
            state.append({"error": f"{type(e).__name__}: {e}"})
    emit(event="check", i=i, result=out, error=err, changed=[t for t in tables if before[t] != after[t]], state=state)
emit(event="done")
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
    spec = {"ddl": schema.ddl, "seed": schema.seed, "checks": [c.model_dump(mode="json") for c in checks.checks]}
    res = run_python(_HARNESS, limits=limits, files={"spec.json": json.dumps(spec), "backend.py": backend.source},
                     python_args=("-I",))
    events = []
    for line in res.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
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
    for i, c in enumerate(checks.checks):
        tool = tools.get(c.tool)
        if tool is None:
            failures.append(Failure(stage=Stage.checks, check=i, detail=f"check names unknown tool {c.tool!r}"))
            continue
        e = done.get(i)
        if e is None:
            if started and started[-1]["i"] == i and res.termination != "exit":
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

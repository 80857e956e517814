"""Tool documentation against tool behaviour: an LLM judge whose claims are accepted only when execution confirms
them (seed: WEFT 5.1, environment faults; a tool whose description contradicts what it does makes a policy that
follows the description fail, and that failure is the environment's, not the policy's).

The executable contract checks (:func:`~treadle.weft.evolve.probes.contract_violations`) decide what a tool's
machine-readable contract states (declared writes, read-only tools, argument-to-column mappings, ``+=``/``-=``
directions). What only its prose states (units of an argument or a result, the direction of a change, "does not
change anything" of a tool whose contract says nothing) needs a reader:

- :func:`doc_statements` finds, offline, the statements of a tool's description and its arguments' descriptions
  that claim units, a direction or a read-only tool, and whether the contract already encodes them;
- :func:`unit_confusions`: a policy call whose numeric argument is the reference's value converted between units
  (x100, x1000, C <-> F, gallons <-> litres, miles <-> km, ...) on a tool whose units only its prose states:
  the failure may be the documentation's. Offline this is reported **undecided** (never a silent policy verdict);
- :func:`judge_tools` asks an LLM role (default ``doc_judge``) whether the documentation and the observed behaviour
  (each call of the trajectory and of the reference: arguments, result, state change) disagree. Its answer is a
  list of typed :class:`DocClaim` (``writes_state``, ``no_effect``, ``direction``, ``scale``), each turned into an
  execution check (:func:`check_claim`): the quoted documentation must be the tool's, and the tool is probed with a
  known input (the observed call, and the same call with the source argument doubled) and its result or state
  change compared with the claimed and with the documented relation. A claim is accepted only when the probe fits
  the claim and not the documentation; a refuted claim changes nothing;
- :func:`doc_behaviour` is the attribution step the evolution loop runs on a failure the deterministic rules blame
  on the policy (:func:`~treadle.weft.evolve.loop.attribute_failure`): a confirmed claim about a tool the policy
  called makes it ``environment`` (rule ``doc_behaviour``); offline, or when the judge fails, a unit confusion
  makes it ``undecided`` (rule ``doc_behaviour_undecided``).

The model's answer is hostile input: at most :data:`MAX_ANSWER` characters are read (a longer answer is a typed
failure), JSON is parsed by :func:`~treadle.untrusted.loads_json` (bounded nesting), at most :data:`MAX_CLAIMS`
claims are checked, each probe runs under a time limit, and every stored text is clipped with keys masked.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treadle.untrusted import clip, fenced_blocks, loads_json
from treadle.weft.runtime.callparse import ToolCall

__all__ = ["DOC_ROLE", "CheckedClaim", "DocClaim", "DocJudgement", "DocStatement", "DocVerdict", "check_claim",
           "doc_behaviour", "doc_statements", "judge_tools", "unit_confusions"]

DOC_ROLE = "doc_judge"
"""The ``treadle.llm`` role asked by :func:`judge_tools`."""
MAX_ANSWER = 20_000
"""Characters of a judge's answer read at most (a longer answer is a failure, not parsed)."""
MAX_CLAIMS = 8
"""Claims of one answer checked at most."""
PROBE_TIMEOUT_S = 30.0
"""Seconds one claim's execution check may take."""

_UNITS = re.compile(r"\b(celsius|fahrenheit|kelvin|degrees?|cents?|dollars?|euros?|pounds?|gallons?|lit(?:er|re)s?|"
                    r"miles?|kilomet(?:er|re)s?|km|meters?|metres?|feet|foot|inch(?:es)?|kg|kilograms?|grams?|"
                    r"percent(?:age)?|seconds?|minutes?|hours?|milliseconds?|ms)\b", re.I)
_DIRECTION = re.compile(r"\b(increase[sd]?|decrease[sd]?|add(?:s|ed)? to|subtract(?:s|ed)?|raise[sd]?|lower(?:s|ed)?|"
                        r"reduce[sd]?|return(?:s|ed)? (?:\w+ )?to stock|refund(?:s|ed)?)\b", re.I)
_READ_ONLY = re.compile(r"\b(read[- ]only|does not (?:change|modify|alter|write)|without (?:changing|modifying)|"
                        r"only reads|no side effects?|never (?:changes|modifies|writes))\b", re.I)
_CONVERSIONS: tuple[tuple[str, float, float], ...] = (
    ("x100 (e.g. dollars -> cents)", 100.0, 0.0), ("x1000 (e.g. seconds -> milliseconds, kg -> g)", 1000.0, 0.0),
    ("x60 (minutes / hours)", 60.0, 0.0), ("x3600 (hours -> seconds)", 3600.0, 0.0),
    ("Celsius -> Fahrenheit", 1.8, 32.0), ("Celsius -> Kelvin", 1.0, 273.15),
    ("gallons -> litres", 3.78541, 0.0), ("miles -> km", 1.60934, 0.0), ("pounds -> kg", 0.453592, 0.0),
    ("feet -> metres", 0.3048, 0.0), ("inches -> cm", 2.54, 0.0))


class DocStatement(BaseModel):
    """A statement of a tool's documentation that makes a checkable claim; ``covered``: the tool's contract encodes
    it (the contract probes check it without a judge)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tool: str
    arg: str | None = None
    kind: Literal["units", "direction", "read_only"]
    text: str
    covered: bool


def _props(tool: dict) -> dict[str, dict]:
    schema = tool.get("input_schema") or tool.get("inputSchema") or tool.get("parameters") or {}
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _docs(tool: dict) -> str:
    """The tool's whole documentation: its description and each argument's."""
    parts = [str(tool.get("description") or "")]
    parts += [f"{a}: {p.get('description')}" for a, p in _props(tool).items() if isinstance(p, dict)
              and p.get("description")]
    return "\n".join(parts)


def doc_statements(tool: dict) -> list[DocStatement]:
    """The unit, direction and read-only statements of ``tool``'s description (tool level) and of its arguments'
    descriptions (argument level), each with whether its contract encodes it (an argument the contract maps to a
    column; a ``+=``/``-=`` clause; declared writes, which a read-only statement contradicts or an empty list
    confirms)."""
    from treadle.weft.evolve.probes import contract_clauses

    contract = tool.get("contract") or {}
    a2s = contract.get("args_to_state") or {}
    writes = contract.get("writes")
    signed = any(op in ("+=", "-=") for spec in a2s.values() for _, _, op, _ in contract_clauses(spec))
    name = str(tool.get("name") or "")
    out = []
    texts = [(None, str(tool.get("description") or ""))]
    texts += [(a, str(p.get("description") or "")) for a, p in _props(tool).items() if isinstance(p, dict)]
    for arg, text in texts:
        if not text:
            continue
        if _UNITS.search(text):
            out.append(DocStatement(tool=name, arg=arg, kind="units", text=clip(text, 300),
                                    covered=arg is not None and arg in a2s))
        if _DIRECTION.search(text):
            out.append(DocStatement(tool=name, arg=arg, kind="direction", text=clip(text, 300), covered=signed))
        if _READ_ONLY.search(text):
            out.append(DocStatement(tool=name, arg=arg, kind="read_only", text=clip(text, 300),
                                    covered=writes is not None and not writes))
    return out


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 + 0.005 * max(abs(a), abs(b), 1.0)


def unit_confusions(policy_calls: Sequence[ToolCall], gold: Sequence[ToolCall], tools: dict[str, dict]) -> list[str]:
    """``tool.arg: policy value = reference value converted (how)`` for each numeric argument of a policy call that is
    a reference call's value of the same tool and argument under a unit conversion, where the tool's units are
    stated only in its prose (an uncovered ``units`` statement of the tool or of that argument)."""
    out = []
    for c in policy_calls:
        tool = tools.get(c.name) or {}
        mapped = set(((tool.get("contract") or {}).get("args_to_state") or {}))
        units = {s.arg for s in doc_statements(tool) if s.kind == "units" and not s.covered}
        if not units:
            continue
        for g in (g for g in gold if g.name == c.name):
            for arg, v in c.arguments.items():
                x, y = _number(g.arguments.get(arg)), _number(v)
                if x is None or y is None or x == y or x == 0 or arg in mapped or not ({None, arg} & units):
                    continue
                for how, f, off in _CONVERSIONS:
                    if _close(y, f * x + off) or _close(x, f * y + off):
                        out.append(f"{c.name}.{arg}: {v!r} is the reference's {g.arguments[arg]!r} converted "
                                   f"({how}); the tool's units are stated only in its documentation")
                        break
    return sorted(set(out))


class DocClaim(BaseModel):
    """One disagreement the judge claims between a tool's documentation and its behaviour.

    Attributes:
        tool: the tool; kind: ``writes_state`` (documented as not changing anything, it changes state),
            ``no_effect`` (documented as changing something, it changes nothing), ``direction`` (``target`` moves
            the other way than documented: ``direction`` is what it does), ``scale`` (``target`` = ``factor`` *
            ``source`` + ``offset``, where the documentation implies ``documented_factor`` * ``source`` +
            ``documented_offset``).
        documented: the words of the documentation the claim is about (quoted from it: checked).
        observed: what the judge says the tool does.
        source: ``arg:<argument>`` or, for object state, ``state:<attribute path>`` (its value before the call).
        target: ``result`` / ``result:<key path>`` or ``state:<table>.<column>`` (SQLite) / ``state:<attribute
            path>`` (object state); measure: the target's value after the call, or its change.
    """

    model_config = ConfigDict(extra="forbid")
    tool: str = Field(max_length=200)
    kind: Literal["writes_state", "no_effect", "direction", "scale"]
    documented: str = Field(max_length=500)
    observed: str = Field("", max_length=500)
    source: str | None = Field(None, max_length=200)
    target: str | None = Field(None, max_length=200)
    measure: Literal["value", "change"] = "value"
    direction: Literal["increase", "decrease"] | None = None
    factor: float | None = Field(None, allow_inf_nan=False)
    offset: float = Field(0.0, allow_inf_nan=False)
    documented_factor: float = Field(1.0, allow_inf_nan=False)
    documented_offset: float = Field(0.0, allow_inf_nan=False)


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    claims: list[DocClaim] = Field(default_factory=list)
    reason: str = Field("", max_length=2000)


class CheckedClaim(BaseModel):
    """A claim and its execution check: ``confirmed`` or not, and what the probe showed."""

    model_config = ConfigDict(extra="forbid")
    claim: DocClaim
    confirmed: bool
    evidence: str


class DocJudgement(BaseModel):
    """The judge's answer on one trajectory: its checked claims, or ``error`` (a failed call, a malformed or
    oversized answer) with nothing accepted."""

    model_config = ConfigDict(extra="forbid")
    role: str
    checked: list[CheckedClaim] = Field(default_factory=list)
    error: str | None = None
    answer: str = ""

    @property
    def confirmed(self) -> list[CheckedClaim]:
        return [c for c in self.checked if c.confirmed]

    @property
    def refuted(self) -> list[CheckedClaim]:
        return [c for c in self.checked if not c.confirmed]


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w%]+", " ", text.lower()).split())


def _probe_call(claim: DocClaim, sequences: Sequence[Sequence[ToolCall]]) -> tuple[list[ToolCall], ToolCall] | None:
    """The first call of the claim's tool in ``sequences`` (the reference first), with the calls before it."""
    for seq in sequences:
        for i, c in enumerate(seq):
            if c.name == claim.tool:
                return list(seq[:i]), c
    return None


def _path(value: Any, path: str) -> Any:
    for part in [p for p in path.split(".") if p]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _target_values(target: str, result: Any, diff: Any, kind: str) -> list[tuple[float | None, float | None]]:
    """``(before, after)`` numbers of ``target`` in one probe: a result (before None) or a state change."""
    if target == "result" or target.startswith("result:"):
        y = _number(_path(result, target[len("result:"):]) if target != "result" else result)
        return [] if y is None else [(None, y)]
    if not target.startswith("state:"):
        return []
    where = target[len("state:"):]
    if kind == "sqlite":
        table, _, col = where.partition(".")
        td = diff.tables.get(table)
        if td is None or not col:
            return []
        pairs = [(None, r.get(col)) for r in td.added.values()]
        pairs += [(ch.before.get(col), ch.after.get(col)) for ch in td.changed.values()]
        return [(_number(b), _number(a)) for b, a in pairs if _number(a) is not None]
    out = []
    for td in diff.tables.values():
        if where in td.added:
            out.append((None, _number(td.added[where])))
        if where in td.changed:
            out.append((_number(td.changed[where].before), _number(td.changed[where].after)))
    return [(b, a) for b, a in out if a is not None]


async def _run(rt: Any, server_hash: str, start: Any, prefix: Sequence[ToolCall], call: ToolCall, *,
               source_path: str | None = None) -> tuple[Any, Any, float | None]:
    """``(outcome, state change of the call, value of the object attribute source_path before it)``."""
    sid = await rt.create_session(server_hash, start)
    try:
        for c in prefix:
            await rt.call_tool(sid, c.name, c.arguments)
        before = rt.snapshot(sid)
        src = _state_value(rt, server_hash, before, source_path) if source_path else None
        o = await rt.call_tool(sid, call.name, call.arguments)
        back = rt.diff(sid, before)  # now -> before: reversed below into before -> now
        diff = type(back)(tables={t: type(d)(added=d.removed, removed=d.added,
                                             changed={k: type(v)(before=v.after, after=v.before)
                                                      for k, v in d.changed.items()})
                                  for t, d in back.tables.items()})
        return o, diff, src
    finally:
        await rt.close(sid)


def _state_value(rt: Any, server_hash: str, snapshot: Any, path: str) -> float | None:
    """The number at the attribute ``path`` of an object-state ``snapshot`` (None for SQLite or a non-number)."""
    if snapshot.kind != "object":
        return None
    from treadle.weft.runtime.object_state import ObjectState
    from treadle.weft.runtime.registry import release_module

    module, weft = rt.registry.load(server_hash)
    try:
        st = ObjectState(snapshot, weft.state_class)
        try:
            value: Any = st.handle
            for part in [p for p in path.split(".") if p][:16]:
                if isinstance(value, dict):
                    value = value.get(part)
                elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                    value = value[int(part)]
                elif hasattr(value, "__dict__") and not part.startswith("_"):
                    value = vars(value).get(part)
                else:
                    return None
            return _number(value)
        finally:
            st.close()
    finally:
        release_module(module)


async def check_claim(rt: Any, server_hash: str, start: Any, claim: DocClaim, tools: dict[str, dict],
                      sequences: Sequence[Sequence[ToolCall]]) -> CheckedClaim:
    """The execution check of ``claim`` (see the module docstring): the tool probed from ``start`` on
    ``server_hash`` with the first observed call of it in ``sequences`` (after the calls before it), and, for a
    ``scale`` claim on an argument, the same call with that argument doubled."""
    import anyio

    def done(ok: bool, why: str) -> CheckedClaim:
        return CheckedClaim(claim=claim, confirmed=ok, evidence=clip(why, 500))

    tool = tools.get(claim.tool)
    if tool is None:
        return done(False, f"no tool {claim.tool!r} on this server")
    quote = _norm(claim.documented)
    if len(quote) < 3 or quote not in _norm(_docs(tool)):
        return done(False, f"{claim.documented!r} is not in {claim.tool}'s documentation")
    found = _probe_call(claim, sequences)
    if found is None:
        return done(False, f"{claim.tool} is not called by the trajectory or the reference: nothing to probe")
    prefix, call = found
    try:
        with anyio.fail_after(PROBE_TIMEOUT_S):
            return await _check(rt, server_hash, start, claim, prefix, call, done)
    except TimeoutError:
        return done(False, f"the probe took over {PROBE_TIMEOUT_S:.0f} s")


async def _check(rt: Any, server_hash: str, start: Any, claim: DocClaim, prefix: list[ToolCall], call: ToolCall,
                 done: Any) -> CheckedClaim:
    kind = start.kind
    if claim.kind in ("writes_state", "no_effect"):
        o, diff, _ = await _run(rt, server_hash, start, prefix, call)
        if not o.ok:
            return done(False, f"{call} fails: {o.text[:200]}")
        changed = sorted(diff.touched())
        if claim.kind == "writes_state":
            return done(bool(changed), f"{call} changed {changed}" if changed else f"{call} changed nothing")
        return done(not changed, f"{call} changed nothing" if not changed else f"{call} changed {changed}")
    if not claim.target:
        return done(False, f"a {claim.kind} claim needs a target")
    if claim.kind == "direction":
        if claim.direction is None:
            return done(False, "a direction claim needs its direction")
        o, diff, _ = await _run(rt, server_hash, start, prefix, call)
        moves = [(b, a) for b, a in _target_values(claim.target, o.result, diff, kind) if b is not None and a != b]
        if not o.ok or not moves:
            return done(False, f"{call} moves no number at {claim.target}" + ("" if o.ok else f": {o.text[:200]}"))
        up = all(a > b for b, a in moves)
        down = all(a < b for b, a in moves)
        ok = up if claim.direction == "increase" else down
        return done(ok, f"{call}: {claim.target} went {[(b, a) for b, a in moves][:3]}")
    if claim.factor is None or not claim.source:
        return done(False, "a scale claim needs a source and a factor")
    if _close(claim.factor, claim.documented_factor) and _close(claim.offset, claim.documented_offset):
        return done(False, "the claimed relation is the documented one: no disagreement")
    probes: list[ToolCall] = [call]
    if claim.source.startswith("arg:"):
        arg = claim.source[len("arg:"):]
        x = _number(call.arguments.get(arg))
        if x is None:
            return done(False, f"{call} has no numeric argument {arg!r}")
        x2 = x * 2 if x else 1
        if isinstance(call.arguments[arg], int):
            x2 = int(x2)
        probes.append(ToolCall(name=call.name, arguments={**call.arguments, arg: x2}))
    elif not (claim.source.startswith("state:") and kind == "object"):
        return done(False, f"source {claim.source!r}: expected arg:<argument> (or state:<path> for object state)")
    seen, fits = [], 0
    for p in probes:
        path = claim.source[len("state:"):] if claim.source.startswith("state:") else None
        o, diff, src = await _run(rt, server_hash, start, prefix, p, source_path=path)
        if not o.ok:
            if p is call:
                return done(False, f"{p} fails: {o.text[:200]}")
            continue  # a doubled input the tool refuses: the first probe alone decides
        x = _number(p.arguments.get(claim.source[4:])) if path is None else src
        values = _target_values(claim.target, o.result, diff, kind)
        if x is None or not values:
            return done(False, f"{p}: no number at {claim.target}" + (" or its source" if x is None else ""))
        b, a = values[0]
        y = a - (b or 0.0) if claim.measure == "change" else a
        claimed, documented = claim.factor * x + claim.offset, claim.documented_factor * x + claim.documented_offset
        seen.append(f"{claim.source}={x:g} -> {claim.target}={y:g} (claimed {claimed:g}, documented {documented:g})")
        if not _close(y, claimed) or _close(y, documented):
            return done(False, "the probe does not fit the claim against the documentation: " + "; ".join(seen))
        fits += 1
    return done(fits > 0, "; ".join(seen))


async def _observe(rt: Any, server_hash: str, start: Any, calls: Sequence[ToolCall], limit: int = 32
                   ) -> list[dict[str, Any]]:
    """What each call (at most ``limit``) does from ``start`` in order: ok, result and state change, clipped."""
    sid = await rt.create_session(server_hash, start)
    out = []
    try:
        before = rt.snapshot(sid)
        for c in list(calls)[:limit]:
            o = await rt.call_tool(sid, c.name, c.arguments)
            back = rt.diff(sid, before)
            change = {t: {"added": list(d.removed.values())[:5],
                          "changed": [{"before": v.after, "after": v.before} for v in list(d.changed.values())[:5]],
                          "removed": list(d.added.values())[:5]} for t, d in back.tables.items() if not d.empty}
            out.append({"call": clip(c, 400), "ok": o.ok,
                        "result": clip(json.dumps(o.result, default=repr), 800) if o.ok else clip(o.text, 300),
                        "state_change": clip(json.dumps(change, default=repr), 1200)})
            before = rt.snapshot(sid)
    finally:
        await rt.close(sid)
    return out


def _tool_view(tool: dict) -> dict[str, Any]:
    return {"name": tool.get("name"), "description": clip(tool.get("description") or "", 1500),
            "arguments": {a: clip(json.dumps(p, default=repr), 400) for a, p in list(_props(tool).items())[:30]},
            "contract": clip(json.dumps(tool.get("contract") or {}, default=repr), 800)}


_SYSTEM = ("You compare the documentation of the tools of an environment with what they did. Report only "
           "disagreements between a tool's documentation and its observed behaviour: units of an argument or a "
           "result, the direction of a change, a tool documented as not changing anything that changes state, a tool "
           "documented as changing something that changes nothing. Each claim is checked by running the tool; quote "
           "the documentation word for word in \"documented\". Answer with one JSON object "
           '{"claims": [...], "reason": "<one sentence>"}; "claims" is [] when they agree.')


def _json_of(text: str) -> Any:
    blocks = fenced_blocks(text)
    return loads_json(blocks[0] if blocks else text, duplicates=True, what="the judge's JSON")


async def judge_tools(client: Any, rt: Any, server_hash: str, start: Any, sequences: dict[str, Sequence[ToolCall]],
                      tools: dict[str, dict], *, role: str = DOC_ROLE, request: str = "") -> DocJudgement:
    """Ask the LLM ``role`` whether the documentation of the tools called in ``sequences`` (``{"reference": calls,
    "policy": calls}``) disagrees with what those calls did from ``start`` on ``server_hash``; check each claim by
    execution (:func:`check_claim`). A failed call, an oversized or malformed answer is a :class:`DocJudgement`
    with ``error`` and nothing accepted (never raised)."""
    from treadle.llm import LLMCallError

    roles = getattr(getattr(client, "config", None), "roles", None)
    if roles is not None and role not in roles:
        return DocJudgement(role=role, error=f"no role {role!r} in the LLM config")
    called = sorted({c.name for seq in sequences.values() for c in seq if c.name in tools})
    seen = {k: await _observe(rt, server_hash, start, v) for k, v in sequences.items()}
    body = {"request": clip(request, 2000), "tools": [_tool_view(tools[n]) for n in called[:20]], "observed": seen,
            "claim_json_schema": DocClaim.model_json_schema()}
    messages = [{"role": "system", "content": _SYSTEM},
                {"role": "user", "content": json.dumps(body, sort_keys=True, default=str)}]
    try:
        r = await client.chat(messages, role=role, tag="weft-doc-judge")
    except LLMCallError as err:
        return DocJudgement(role=role, error=clip(f"{role} call failed: {err.failure.kind.value}: "
                                                   f"{err.failure.message}", 500))
    text = r.text if isinstance(r.text, str) else ""
    if len(text) > MAX_ANSWER:
        return DocJudgement(role=role, answer=clip(text, 2000),
                            error=f"answer of {len(text)} characters, over the {MAX_ANSWER} read")
    try:
        ans = _Answer.model_validate(_json_of(text))
    except (ValueError, ValidationError) as err:
        return DocJudgement(role=role, answer=clip(text, 2000),
                            error=clip(f"malformed answer (not the JSON asked for): {str(err).splitlines()[0]}", 300))
    order = [sequences[k] for k in ("reference", "policy") if k in sequences]
    order += [v for k, v in sequences.items() if k not in ("reference", "policy")]
    checked = [await check_claim(rt, server_hash, start, c, tools, order) for c in ans.claims[:MAX_CLAIMS]]
    return DocJudgement(role=role, checked=checked, answer=clip(text, 2000))


class DocVerdict(BaseModel):
    """What :func:`doc_behaviour` says of a failure blamed on the policy: a new ``blame`` (None: the policy verdict
    stands) with its rule and detail, and the judge's record (``llm``) when one was asked."""

    model_config = ConfigDict(extra="forbid")
    blame: Literal["environment", "undecided"] | None = None
    rule: str = ""
    detail: str = ""
    llm: dict[str, Any] | None = None


async def doc_behaviour(rt: Any, server_hash: str, start: Any, evidence: Any, outcomes: Sequence[Any],
                        tools: dict[str, dict], *, client: Any = None, role: str = DOC_ROLE,
                        request: str = "") -> DocVerdict | None:
    """The documentation/behaviour step for a failure the deterministic rules blame on the policy (module
    docstring); None when no tool the policy called states in prose what its contract does not (nothing for a
    judge to decide)."""
    gold = list(evidence.calls)
    policy = [ToolCall(name=o.call.name, arguments=dict(o.call.arguments)) for o in outcomes]
    used = {c.name for c in policy}
    if not any(not s.covered for n in sorted(used) for s in doc_statements(tools.get(n) or {})):
        return None
    confusions = unit_confusions(policy, gold, tools)
    roles = getattr(getattr(client, "config", None), "roles", None) or {}
    if client is None or role not in roles:
        if not confusions:
            return None
        return DocVerdict(blame="undecided", rule="doc_behaviour_undecided", detail=clip(
            "; ".join(confusions) + f": whether the documentation or the policy is wrong needs the LLM role {role!r} "
            "(a judge validated by execution)", 500))
    j = await judge_tools(client, rt, server_hash, start, {"reference": gold, "policy": policy}, tools, role=role,
                          request=request)
    llm = {"role": role, "answer": j.answer, "error": j.error,
           "checked": [c.model_dump(mode="json") for c in j.checked]}
    hits = [c for c in j.confirmed if c.claim.tool in used]
    if hits:
        return DocVerdict(blame="environment", rule="doc_behaviour", llm=llm, detail=clip("; ".join(
            f"{c.claim.tool}: documented {c.claim.documented!r}, does {c.claim.observed or c.claim.kind!r}; confirmed "
            f"by execution: {c.evidence}" for c in hits), 500))
    if j.error is not None and confusions:
        return DocVerdict(blame="undecided", rule="doc_behaviour_undecided", llm=llm,
                          detail=clip("; ".join(confusions) + f"; the judge gave no usable answer: {j.error}", 500))
    return DocVerdict(llm=llm)

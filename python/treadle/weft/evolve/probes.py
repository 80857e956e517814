"""Executable checks of environments and harnesses that hold off the reference's path (seed: WEFT 5.1).

- :func:`contract_violations`: a tool's behaviour against its declared contract (seed: WEFT 4.1 contracts:
  ``reads``, ``writes``, ``args_to_state``): a read-only tool that writes, a write to a table the contract
  does not name, a stored value that is not the argument's (units: ``amount_cents`` stored x100), an
  assignment to another value (``:= 'high'`` writes ``'low'``), a change in the wrong direction (``+= qty``
  decreases; a declared ``+=`` / ``-=`` that changes nothing), a write to a row other than the one the key
  argument names (wrong-row write), and a row of the tool's own object left in another state than the one its
  name declares (``open_ticket`` storing a ``closed`` ticket: :func:`named_state_violations`, from the schema's
  ``CHECK (col IN (...))`` domains). It needs no healthy server, so it finds bugs present at certification (born
  broken).
- :func:`input_variants`: inputs the schema allows other than the reference's: another letter case or
  surrounding spaces of an identifier, list items in another order, an optional argument given its default,
  every value of an enumerated argument,
  other values of the same column from the start state (the entity pool), the bounds the schema gives an
  integer argument.
- :func:`off_path_difference`: the same calls on the healthy (certified) and the current server from the same
  start; the first call whose outcome or state change differs.
- :func:`harness_faults`: a harness that cannot carry the reference calls (its parser does not read back what
  its format writes), or whose instructions do not teach the format its parser reads.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from treadle.weft.runtime.callparse import ToolCall

_CLAUSE = re.compile(r"^\s*(\w+)\.(\w+)\s*(:=|\+=|-=)?\s*(.*?)\s*$")


def contract_clauses(spec: str) -> list[tuple[str, str, str, str]]:
    """``(table, column, op, rhs)`` of each clause of an ``args_to_state`` value (op ``""`` for a plain mapping);
    clauses of other shapes (``order_items(sku, qty)``) are left out."""
    out = []
    for part in str(spec).split(";"):
        m = _CLAUSE.match(part)
        if m and (m.group(3) or not m.group(4)):
            out.append((m.group(1), m.group(2), m.group(3) or "", m.group(4).strip()))
    return out


def _rows_touched(diff: Any, table: str) -> list[tuple[dict | None, dict | None]]:
    td = diff.tables.get(table)
    if td is None:
        return []
    return ([(None, r) for r in td.added.values()] + [(c.before, c.after) for c in td.changed.values()]
            + [(r, None) for r in td.removed.values()])


_CHECK_IN = re.compile(r"CHECK\s*\(\s*\"?(\w+)\"?\s+IN\s*\(([^)]*)\)\s*\)", re.I)


def state_domains(con: Any) -> dict[str, dict[str, set[str]]]:
    """``{table: {column: allowed values}}`` from the schema's ``CHECK (column IN ('a', 'b'))`` constraints
    (``con``: a SQLite connection); tables without any are left out."""
    out: dict[str, dict[str, set[str]]] = {}
    for t, sql in con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL"):
        for col, values in _CHECK_IN.findall(sql):
            vals = set(re.findall(r"'([^']*)'", values))
            if vals:
                out.setdefault(t, {})[col] = vals
    return out


def _verb_forms(verb: str) -> set[str]:
    forms = {verb, verb + "ed", verb + "d", verb + verb[-1:] + "ed"}
    if verb.endswith("y"):
        forms.add(verb[:-1] + "ied")
    return forms


def named_state_violations(name: str, diff: Any, domains: dict[str, dict[str, set[str]]]) -> list[str]:
    """Rows of the tool's own object (``open_ticket`` -> ``tickets``) that ``name`` added or changed and left in
    another state than the one its name declares: the verb (or its participle) is a value of an enumerated
    column of that table (``open`` of ``status IN ('open', 'closed')``) and the row holds another value."""
    verb, _, obj = name.lower().partition("_")
    if not obj:
        return []
    forms = _verb_forms(verb)
    out = []
    for table in (obj, obj + "s", obj + "es"):
        td = diff.tables.get(table)
        for col, allowed in (domains.get(table) or {}).items():
            named = forms & allowed
            if td is None or len(named) != 1:
                continue
            want = next(iter(named))
            rows = [*td.added.values(), *(c.after for c in td.changed.values())]
            bad = [r.get(col) for r in rows if col in r and r.get(col) != want]
            if bad:
                out.append(f"{name} left {table}.{col}={bad[0]!r}; its name declares {want!r}")
    return out


def contract_violations(tool: dict, call: ToolCall, diff: Any,
                        domains: dict[str, dict[str, set[str]]] | None = None) -> list[str]:
    """What ``call`` (one successful call of ``tool``, whose state change is ``diff``) did against the tool's
    contract (and, given the schema's ``domains``, against the state its name declares); ``[]`` when it kept it
    (see the module docstring)."""
    contract = tool.get("contract") or {}
    writes = set(contract.get("writes") or ())
    touched = diff.touched()
    name = call.name
    if not writes:
        return [f"{name} is declared read-only but changed {sorted(touched)}"] if touched else []
    out = named_state_violations(name, diff, domains) if domains else []
    if touched - writes:
        out.append(f"{name} changed {sorted(touched - writes)}, not among its declared writes {sorted(writes)}")
    for arg, spec in (contract.get("args_to_state") or {}).items():
        if arg not in call.arguments:
            continue
        value = call.arguments[arg]
        clauses = contract_clauses(spec)
        if not clauses:
            continue
        t0, c0, op0, _ = clauses[0]
        keyed = op0 == "" and t0 in writes and (c0 == "id" or any(t == t0 for t, _, _, _ in clauses[1:]))
        for i, (table, col, op, rhs) in enumerate(clauses):
            if table not in writes:
                continue
            rows = _rows_touched(diff, table)
            if i == 0 and keyed:
                wrong = [r for b, a in rows for r in (a or b,) if r.get(col) != value]
                if wrong:
                    out.append(f"{name}({arg}={value!r}) changed {table} rows whose {col} is not {value!r}: "
                               f"{[r.get(col) for r in wrong][:3]} (a write to another row)")
                continue
            if keyed and table == t0:  # effects on the keyed row only
                rows = [(b, a) for b, a in rows if (a or b).get(c0) == call.arguments.get(arg)]
            after = [a for _, a in rows if a is not None]
            if op == "":
                if after and not any(a.get(col) == value for a in after):
                    out.append(f"{name} stored {table}.{col}={after[0].get(col)!r} for {arg}={value!r} "
                               "(the contract maps the argument to the column)")
                elif not rows and not keyed:
                    out.append(f"{name} wrote no {table} row for {arg}={value!r} (declared: {spec})")
            elif op == ":=":
                want = rhs.strip("'\"") if rhs[:1] in "'\"" else call.arguments.get(rhs, None)
                if want is None:
                    continue
                bad = [a.get(col) for a in after if a.get(col) != want]
                if bad:
                    out.append(f"{name} set {table}.{col} to {bad[0]!r}; its contract says := {want!r}")
                elif not after and keyed and table == t0:
                    out.append(f"{name}({arg}={value!r}) did not set {table}.{col} (declared := {want!r})")
            else:
                if not [1 for b, a in rows if b is not None and a is not None and b.get(col) != a.get(col)] \
                        and _declared_amount(call, rhs):
                    out.append(f"{name}({arg}=...) changed no {table}.{col}; its contract says {op} {rhs}")
                    continue
                for b, a in rows:
                    if b is None or a is None:
                        continue
                    x, y = b.get(col), a.get(col)
                    if not (isinstance(x, (int, float)) and isinstance(y, (int, float))) or x == y:
                        continue
                    if (y > x) != (op == "+="):
                        out.append(f"{name} changed {table}.{col} from {x} to {y}; its contract says {op} {rhs}")
                        break
                    amount = _amount(call, rhs, a)
                    if amount is not None and abs(y - x) != amount:
                        out.append(f"{name} changed {table}.{col} by {y - x}; its contract says {op} {rhs} "
                                   f"({rhs} = {amount})")
                        break
    return out


def _amount(call: ToolCall, rhs: str, row: dict) -> Any:
    """The size of a ``+= rhs`` / ``-= rhs`` change for ``row``: the argument ``rhs``, or the ``rhs`` field of the
    list item that names the row (an order line's ``qty`` for the product whose ``sku`` it gives); None when the
    call does not give it (the amount then comes from the state: only the direction is checked)."""
    v = call.arguments.get(rhs)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return abs(v)
    for value in call.arguments.values():
        for item in value if isinstance(value, list) else []:
            if isinstance(item, dict) and rhs in item and any(
                    k != rhs and row.get(k) == x for k, x in item.items()):
                return abs(item[rhs])
    return None


def _declared_amount(call: ToolCall, rhs: str) -> float:
    """The total size the call itself gives a ``+= rhs`` change (the argument, or the ``rhs`` fields of its list
    items), so a non-zero one must show; 0 when the call does not give it (the rows it names may hold none)."""
    values = [call.arguments.get(rhs)] + [item.get(rhs) for value in call.arguments.values()
                                          if isinstance(value, list) for item in value if isinstance(item, dict)]
    return sum(abs(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))


def _pool(con: Any, tool: dict, arg: str, limit: int = 4) -> list[Any]:
    """Other values of the column ``arg`` maps to (the entity pool of the start state)."""
    spec = ((tool.get("contract") or {}).get("args_to_state") or {}).get(arg)
    if con is None or not spec:
        return []
    clauses = contract_clauses(spec)
    if not clauses:
        return []
    table, col = clauses[0][0], clauses[0][1]
    try:
        return [v for (v,) in con.execute(f'SELECT DISTINCT "{col}" FROM "{table}" ORDER BY 1 LIMIT ?', (limit,))]
    except Exception:  # noqa: BLE001  (a contract naming a column the schema lacks: no pool)
        return []


def _free_text(value: Any) -> bool:
    return isinstance(value, str) and (" " in value.strip() or len(value) > 40)


def input_variants(call: ToolCall, tool: dict, con: Any = None) -> list[tuple[str, ToolCall]]:
    """``(how, call)`` for schema-allowed inputs near ``call`` (see the module docstring), without ``call``."""
    props = ((tool.get("input_schema") or tool.get("inputSchema") or tool.get("parameters") or {})
             .get("properties") or {})
    required = set(((tool.get("input_schema") or tool.get("inputSchema") or tool.get("parameters") or {})
                    .get("required") or ()))
    out: list[tuple[str, ToolCall]] = []

    def add(how: str, arg: str, v: Any) -> None:
        if v != call.arguments.get(arg, object()):
            out.append((how, ToolCall(name=call.name, arguments={**call.arguments, arg: v})))

    for arg, v in call.arguments.items():
        if isinstance(v, str) and not _free_text(v):
            add("letter_case", arg, v.upper())
            add("letter_case", arg, v[:1].upper() + v[1:])
            add("spaces", arg, f" {v} ")
        if isinstance(v, str) and _free_text(v):
            add("apostrophe", arg, v + " (customer's)")
        if isinstance(v, list) and len(v) >= 2:
            add("order", arg, list(reversed(v)))
        for other in _pool(con, tool, arg):
            if type(other) is type(v):
                add("entity_pool", arg, other)
    for arg, prop in props.items():
        v = call.arguments.get(arg)
        if isinstance(v, int) and not isinstance(v, bool):
            for bound in ("minimum", "maximum"):
                if bound in prop:
                    add("bound", arg, prop[bound])
        if arg not in call.arguments and arg not in required and "default" in prop:
            add("explicit_default", arg, prop["default"])
        for other in prop.get("enum") or ():  # every value of an enumerated argument, given or optional
            add("enum", arg, other)
    return out


async def run_calls(rt: Any, server_hash: str, start: Any, calls: Sequence[ToolCall]) -> tuple[list[Any], Any]:
    """Outcomes of ``calls`` from ``start`` on ``server_hash`` and the state change (start -> end)."""
    sid = await rt.create_session(server_hash, start)
    try:
        outs = [await rt.call_tool(sid, c.name, c.arguments) for c in calls]
        return outs, rt.diff(sid)
    finally:
        await rt.close(sid)


def _key(outs: Sequence[Any], diff: Any) -> str:
    return json.dumps([[o.ok, o.result if o.ok else None] for o in outs], default=repr, sort_keys=True) + \
        json.dumps(diff.model_dump(), default=repr, sort_keys=True)


async def _trace(rt: Any, server_hash: str, start: Any, calls: Sequence[ToolCall]) -> list[tuple[Any, str]]:
    """Per call: its outcome and a key of (ok, result, state change so far) on ``server_hash`` from ``start``."""
    sid = await rt.create_session(server_hash, start)
    try:
        out = []
        for c in calls:
            o = await rt.call_tool(sid, c.name, c.arguments)
            out.append((o, _key([o], rt.diff(sid))))
        return out
    finally:
        await rt.close(sid)


async def off_path_difference(rt: Any, healthy: str, current: str, start: Any, calls: Sequence[ToolCall],
                              limit: int = 64) -> str | None:
    """The first call of ``calls`` (at most ``limit``) whose outcome or state change differs between the healthy
    and the current server, each playing the calls in order from the same ``start``; None when they agree."""
    if healthy == current or healthy not in rt.registry:
        return None
    calls = list(calls)[:limit]
    a, b = await _trace(rt, healthy, start, calls), await _trace(rt, current, start, calls)
    for c, (ao, ak), (bo, bk) in zip(calls, a, b):
        if ak != bk:
            now = "fails" if not bo.ok else "returns or changes something else"
            return (f"{c}: the certified server {'accepts' if ao.ok else 'rejects'} it, the current one {now}"
                    + (f" ({bo.text[:120]})" if not bo.ok else ""))
    return None


async def probe_off_path(rt: Any, healthy: str, current: str, start: Any, gold: Sequence[ToolCall],
                         tools: dict[str, dict], con: Any = None, budget: int = 40) -> str | None:
    """Each gold call's :func:`input_variants` (after the gold calls before it), on the healthy and the current
    server: the first variant the healthy server accepts and the current one treats otherwise, or None."""
    if healthy == current or healthy not in rt.registry:
        return None
    n = 0
    for i, call in enumerate(gold):
        for how, v in input_variants(call, tools.get(call.name) or {}, con):
            if n >= budget:
                return None
            n += 1
            seq = [*gold[:i], v]
            a_outs, a_diff = await run_calls(rt, healthy, start, seq)
            if not all(o.ok for o in a_outs):
                continue
            b_outs, b_diff = await run_calls(rt, current, start, seq)
            if _key(a_outs, a_diff) != _key(b_outs, b_diff):
                return f"{v} ({how}): accepted by the certified server, treated otherwise by the current one"
    return None


async def contract_probe(rt: Any, server_hash: str, start: Any, calls: Sequence[ToolCall], tools: dict[str, dict]
                         ) -> list[str]:
    """Play ``calls`` from ``start`` one by one and check each successful call's state change against its tool's
    contract and the state its name declares (:func:`contract_violations` with the start's
    :func:`state_domains`)."""
    domains: dict[str, dict[str, set[str]]] = {}
    if getattr(start, "kind", None) == "sqlite":
        from treadle.weft.evolve.grounding import open_copy

        con = open_copy(start)
        try:
            domains = state_domains(con)
        finally:
            con.close()
    sid = await rt.create_session(server_hash, start)
    out: list[str] = []
    try:
        before = rt.snapshot(sid)
        for c in calls:
            o = await rt.call_tool(sid, c.name, c.arguments)
            if not o.ok:
                break
            diff = rt.diff(sid, before)
            diff = type(diff)(tables={t: type(d)(added=d.removed, removed=d.added,
                                                 changed={k: type(v)(before=v.after, after=v.before)
                                                          for k, v in d.changed.items()})
                                      for t, d in diff.tables.items()})  # rt.diff(sid, other) is now -> other
            out += contract_violations(tools.get(c.name) or {}, c, diff, domains)
            before = rt.snapshot(sid)
    finally:
        await rt.close(sid)
    return out


_MARKER = re.compile(r"</?[A-Za-z_][\w-]*>|^\s*([A-Z][A-Za-z ]{0,30}?)\s*:", re.M)


def harness_faults(harness: Any, calls: Sequence[ToolCall], tools: Sequence[dict] = ()) -> list[str]:
    """Why ``harness`` cannot carry ``calls`` (``[]`` when it can): its parser does not read back what its own
    format writes (a parser or format bug), or its instructions do not name a marker its format uses (a prompt
    that teaches another format than the parser reads)."""
    calls = [c for c in calls]
    if not calls:
        return []
    out = []
    try:
        rendered = harness.render(calls)
        back = [(c.name, dict(c.arguments)) for c in harness.parse(rendered).calls]
    except Exception as err:  # noqa: BLE001  (a harness that raises on its own format is broken)
        return [f"{type(harness).__name__} raised on its own format: {type(err).__name__}: {err}"]
    want = [(c.name, dict(c.arguments)) for c in calls]
    if back != want:
        out.append(f"{type(harness).__name__} reads back {back[:2]} from its own rendering of {want[:2]}")
    text = getattr(rendered, "text", "") or ""
    try:
        instructions = harness.instructions(list(tools)) or ""
    except Exception:  # noqa: BLE001
        instructions = ""
    if text and instructions:
        body = re.sub(r"\{.*\}", "", text, flags=re.S)
        markers = {(m.group(1) + ":") if m.group(1) else m.group(0) for m in _MARKER.finditer(body)}
        markers = {m for m in markers if not m.startswith("Thought")}
        missing = sorted(m for m in markers if m not in instructions)
        if missing:
            out.append(f"{type(harness).__name__}'s instructions never name {missing}, which its format uses")
    return out

"""Checks of a task's semantics against its request, by execution and by the data (seed: WEFT 4.1 grounding).

They apply to every atomic task with a request and gold calls (native, synthesised, and each node of a
composed task with its upstream results as history):

- :func:`underivable_values`: gold argument values that neither the request, the history nor the results of
  the gold calls before them give (an amount the request never states, a quantity, an order number).
  Identifiers, numbers and enumerated values are checked; free text (a value with spaces, or a field the
  schema lets hold 100 characters or more) is a paraphrase
  matter, left to :mod:`~treadle.weft.evolve.text_checks`; a value equal to the schema default, and the
  quantity one (``a``, ``an``, ``one``), count as given. :func:`derive_values` also weighs what a competent
  policy knows besides the request (:mod:`~treadle.weft.evolve.derivable`: the tool documentation, the start
  state and what the argument-free tools return, canonical dates, world knowledge) and says which values it
  cannot decide offline;
- :func:`other_party`: the request names one party by e-mail, and the gold changes rows that belong to
  another (a row of the party's table with another key, or a row whose foreign key to that table names
  another party);
- :func:`inconsistent_request`: the request asks for a write tool the gold does not use, on the same
  entity as a gold write, and neither order of the two calls executes on the healthy server (two actions
  that exclude each other: cancel and ship one order);
- :func:`restated_quantities`: the request restates a quantity with another value (``500 cents ($20)``,
  ``two (3) mugs``, ``90 minutes, i.e. 2 hours``: the same dimension, converted, disagrees; bare numbers only
  as a number word and digits) and a gold value is one of the two readings: either reading is the request's.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from treadle.weft.runtime.callparse import ToolCall

NUMBER_WORDS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
                "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "a": 1, "an": 1, "single": 1, "pair": 2,
                "couple": 2, "dozen": 12, "half": 0.5}
_NEGATION = {"not", "don't", "dont", "never", "no", "without", "nor"}
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")


def _scalars(x: Any, key: str = "") -> list[tuple[str, Any]]:
    """``(key, value)`` of every scalar inside ``x`` (the key of the innermost object holding it)."""
    if isinstance(x, dict):
        return [v for k, y in x.items() for v in _scalars(y, str(k))]
    if isinstance(x, (list, tuple)):
        return [v for y in x for v in _scalars(y, key)]
    return [(key, x)]


def _related(key: str, arg: str) -> bool:
    """A result field ``key`` can give argument ``arg``: the same name, or an ``id`` for a ``<thing>_id`` /
    ``<thing>_ref`` argument (``find_customer`` -> ``{id}`` gives ``customer_id``); a field without a name
    (a bare result) gives any."""
    if not key or key == arg:
        return True
    stem = re.sub(r"_(id|ref|key|code)$", "", arg)
    return key in ("id", f"{stem}_id", stem) and stem != arg


def _numbers(text: str) -> set[float]:
    out = {float(m.replace(",", "")) for m in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}
    out |= {float(NUMBER_WORDS[w]) for w in re.findall(r"[a-z']+", text.lower()) if w in NUMBER_WORDS}
    return out


def _free_text(value: Any) -> bool:
    return isinstance(value, str) and (" " in value.strip() or len(value) > 40)


def _given(value: Any, arg: str, text: str, nums: set[float], seen: list[tuple[str, Any]]) -> bool:
    if value is None or isinstance(value, bool):
        return True
    seen = [s for k, s in seen if _related(k, arg)]
    if isinstance(value, (int, float)):
        one = value == 1 and not re.search(r"(^|_)(id|ref|key|no|number)$", arg)  # "a mug": not "case 1"
        return one or float(value) in nums or any(
            isinstance(s, (int, float)) and not isinstance(s, bool) and s == value for s in seen)
    if isinstance(value, str):
        v = value.strip().lower()
        if not v or _free_text(value):
            return True
        if re.search(r"(?<![\w-])" + re.escape(v) + r"(?![\w-])", text.lower()):
            return True
        return any(isinstance(s, str) and s.strip().lower() == v for s in seen)
    return True


def _defaults(tool: dict) -> dict[str, Any]:
    props = ((tool.get("input_schema") or {}).get("properties") or {})
    return {k: p["default"] for k, p in props.items() if "default" in p}


def underivable_values(request: str, gold: Sequence[ToolCall], results: Sequence[Any], tools: dict[str, dict],
                       history: Sequence[Any] = ()) -> list[str]:
    """``tool.arg=value`` of each gold value not given by ``request``, ``history`` or the results of the gold
    calls before it, nor by the tool documentation (see the module docstring); the values only world knowledge
    could give are left out (:func:`derive_values` reports them apart)."""
    return derive_values(request, gold, results, tools, history).missing


def derive_values(request: str, gold: Sequence[ToolCall], results: Sequence[Any], tools: dict[str, dict],
                  history: Sequence[Any] = (), *, world: Any = None,
                  policy: Sequence[ToolCall] = ()) -> Any:
    """A :class:`~treadle.weft.evolve.derivable.Derivation` of ``gold``'s values: ``missing`` (nothing a policy
    could know gives them: the task's) and ``undecided`` (world knowledge may give them: an abbreviation of a
    request word, a date of a month the request names, a documented option the request names only by its
    meaning, a symbol of the tool's domain such as ``..``). ``world``: a
    :class:`~treadle.weft.evolve.derivable.World` (the start state and what the argument-free tools return);
    ``policy``: the policy's calls (a gold value the policy itself gave for the same tool argument was derivable)."""
    from treadle.weft.evolve import derivable

    nums = _numbers(request)
    seen = [s for h in history for s in _scalars(h)]
    world = world if world is not None else derivable.World()
    produced = derivable.produced(policy)
    out = derivable.Derivation()
    for i, c in enumerate(gold):
        defaults = _defaults(tools.get(c.name) or {})
        props = (((tools.get(c.name) or {}).get("input_schema") or {}).get("properties") or {})
        for arg, value in c.arguments.items():
            if arg in defaults and defaults[arg] == value:
                continue
            prop = props.get(arg) or {}
            if prop.get("maxLength", 0) >= 100:  # a free-text field (a reason, a note)
                continue
            items = value if isinstance(value, list) else [value]
            if isinstance(value, list) and derivable.whole_collection(request, arg, value, prop, world):
                continue  # "all doors": every documented door, every key of the state's door mapping
            for item in items:
                parts = item.items() if isinstance(item, dict) else [(arg, item)]
                for k, v in parts:
                    if _given(v, k, request, nums, seen) or (c.name, k, derivable.hashable(v)) in produced \
                            or derivable.documented_source(v, prop if k == arg else {}, seen):
                        continue
                    verdict = derivable.judge(v, k, request, prop if k == arg else {}, world, nums,
                                              tools.get(c.name) or {}, c.name)
                    if verdict != "given":
                        getattr(out, verdict).append(f"{c.name}.{arg}{'[].' + k if k != arg else ''}={v!r}")
        if i < len(results):
            seen += _scalars(results[i])
    return out


def _parties(con: Any, request: str) -> list[tuple[str, str, Any]]:
    """``(table, key column, key)`` of each row an e-mail of ``request`` names (tables with an ``email`` column)."""
    out = []
    emails = {e.lower().rstrip(".") for e in _EMAIL.findall(request)}
    if not emails:
        return out
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
        info = list(con.execute(f'PRAGMA table_info("{t}")'))
        cols = [r[1] for r in info]
        pk = [r[1] for r in info if r[5]]
        if "email" not in cols or len(pk) != 1:
            continue
        for e in emails:
            row = con.execute(f'SELECT "{pk[0]}" FROM "{t}" WHERE lower(email) = ?', (e,)).fetchone()
            if row is not None:
                out.append((t, pk[0], row[0]))
    return out


def other_party(con: Any, request: str, diff: Any) -> list[str]:
    """Rows the gold changed (``diff``: start -> reference final) that belong to another party than the one the
    request names by e-mail (``con``: the start state); ``[]`` when the request names no single party."""
    parties = _parties(con, request)
    if len({(t, k) for t, _, k in parties}) != 1 or len(parties) != 1:
        return []
    table, key, me = parties[0]
    fks: dict[str, list[str]] = {}
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
        for r in con.execute(f'PRAGMA foreign_key_list("{t}")'):
            if r[2] == table and (r[4] in (key, None)):
                fks.setdefault(t, []).append(r[3])
    out = []
    for t, td in diff.tables.items():
        rows = [*td.added.values(), *(c.after for c in td.changed.values()), *td.removed.values()]
        for row in rows:
            if t == table and row.get(key) != me:
                out.append(f"{t} row {row.get(key)!r} changed; the request's party is {me!r}")
            for col in fks.get(t, ()):
                if row.get(col) is not None and row.get(col) != me:
                    out.append(f"{t} row of {col}={row.get(col)!r} changed; the request's party is {me!r}")
    return out[:5]


def _mentioned_tools(request: str, tools: dict[str, dict], gold: Sequence[ToolCall]) -> list[str]:
    words = re.findall(r"[a-z']+", request.lower())
    used = {c.name for c in gold}
    out = []
    for name, t in sorted(tools.items()):
        if name in used or not (t.get("contract") or {}).get("writes"):
            continue
        verb = name.split("_")[0].lower()
        for i, w in enumerate(words):
            if w == verb and not (_NEGATION & set(words[max(0, i - 3):i])):
                out.append(name)
                break
    return out


async def inconsistent_request(rt: Any, healthy: str, start: Any, request: str, gold: Sequence[ToolCall],
                               tools: dict[str, dict]) -> str | None:
    """A write the request asks for that excludes a gold write on the same entity (see the module docstring)."""
    from treadle.weft.evolve.probes import run_calls

    for name in _mentioned_tools(request, tools, gold):
        required = set(((tools[name].get("input_schema") or {}).get("required") or ()))
        for c in gold:
            if not (tools.get(c.name) or {}).get("contract", {}).get("writes"):
                continue
            if not required or not required <= set(c.arguments):
                continue
            other = ToolCall(name=name, arguments={k: c.arguments[k] for k in required})
            results = []
            for seq in ([c, other], [other, c]):
                outs, _ = await run_calls(rt, healthy, start, seq)
                results.append(all(o.ok for o in outs))
            if not any(results):
                return (f"the request asks for {name} and the gold does {c}: neither order of {other} and {c} "
                        "executes on the certified server")
    return None


def describe(values: Sequence[str]) -> str:
    return json.dumps(list(values)[:6])


_UNITS: dict[str, tuple[str, float]] = {
    "cent": ("money", 1), "cents": ("money", 1), "dollar": ("money", 100), "dollars": ("money", 100),
    "usd": ("money", 100), "$": ("money", 100), "€": ("euro", 100), "eur": ("euro", 100), "euro": ("euro", 100),
    "euros": ("euro", 100), "£": ("pound", 100), "gbp": ("pound", 100), "pence": ("pound", 1),
    "second": ("time", 1), "seconds": ("time", 1), "sec": ("time", 1), "secs": ("time", 1), "s": ("time", 1),
    "minute": ("time", 60), "minutes": ("time", 60), "min": ("time", 60), "mins": ("time", 60),
    "hour": ("time", 3600), "hours": ("time", 3600), "hr": ("time", 3600), "hrs": ("time", 3600),
    "h": ("time", 3600), "day": ("time", 86400), "days": ("time", 86400), "week": ("time", 604800),
    "weeks": ("time", 604800), "g": ("mass", 1), "gram": ("mass", 1), "grams": ("mass", 1), "kg": ("mass", 1000),
    "kilogram": ("mass", 1000), "kilograms": ("mass", 1000), "mm": ("length", 0.001), "cm": ("length", 0.01),
    "m": ("length", 1), "metre": ("length", 1), "metres": ("length", 1), "meter": ("length", 1),
    "meters": ("length", 1), "km": ("length", 1000), "percent": ("ratio", 1), "%": ("ratio", 1),
}
_NUM = r"\d[\d,]*(?:\.\d+)?"
_QUANTITY = re.compile(r"([$€£])\s?(" + _NUM + r")|(" + _NUM + r")(?:\s?(%|[a-z]+\b))?|\b(" + "|".join(NUMBER_WORDS)
                       + r")\b", re.I)
_RESTATE = re.compile(r"\s*(?:\(|,?\s*(?:i\.e\.|ie|that is|aka|or|=)\s*,?)\s*$", re.I)


def _quantities(request: str) -> list[tuple[int, int, float, float, str]]:
    """``(start, end, value, value in the base unit, dimension)`` of each quantity of ``request`` (a bare number
    or number word has the dimension ``count``)."""
    out = []
    for m in _QUANTITY.finditer(request):
        if m.group(1):
            dim, f = _UNITS[m.group(1)]
            v = float(m.group(2).replace(",", ""))
        elif m.group(3):
            v = float(m.group(3).replace(",", ""))
            unit = (m.group(4) or "").lower()
            dim, f = _UNITS.get(unit, ("count", 1))
        else:
            v, (dim, f) = float(NUMBER_WORDS[m.group(5).lower()]), ("count", 1)
            if m.group(5).lower() in ("a", "an", "half"):
                continue
        out.append((m.start(), m.end(), v, v * f, dim))
    return out


def restated_quantities(request: str, gold: Sequence[ToolCall]) -> str | None:
    """Two readings of one quantity in ``request`` (the second restates the first in parentheses or after
    ``i.e.`` / ``that is`` / ``or``, in the same dimension) that disagree, one of which a gold value is; None
    when there is none (see the module docstring)."""
    qs = _quantities(request)
    values = {float(v) for c in gold for _, v in _scalars(c.arguments)
              if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for (s1, e1, v1, b1, d1), (s2, _, v2, b2, d2) in zip(qs, qs[1:]):
        between = request[e1:s2]  # a restatement is adjacent: bounded, so the match stays linear on any request
        if d1 != d2 or abs(b1 - b2) <= 1e-9 * max(abs(b1), abs(b2), 1) or len(between) > 16 \
                or not _RESTATE.fullmatch(between):
            continue
        if d1 == "count" and request[s1].isdigit() == request[s2].isdigit():
            continue  # two bare numbers ("order 2 (1 item)") count different things; "two (3)" restates one
        if values & {v1, v2, b1, b2}:
            return (f"the request restates one quantity with two values: {request[s1:e1]!r} and "
                    f"{request[s2:].split(')')[0].strip()!r} ({d1}); the gold takes one reading")
    return None

"""What a competent policy knows besides the request, for the derivability check of gold values
(:func:`~treadle.weft.evolve.task_checks.derive_values`; seed: WEFT 4.1 grounding).

A gold value the request does not spell out is still derivable when it is:

- **documented**: one of the argument's documented options (a JSON-schema ``enum``, ``items.enum``, an
  ``[Enum]: [...]`` list, ``Options are: a, b, c`` or ``(Buy/Sell)`` in its description, a unit such as
  ``(km/h)`` not) that a request word names
  (``rear left`` for ``rear_left``, ``unlock`` for ``unlocked``) or the tool's own name names
  (``startEngine(ignitionMode="START")``);
- **a whole collection**: a list argument equal to a documented option list, to a list-valued part of the start
  state or to the keys of one of its mappings, where the request quantifies over it (``all of my car doors`` ->
  the four door names), and any one member of such a collection of the start state (``for each file in there``
  -> a key of the folder's contents, for the argument ``file_name``);
- **a canonical form** of the request's words: a date the request states in words (``the 6th day of October in
  2026`` -> ``2026-10-06``, ``the last day of October 2026`` -> ``2026-10-31``), a number written as a string, an
  identifier with ``_`` or ``-`` for a space, request tokens joined (``P followed by 12345678`` -> ``P12345678``);
- **an earlier result's field the documentation names**: the argument's description names the field that gives it
  (``cityA``: "The zipcode of the first city." <- ``{"zipcode": "94016"}``), or it rounded to the decimals the value
  has (``fuelAmount``: "... in gallons" <- ``{"gallon": 10.04}``: ``10``; <- ``{"gallon": 7.925}``: ``7.93``);
- **known to the environment and abbreviated by a request word**: an identifier-like code (``NVDA``, ``RMS``,
  ``AAPL``) whose letters are a capitalised request word's, in order, a doubled letter read once (``Nvidia``,
  ``Rivermist``, ``Apple``), or a short identifier of any case abbreviating any request word (``tmp`` <-
  ``temporary``), that the start state or an argument-free tool (``list_all_airports``) holds (:class:`World`);
- **looked up**: a lookup tool (one required argument with documented options) returns it for an option the request
  names (``get_nearest_airport_by_city("Los Angeles")`` -> ``LAX``);
- **a documented limit's complement**: it brings a state quantity of the argument's kind to a number the tool's
  documentation states, where the request asks for the limit (``a full tank``: ``50 - fuelLevel``; undecided
  where the request does not say ``full``, ``fill``, ``max`` or ``capacity``);
- **given by the policy itself**: the policy's call of the same tool carries it for the same argument.

What only world knowledge could give is **undecided** (an LLM decides it where one is configured): such a code
that nothing the environment holds confirms, a date of a month the request names (or of ``tomorrow``) whose day
or year the request leaves out, a documented option the request names only by its meaning (its argument named,
or required by the tool, the option not: ``purchase`` for ``order_type="Buy"``), a value of no letter or digit (a
convention of the tool's domain: ``cd("..")``). Everything else is **missing**: the task's (an optional argument's
option the request does not name among them: without it the tool's default applies).
"""
from __future__ import annotations

import json
import re
from calendar import monthrange
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.weft.runtime.callparse import ToolCall

MONTHS = {m: i + 1 for i, m in enumerate(("january", "february", "march", "april", "may", "june", "july", "august",
                                          "september", "october", "november", "december"))}
MONTHS.update({m[:3]: i for m, i in list(MONTHS.items()) if m != "may"})
MONTHS["sept"] = 9
RELATIVE_DAYS = {"today", "tomorrow", "yesterday", "tonight", "monday", "tuesday", "wednesday", "thursday", "friday",
                 "saturday", "sunday", "weekend"}
QUANTIFIERS = {"all", "every", "each", "both", "entire", "whole"}
MAX_NODES = 20000
"""Nodes of the start state and argument-free results :func:`walk` visits (bounded time on any state)."""
_CODE = re.compile(r"[A-Z][A-Z0-9]{1,5}")
_HELD_CODE = re.compile(r"[A-Za-z][A-Za-z0-9]{1,5}")
_ISO = re.compile(r"(\d{4})-(\d{2})-(\d{2})")


@dataclass
class World:
    """What the environment holds at the start: ``values`` (its strings, mapping keys included) and
    ``collections`` (``(path, elements)``: list-valued parts and the keys of mappings)."""

    values: set[str] = field(default_factory=set)
    collections: list[tuple[str, list[Any]]] = field(default_factory=list)
    numbers: list[tuple[str, float]] = field(default_factory=list)
    looked_up: set[str] = field(default_factory=set)
    """Strings a lookup tool returns for an option the request names (``get_nearest_airport_by_city("Los
    Angeles")`` -> ``LAX``): given outright."""


@dataclass
class Derivation:
    """``tool.arg=value`` of the gold values nothing gives (``missing``: the task's) and of those only world
    knowledge could give (``undecided``)."""

    missing: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)


def hashable(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=repr)


def produced(policy: Sequence[ToolCall]) -> set[tuple[str, str, str]]:
    """``(tool, argument, value)`` of every scalar the policy's calls carry (list elements and the fields of object
    elements by their own key, as :func:`~treadle.weft.evolve.task_checks.derive_values` walks the gold)."""
    out = set()
    for c in policy:
        for arg, value in (c.arguments or {}).items():
            for item in value if isinstance(value, list) else [value]:
                for k, v in (item.items() if isinstance(item, dict) else [(arg, item)]):
                    out.add((c.name, k, hashable(v)))
    return out


def walk(x: Any, path: str, world: World, budget: list[int] | None = None, depth: int = 0) -> World:
    """Add ``x``'s strings and collections to ``world``: dicts, lists, tuples, sets and the public attributes of
    plain objects, at most :data:`MAX_NODES` nodes and 10 levels deep."""
    budget = budget if budget is not None else [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0 or depth > 10:
        return world
    if isinstance(x, str):
        if len(x) <= 64:
            world.values.add(x)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        world.numbers.append((path, float(x)))
    elif isinstance(x, dict):
        keys = [k for k in x if isinstance(k, (str, int)) and not isinstance(k, bool)]
        world.collections.append((path, keys))
        world.values.update(k for k in keys if isinstance(k, str) and len(k) <= 64)
        for k, v in list(x.items())[:2000]:
            walk(v, f"{path}.{k}", world, budget, depth + 1)
    elif isinstance(x, (list, tuple, set, frozenset)):
        items = list(x)[:2000]
        if items and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
            world.collections.append((path, items))
        for v in items:
            walk(v, path, world, budget, depth + 1)
    elif hasattr(x, "__dict__") and not callable(x) and type(x).__module__ not in ("builtins", "random"):
        for k, v in list(vars(x).items()):
            if not k.startswith("_"):
                walk(v, f"{path}.{k}", world, budget, depth + 1)
    return world


def documented(prop: dict) -> list[str]:
    """The documented options of an argument (see the module docstring); ``[]`` when it has none."""
    out: list[Any] = list(prop.get("enum") or []) + list(((prop.get("items") or {}).get("enum")) or [])
    desc = str(prop.get("description") or "")[:4000]
    m = re.search(r"\[Enum\]:\s*(\[[^\]]*\]|[^\[\n]+)", desc)
    if m and m.group(1).startswith("["):
        try:
            out += list(json.loads(m.group(1)))
        except ValueError:
            pass
    elif m:  # "[Enum]: Rivermist, Stonebrook, Sunset Valley"
        out += [w.strip(" '\"`.") for w in m.group(1).split(",") if w.strip(" '\"`.")]
    m = re.search(r"(?:Options are|One of|Possible values(?: are)?|Allowed values(?: are)?)\s*:?\s*([^.\n]+)", desc,
                  re.I)
    if m:
        out += [w.strip(" '\"`") for w in re.split(r",|\bor\b|\band\b", m.group(1)) if w.strip(" '\"`")]
    for m in re.finditer(r"\(\s*(\w+(?:\s*/\s*\w+){1,7})\s*\)", desc):  # "Type of the order (Buy/Sell)."
        parts = [w.strip() for w in m.group(1).split("/")]
        if not all(p.islower() and len(p) <= 3 for p in parts):  # a unit ("km/h", "m/s", "mi/hr"), not options
            out += parts
            break
    return [str(o) for o in out]


def _stem(w: str) -> str:
    w = w.lower()
    for suffix in ("ing", "ed", "es", "s", "e"):
        if w.endswith(suffix) and len(w) - len(suffix) >= 3:
            return w[: -len(suffix)]
    return w


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def _named(option: str, request: str) -> bool:
    """Every word of ``option`` (``rear_left``: rear, left) is a request word's stem or shares its stem."""
    stems = {_stem(w) for w in _words(request)}
    parts = [_stem(p) for p in re.split(r"[\s_\-]+|(?<=[a-z])(?=[A-Z])", option) if p]
    return bool(parts) and all(any(s == p or (len(p) >= 3 and (s.startswith(p) or p.startswith(s) and len(s) >= 4))
                                   for s in stems) for p in parts)


def _concept_named(arg: str, request: str) -> bool:
    """The request names the argument (a part of its name of four letters or more: ``priority``, ``class``)."""
    parts = [_stem(p) for p in re.split(r"[_\-]+|(?<=[a-z])(?=[A-Z])", arg) if len(p) >= 4]
    stems = {_stem(w) for w in _words(request)}
    return any(p in stems for p in parts)


def _abbreviates(code: str, request: str, every_word: bool = False) -> bool:
    """``code`` abbreviates a capitalised request word (its first letter, the rest in order, a doubled letter read
    once: ``NVDA`` <- ``Nvidia``, ``AAPL`` <- ``Apple``) or is the initials of two or three consecutive capitalised
    words (``NY`` <- ``New York``); ``every_word``: any request word, capitalised or not (``tmp`` <- ``temporary``)."""
    words = re.findall(r"[A-Za-z]+" if every_word else r"[A-Z][a-zA-Z]+", request[:20000])
    c = re.sub(r"(.)\1+", r"\1", code.lower())
    for w in words:
        lw = w.lower()
        if len(lw) > len(c) and lw[0] == c[0]:
            it = iter(lw)
            if all(ch in it for ch in c):
                return True
    caps = re.findall(r"[A-Z][a-zA-Z]+", request[:20000])
    initials = [w[0].lower() for w in caps]
    return any("".join(initials[i:i + n]) == code.lower() for n in (2, 3) for i in range(len(initials)))


def request_dates(request: str) -> tuple[set[str], set[int], bool]:
    """``(ISO dates the request states, months it names, whether it names a relative day)``: a month name with a
    day and a year near it (``the 6th day of October in 2026``, ``Oct 6, 2026``) or its first or last day with a year
    (``the last day of October 2026``), or a numeric date (``2026-10-06``, ``10/06/2026`` read both ways)."""
    text = request.lower()[:20000]
    dates: set[str] = set()
    months: set[int] = set()
    for m in re.finditer(r"[a-z]+", text):
        month = MONTHS.get(m.group())
        if month is None:
            continue
        months.add(month)
        near = text[max(0, m.start() - 30): m.end() + 30]
        days = {int(d) for d in re.findall(r"(?<!\d)(\d{1,2})(?:st|nd|rd|th)?(?!\d)", near) if 1 <= int(d) <= 31}
        years = {int(y) for y in re.findall(r"(?<!\d)((?:19|20|21)\d\d)(?!\d)", text[max(0, m.start() - 40):
                                                                                      m.end() + 40])}
        dates |= {f"{y:04d}-{month:02d}-{d:02d}" for y in years for d in days}
        edge = re.search(r"\b(first|last|final)\s+day\s+(?:of|in)\s+(?:the\s+month\s+of\s+)?$",
                         text[max(0, m.start() - 40):m.start()])
        if edge:  # "the last day of October 2026"
            dates |= {f"{y:04d}-{month:02d}-{1 if edge.group(1) == 'first' else monthrange(y, month)[1]:02d}"
                      for y in years}
    for y, a, b in re.findall(r"(?<!\d)(\d{4})[-/.](\d{1,2})[-/.](\d{1,2})(?!\d)", text):
        dates.add(f"{int(y):04d}-{int(a):02d}-{int(b):02d}")
    for a, b, y in re.findall(r"(?<!\d)(\d{1,2})[-/.](\d{1,2})[-/.](\d{4})(?!\d)", text):
        dates |= {f"{int(y):04d}-{int(a):02d}-{int(b):02d}", f"{int(y):04d}-{int(b):02d}-{int(a):02d}"}
    return dates, months, bool(RELATIVE_DAYS & set(_words(text)))


def whole_collection(request: str, arg: str, value: list[Any], prop: dict, world: World) -> bool:
    """``value`` (a list argument) is a whole collection the request quantifies over (see the module docstring)."""
    if len(value) < 2 or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return False
    nouns = _quantified(request)
    if not nouns:
        return False
    want = {str(v) for v in value}
    pools = [(arg, documented(prop)), *world.collections]
    return any(want == {str(e) for e in elems} and any(n in f"{arg} {path}".lower() for n in nouns)
               for path, elems in pools)


def _quantified(request: str) -> set[str]:
    """Stems of the request words a quantifier stands near (``all of my car doors``, ``for each file``)."""
    words = _words(request[:20000])
    nouns = {_stem(w) for i, w in enumerate(words)
             if QUANTIFIERS & set(words[max(0, i - 5):i]) or QUANTIFIERS & set(words[i + 1:i + 9])}
    return {n for n in nouns - QUANTIFIERS if len(n) >= 3}


def quantified_member(v: Any, arg: str, request: str, world: World) -> bool:
    """``v`` is an element of a collection the start state holds (a list, a mapping's keys) that the request
    quantifies over (``for each file in there`` -> ``dev_summary.txt``, a key of the folder's contents, where the
    argument is ``file_name``): the gold acts on each member, and the state lists them."""
    nouns = _quantified(request)
    return bool(nouns) and any(
        v in elems and any(n in f"{arg} {path}".lower() for n in nouns) for path, elems in world.collections)


def documented_source(v: Any, prop: dict, seen: Sequence[tuple[str, Any]]) -> bool:
    """An earlier result's field gives ``v`` and the argument's description names that field (``cityA``: "The
    zipcode of the first city." <- ``{"zipcode": "94016"}``)."""
    desc = {_stem(w) for w in _words(str(prop.get("description") or "")[:2000])}
    return any(_same_number(s, v) if isinstance(v, (int, float)) else s == v and type(s) is type(v)
               for k, s in seen if len(k) >= 3 and _stem(k) in desc)


def _same_number(s: Any, v: Any) -> bool:
    """``v`` is the number ``s``, or ``s`` rounded to the decimals ``v`` has (``10`` <- ``10.0385`` gallons, ``7.93``
    <- ``7.9252`` where the request asks for two decimals), either way of rounding a half."""
    if isinstance(s, bool) or isinstance(v, bool) or not isinstance(s, (int, float)):
        return False
    if s == v:
        return True
    digits = _decimals(v)
    return digits < _decimals(s) and abs(s - v) <= 0.5 * 10.0 ** -digits + 1e-9


def _decimals(x: float) -> int:
    """Decimals of ``x`` as written (``7.93``: 2, ``10.0``: 0); 16 past what a float spells."""
    text = repr(float(x))
    if "e" in text or "n" in text:
        return 16
    frac = text.split(".")[1].rstrip("0")
    return len(frac)


def _complement(v: float, arg: str, tool: dict, world: World) -> bool:
    """``v`` brings a state quantity of the argument's kind to a number the tool's documentation states (``fill the
    tank``: ``fuelAmount = 50 - fuelLevel`` where the description says "can hold up to 50 gallons")."""
    docs = " ".join([str(tool.get("description") or "")] + [str(p.get("description") or "") for p in (
        (tool.get("input_schema") or {}).get("properties") or {}).values() if isinstance(p, dict)])[:4000]
    limits = {float(d) for d in re.findall(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\w.])", docs)}
    parts = [_stem(p) for p in re.split(r"[_\-]+|(?<=[a-z])(?=[A-Z])", arg) if len(p) >= 4]
    related = [x for path, x in world.numbers if any(p in path.lower() for p in parts)]
    return any(abs(v + x - d) <= 1e-9 * max(1.0, abs(d)) for d in limits for x in related)


def _assembled(s: str, request: str) -> bool:
    """``s`` is request tokens joined (``P12345678`` <- "P followed by 12345678"): its letter and digit runs are
    whole request tokens, in order."""
    runs = re.findall(r"[A-Za-z]+|\d+", s)
    if len(runs) < 2:
        return False
    tokens = re.findall(r"[A-Za-z]+|\d+", request.lower())
    it = iter(tokens)
    return all(r.lower() in it for r in runs)


def judge(v: Any, arg: str, request: str, prop: dict, world: World, nums: set[float], tool: dict | None = None,
          name: str = "") -> str:
    """``"given"``, ``"undecided"`` or ``"missing"`` for a gold value the request, history and earlier results do
    not give literally (see the module docstring); ``tool``: the tool's documentation, ``name``: its name."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if _complement(float(v), arg, tool or {}, world):  # to the documented limit: given where the request asks
            return "given" if {"full", "fill", "max", "maximum", "capacity", "top"} & set(_words(request)) \
                else "undecided"
        return "missing"  # otherwise a number is the request's (or a result's) or nobody's
    if not isinstance(v, str):
        return "given"
    s = v.strip()
    if s in world.looked_up:
        return "given"
    spaced = re.sub(r"[_\-]+", " ", s.lower())
    if spaced != s.lower() and re.search(r"(?<![\w-])" + re.escape(spaced) + r"(?![\w-])", request.lower()):
        return "given"
    try:
        if float(s.replace(",", "")) in nums:
            return "given"
    except ValueError:
        pass
    if _assembled(s, request):
        return "given"
    iso = _ISO.fullmatch(s)
    if iso:
        dates, months, relative = request_dates(request)
        if s in dates:
            return "given"
        if int(iso.group(2)) in months or relative:
            return "undecided"
        return "missing"
    if s and not re.search(r"[^\W_]", s):  # "..", "/", "*": a convention of the tool's domain
        return "undecided"
    if quantified_member(s, arg, request, world):
        return "given"
    options = documented(prop)
    if s.lower() in {o.lower() for o in options}:
        if _named(s, request) or _named(s, _split_name(name)):  # startEngine(ignitionMode="START")
            return "given"
        required = ((tool or {}).get("input_schema") or {}).get("required") or ()
        return "undecided" if _concept_named(arg, request) or arg in required else "missing"
    if _CODE.fullmatch(s) and _abbreviates(s, request):
        return "given" if s in world.values else "undecided"
    if s in world.values and _HELD_CODE.fullmatch(s) and _abbreviates(s, request, every_word=True):
        return "given"  # cd(folder="tmp") for "the temporary directory", where the state holds "tmp"
    return "missing"


def _split_name(name: str) -> str:
    """A tool name as words (``startEngine`` -> ``start Engine``, ``place_order`` -> ``place order``)."""
    return " ".join(p for p in re.split(r"[_\-\s]+|(?<=[a-z])(?=[A-Z])", name) if p)


async def known_world(rt: Any, server_hash: str, start: Any, tools: dict[str, dict], con: Any = None,
                      request: str = "", max_tools: int = 16, max_lookups: int = 16) -> World:
    """The :class:`World` of ``start`` on ``server_hash``: an object state's public attributes, a SQLite state's
    values (``con``: a copy of it), the results of each tool that takes no required argument, and those of each
    lookup tool (one required argument with documented options) called with an option ``request`` names (each
    call in its own session from ``start``; a failing one adds nothing)."""
    from treadle.weft.evolve.probes import run_calls

    world = World()
    budget = [MAX_NODES]
    if start.kind == "object":
        from treadle.weft.runtime.object_state import ObjectState
        from treadle.weft.runtime.registry import release_module

        module, weft = rt.registry.load(server_hash)
        try:
            st = ObjectState(start, weft.state_class)
            try:
                walk(st.handle, "state", world, budget)
            finally:
                st.close()
        finally:
            release_module(module)
    elif con is not None:
        for (t,) in list(con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")):
            for row in con.execute(f'SELECT * FROM "{t}" LIMIT 2000'):
                world.values.update(x for x in row if isinstance(x, str) and len(x) <= 64)
    free = [n for n, t in sorted(tools.items()) if not ((t.get("input_schema") or {}).get("required") or ())]
    for name in free[:max_tools]:
        try:
            outs, _ = await run_calls(rt, server_hash, start, [ToolCall(name=name, arguments={})])
        except Exception:  # noqa: BLE001  (a tool that cannot run without arguments tells nothing)
            continue
        if outs and outs[0].ok:
            walk(outs[0].result, name, world, budget)
    lookups = []
    for name, t in sorted(tools.items()):
        required = list((t.get("input_schema") or {}).get("required") or ())
        if len(required) != 1:
            continue
        prop = ((t.get("input_schema") or {}).get("properties") or {}).get(required[0]) or {}
        lookups += [(name, required[0], o) for o in documented(prop)
                    if len(o) >= 3 and re.search(r"(?<![\w-])" + re.escape(o.lower()) + r"(?![\w-])", request.lower())]
    for name, arg, option in lookups[:max_lookups]:
        try:
            outs, _ = await run_calls(rt, server_hash, start, [ToolCall(name=name, arguments={arg: option})])
        except Exception:  # noqa: BLE001  (a lookup that fails tells nothing)
            continue
        if outs and outs[0].ok:
            found = walk(outs[0].result, name, World(), [MAX_NODES])
            world.looked_up |= found.values
            world.values |= found.values
    return world

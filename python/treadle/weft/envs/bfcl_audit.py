"""Mechanical audit of BFCL multi-turn gold answers: which scored entries can an honest agent pass?

An agent sees only the user's words and the tools' outputs. A gold call whose argument is a text
that appears in neither (e.g. ``multi_turn_base_4``: the gold posts a sorted text that the ``sort``
tool never returns), or a number the user did not dictate and no tool returned (a rounding or a
format the user never asked for), can only be matched by guessing: no honest trajectory passes the
turn's state or response check. The audit replays every entry's gold calls turn by turn on fresh environments and checks each gold
call against everything the agent could have seen by then -- the user's messages of this and earlier
turns, the function docs, the outputs of the gold calls so far (and of :data:`EXTRA_READS`), and the
environment's public state (every attribute is readable through some tool: ``cat``, ``ls``,
``get_order_history``, ...):

- the call is offered on its turn (not withheld by ``missed_function``) and its arguments satisfy the
  function doc's schema (converted by :mod:`treadle.weft.envs.bfcl_schema`);
- free text (more than :data:`FREE_TEXT_WORDS` words) appears verbatim -- case, punctuation and all,
  whitespace collapsed; the state check compares it character for character -- or fills a template
  the user quoted (``'The distance from A to B is xxx km.'``; placeholders ``xxx``, ``[..]``, ``{..}``,
  ``<..>`` match anything); a tool's list of names may be written out as ``"a, b, c"``;
- numbers were said or shown (``1,000`` and ``1000.0`` are the same value), are small counts
  (|x| <= :data:`SMALL_INT`), or are one arithmetic step (+, -, *, /) from a number said and one said
  or shown, exactly, or rounded to their own precision or to tens/hundreds/thousands when one operand
  is in this turn's user words ("10 times the price, rounded to the nearest thousand").

Only values that matter count: a suspect value is reported if the call's output or the class's public
state changes when the value is replaced (``contact_customer_support`` ignores its message, so a
paraphrased message there is no defect). Short strings (ids, codes, dates, names) are not audited:
an agent finds them through tools or formats them as the doc says.

This is deliberately a sufficient rule for *exclusion* only: an entry it flags has a gold value
that the audit can not find in anything the agent saw. Its findings are listed in
:func:`audit_category` and excluded from scoring through :data:`treadle.weft.envs.bfcl.KNOWN_BAD_GOLD`.
"""
from __future__ import annotations

import ast
import copy
import json
import re
from functools import lru_cache
from typing import Any

from treadle.data.bfcl import function_docs, load_bfcl_multi_turn, make_environment, missed_function_names

#: Reads an honest agent makes from the user's words that the gold of some variants skips, by entry
#: number (the four categories are variants of the same 200 scenarios). Their outputs count as seen.
#: 180: "cap my travel expenses at 20,000 RMB" -- the base gold converts with compute_exchange_rate,
#: the other variants set 2857.14 directly.
EXTRA_READS: dict[str, list[str]] = {
    "180": ["compute_exchange_rate(base_currency='RMB', target_currency='USD', value=20000.0)"],
}
FREE_TEXT_WORDS = 3  # longer strings are free text: checked verbatim
SMALL_INT = 10
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_WORD = re.compile(r"[0-9a-z]+")


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def _numbers(text: str) -> set[float]:
    out = set()
    for m in _NUM.findall(text):
        try:
            out.add(float(m.replace(",", "")))
        except ValueError:
            pass
    return out


def _leaves(value: Any):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _short(text: str, n: int = 70) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _paths(value: Any, path: tuple = ()):
    """(path, leaf) pairs of a JSON-like value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, path + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _paths(v, path + (i,))
    else:
        yield path, value


def _replaced(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    out = copy.deepcopy(value)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = new
    return out


def _run(inst: Any, name: str, kwargs: dict[str, Any]) -> tuple[str, str]:
    try:
        result = getattr(inst, name)(**kwargs)
    except Exception as err:  # noqa: BLE001
        result = f"Error during execution: {err}"
    return _result_text(result), _result_text({k: v for k, v in vars(inst).items() if not k.startswith("_")})


def _observable(env: dict[str, Any], cls: str, name: str, kwargs: dict[str, Any], path: tuple) -> bool:
    """Whether the call's output or the class's public state depends on the value at ``path``: the call is
    run on two copies of the instance, with the gold value and with another one of the same type."""
    old = kwargs
    for p in path:
        old = old[p]
    other = "some other text entirely" if isinstance(old, str) else old + 1
    gold = _run(copy.deepcopy(env[cls]), name, kwargs)
    return _run(copy.deepcopy(env[cls]), name, _replaced(kwargs, path, other)) != gold


def _decimals(x: float) -> int:
    s = repr(float(x))
    return len(s.split(".")[1].rstrip("0")) if "." in s and "e" not in s else 0


def _number_seen(x: float, said: set[float], shown: set[float], asked: set[float] = frozenset()) -> bool:
    """``x`` was said or shown, or is one arithmetic step from numbers that were: ``a op b`` with ``a`` said
    (user words, tool outputs) and ``b`` said or shown (state), exactly; or with ``a`` in this turn's user
    words (``asked``) and ``b`` said or shown, rounded to the precision of ``x`` or to tens, hundreds or thousands
    (a user's "rounded to ...")."""
    every = said | shown
    if x in every or abs(x) <= SMALL_INT and float(x).is_integer():
        return True
    rounded = {round(v, 6) for v in every}
    for a in said:
        wanted = [x - a, a - x, a + x, a * x] + ([x / a, a / x] if a and x else [])
        if any(round(b, 6) in rounded for b in wanted):
            return True
    d = _decimals(x)
    cands = [v for a in asked | {0.0} for b in every for v in (a + b, a - b, b - a, a * b, a / b if b else None,
                                                       b / a if a else None) if v is not None]
    return any(round(v, n) == x for v in cands for n in (d, -1, -2, -3))


_QUOTED = re.compile(r"'((?:[^'\\]|\\.){8,}?)'(?=[\s.,;:!?)]|$)|\"([^\"]{8,}?)\"")
_PLACEHOLDER = re.compile(r"\b(?:x{2,}|X{2,}|X)\b|\[[^\]]*\]|\{[^}]*\}|<[^>]*>")


def _templates(user_text: str) -> list[re.Pattern]:
    """Quoted passages of the user's words as patterns; placeholders (xxx, [name], {n}, <n>) match anything."""
    out = []
    for m in _QUOTED.finditer(user_text):
        q = (m.group(1) or m.group(2)).replace("\\'", "'")
        parts = _PLACEHOLDER.split(q)
        if len(parts) > 1:
            out.append(re.compile(".+?".join(re.escape(" ".join(p.split())) for p in parts), re.DOTALL))
    return out


def _free_text_seen(s: str, seen: str, templates: list[re.Pattern]) -> bool:
    """Free text must be verbatim (case and punctuation included; whitespace collapsed) in what the agent
    saw, or fill a template the user quoted: the state check compares it character for character."""
    t = " ".join(s.split())
    return t in seen or any(p.fullmatch(t) for p in templates)


def _call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    node = ast.parse(text, mode="eval").body
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), text
    return (node.func.id, [ast.literal_eval(a) for a in node.args],
            {k.arg: ast.literal_eval(k.value) for k in node.keywords})


def _result_text(result: Any) -> str:
    """What an agent reads of a value: its JSON form and its strings as they are (newlines unescaped)."""
    try:
        dumped = json.dumps(result, default=str)
    except (TypeError, ValueError):
        dumped = str(result)
    parts = [dumped] + [v for v in _leaves(result) if isinstance(v, str)]
    # a list of names as an agent would write it out ("a, b, c")
    parts += [sep.join(v) for v in _lists(result) for sep in (", ", " ", "\n")]
    return " ".join(parts)


def _lists(value: Any):
    if isinstance(value, dict):
        for v in value.values():
            yield from _lists(v)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            yield list(value)
        for v in value:
            yield from _lists(v)


def _state_text(env: dict[str, Any]) -> str:
    return " ".join(_result_text({k: v for k, v in vars(inst).items() if not k.startswith("_")})
                    for inst in env.values())


def audit_entry(entry: dict[str, Any]) -> list[str]:
    """Reasons why no honest trajectory can pass ``entry`` (empty: none found).

    ``entry`` is one from :func:`treadle.data.bfcl.load_bfcl_multi_turn` (with ``ground_truth``);
    it is not modified. What the agent could have seen by a gold call: the user's words so far, the
    function docs, the environment's public state (every attribute is readable through some tool,
    e.g. ``cat``, ``get_order_history``, ``list_airports``) and the gold calls' outputs so far.
    Checked per gold call: it is offered on that turn (``missed_function``), its arguments satisfy
    the function doc's schema, its free-text arguments (more than :data:`FREE_TEXT_WORDS` words)
    appear verbatim or fill a template the user quoted, and its numbers were said, shown, or are
    one arithmetic step from two numbers that were.
    """
    import jsonschema

    from treadle.weft.envs.bfcl_schema import bfcl_to_tool

    env = make_environment(entry)
    owner = {m: c for c, inst in env.items() for m in dir(inst) if not m.startswith("_")}
    docs = function_docs(list(entry["involved_classes"]))
    schemas = {d["name"]: bfcl_to_tool(d)["input_schema"] for d in docs}
    order = {d["name"]: list(d.get("parameters", {}).get("properties", {})) for d in docs}
    said = _result_text(docs)  # user words, docs and tool outputs: numbers and free text
    problems: list[str] = []
    withheld = {n: t for t, names in missed_function_names(entry).items() for n in names}
    templates: list[re.Pattern] = []
    for text in EXTRA_READS.get(str(entry["id"]).rsplit("_", 1)[-1], []):
        name, args, kwargs = _call(text)
        said += " " + _run(copy.deepcopy(env[owner[name]]), name, {**dict(zip(order.get(name, []), args)), **kwargs})[0]
    for k, (messages, gold) in enumerate(zip(entry["question"], entry["ground_truth"])):
        user = " ".join(" ".join(str(m.get("content", "")).split()) for m in messages if m.get("role") == "user")
        said += " " + user
        templates += _templates(user)  # a format the user quoted holds for later turns too
        asked = _numbers(user)
        for text in gold:
            name, args, kwargs = _call(text)
            seen = " ".join((said + " " + _state_text(env)).split())
            nums = _numbers(said)
            if withheld.get(name, -1) > k:
                problems.append(f"turn {k}: gold calls {name}, which the entry withholds until turn {withheld[name]}")
            named = {**dict(zip(order.get(name, []), args)), **kwargs}
            if name in schemas:
                err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schemas[name]).iter_errors(named))
                if err is not None:
                    problems.append(f"turn {k}: gold {name}(...) violates the function doc's schema: {err.message}")
            suspects = []
            for path, v in _paths(named):
                if isinstance(v, bool) or v is None:
                    continue
                if isinstance(v, (int, float)) and not _number_seen(float(v), nums, _numbers(seen), asked):
                    suspects.append((path, f"number {v!r} is neither said by the user nor shown by a tool"))
                elif isinstance(v, str) and len(v.split()) > FREE_TEXT_WORDS and not _free_text_seen(v, seen, templates):
                    suspects.append((path, f"text {_short(v)} is neither the user's words (verbatim) nor a tool's output"))
            for path, why in suspects:  # only values that the state or the output depends on
                if _observable(env, owner[name], name, named, path):
                    problems.append(f"turn {k}: gold {name}({'.'.join(map(str, path))}=...): {why}")
            try:
                result = getattr(env[owner[name]], name)(**named)
            except Exception as err:  # noqa: BLE001 - upstream records the error text as the output
                result = f"Error during execution: {err}"
            said += " " + _result_text(result)
    return problems


@lru_cache(maxsize=None)
def _audit(category: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((e["id"], tuple(p)) for e in load_bfcl_multi_turn(category) if (p := audit_entry(e)))


def audit_category(category: str) -> dict[str, list[str]]:
    """``{entry id: [reason, ...]}`` for every entry of ``category`` that :func:`audit_entry` flags."""
    return {i: list(p) for i, p in _audit(category)}


# Generated by `python -m treadle.weft.envs.bfcl_audit` (bfcl-eval 2026.3.23); tests/weft/test_bfcl_audit.py
# checks that a fresh audit gives exactly this table (an entry's reasons joined by '; ').
AUDITED_BFCL_EVAL = "2026.3.23"
AUDITED: dict[str, str] = {
    'multi_turn_base_4': "turn 2: gold post_tweet(content=...): text 'Initial report content More unsorted data Unsorted data' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_base_18': "turn 2: gold post_tweet(content=...): text '- Introduction to History. Ancient civilizations.+ Advanced History. M...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_base_30': "turn 1: gold post_tweet(content=...): text '{experiment: Apollo Test, result: Success, details: All systems operat...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_base_171': "turn 2: gold send_message(message=...): text 'Thank you for your efficient handling of my booking to Beijing. My tri...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_base_173': "turn 3: gold close_ticket(...) violates the function doc's schema: 'ticket_001' is not of type 'integer'",
    'multi_turn_base_176': "turn 1: gold create_ticket(description=...): text 'Due to unexpected changes in schedule, the flight from JFK to LAX on D...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_base_184': 'turn 3: gold send_message(message=...): text "Hi Sam, my travel plans have changed. I\'ll update you soon." is neither the user\'s words (verbatim) nor a tool\'s output',
    'multi_turn_base_187': "turn 3: gold create_ticket(description=...): text 'Feedback from customer support was unsatisfactory regarding discrepanc...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_long_context_4': "turn 2: gold post_tweet(content=...): text 'Initial report content More unsorted data Unsorted data' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_long_context_11': "turn 1: gold post_tweet(content=...): text 'file1.txt, file2.txt, image_9171836320808556539.jpg, image_11350084702...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_long_context_41': 'turn 0: gold send_message(message=...): text "Meeting notes and project details. The company\'s financials for the ye..." is neither the user\'s words (verbatim) nor a tool\'s output',
    'multi_turn_long_context_43': "turn 3: gold send_message(message=...): text 'This is the annual report. It includes Q4 results and other financial ...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_long_context_143': "turn 3: gold send_message(message=...): text 'My strategy is shifting due to recent market movements and the cancell...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_long_context_171': "turn 2: gold send_message(message=...): text 'Thank you for your efficient handling of my booking to Beijing. My tri...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_long_context_173': "turn 3: gold close_ticket(...) violates the function doc's schema: 'ticket_001' is not of type 'integer'",
    'multi_turn_long_context_184': 'turn 3: gold send_message(message=...): text "Hi Sam, my travel plans have changed. I\'ll update you soon." is neither the user\'s words (verbatim) nor a tool\'s output',
    'multi_turn_long_context_187': "turn 3: gold create_ticket(description=...): text 'Feedback from customer support was unsatisfactory regarding discrepanc...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_func_4': "turn 3: gold post_tweet(content=...): text 'Initial report content More unsorted data Unsorted data' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_func_18': "turn 3: gold post_tweet(content=...): text '- Introduction to History. Ancient civilizations.+ Advanced History. M...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_func_30': "turn 2: gold post_tweet(content=...): text '{experiment: Apollo Test, result: Success, details: All systems operat...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_func_49': 'turn 1: gold calls tail, which the entry withholds until turn 3',
    'multi_turn_miss_func_143': "turn 4: gold send_message(message=...): text 'My strategy is shifting due to recent market movements and the cancell...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_func_171': "turn 3: gold send_message(message=...): text 'Thank you for your efficient handling of my booking to Beijing. My tri...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_func_173': "turn 4: gold close_ticket(...) violates the function doc's schema: 'ticket_001' is not of type 'integer'",
    'multi_turn_miss_func_184': 'turn 4: gold send_message(message=...): text "Hi Sam, my travel plans have changed. I\'ll update you soon." is neither the user\'s words (verbatim) nor a tool\'s output',
    'multi_turn_miss_func_187': "turn 4: gold create_ticket(description=...): text 'Feedback from customer support was unsatisfactory regarding discrepanc...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_param_4': "turn 3: gold post_tweet(content=...): text 'Initial report content More unsorted data Unsorted data' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_param_18': "turn 3: gold post_tweet(content=...): text '- Introduction to History. Ancient civilizations.+ Advanced History. M...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_param_29': 'turn 3: gold echo(content=...): text "Create a file name based on the number of byte used. It should be in \'..." is neither the user\'s words (verbatim) nor a tool\'s output',
    'multi_turn_miss_param_30': "turn 2: gold post_tweet(content=...): text '{experiment: Apollo Test, result: Success, details: All systems operat...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_param_143': "turn 4: gold send_message(message=...): text 'My strategy is shifting due to recent market movements and the cancell...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_param_171': "turn 3: gold send_message(message=...): text 'Thank you for your efficient handling of my booking to Beijing. My tri...' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_param_173': "turn 4: gold close_ticket(...) violates the function doc's schema: 'ticket_001' is not of type 'integer'",
    'multi_turn_miss_param_180': "turn 6: gold create_ticket(description=...): text 'Problem encountered with invoicing.' is neither the user's words (verbatim) nor a tool's output",
    'multi_turn_miss_param_184': 'turn 4: gold send_message(message=...): text "Hi Sam, my travel plans have changed. I\'ll update you soon." is neither the user\'s words (verbatim) nor a tool\'s output',
    'multi_turn_miss_param_187': "turn 4: gold create_ticket(description=...): text 'Feedback from customer support was unsatisfactory regarding discrepanc...' is neither the user's words (verbatim) nor a tool's output",
}

def audit_all() -> dict[str, str]:
    """``{entry id: reasons joined by '; '}`` over every multi-turn category (minutes: replays all 800)."""
    from treadle.data.bfcl import MULTI_TURN_CATEGORIES

    return {i: "; ".join(p) for c in MULTI_TURN_CATEGORIES for i, p in audit_category(c).items()}


def excluded() -> dict[str, str]:
    """Entries excluded from scoring, ``{entry id: reason}``.

    :data:`AUDITED` when the installed bfcl-eval is the audited version :data:`AUDITED_BFCL_EVAL`
    (tests/weft/test_bfcl_audit.py re-derives it); for any other version the audit runs now (once per
    process, a few minutes), so an upgrade is never scored against a stale list.
    """
    return dict(_excluded())


@lru_cache(maxsize=None)
def _excluded() -> dict[str, str]:
    import importlib.metadata
    import warnings

    version = importlib.metadata.version("bfcl-eval")
    if version == AUDITED_BFCL_EVAL:
        return AUDITED
    warnings.warn(f"bfcl-eval {version} is not the audited {AUDITED_BFCL_EVAL}: auditing its gold answers now",
                  stacklevel=3)
    return audit_all()


if __name__ == "__main__":  # regenerate the table: python -m treadle.weft.envs.bfcl_audit
    import importlib.metadata

    print(f'AUDITED_BFCL_EVAL = "{importlib.metadata.version("bfcl-eval")}"')
    print("AUDITED: dict[str, str] = {")
    for key, why in sorted(audit_all().items(), key=lambda kv: (kv[0].rsplit("_", 1)[0], int(kv[0].rsplit("_", 1)[1]))):
        print(f"    {key!r}: {why!r},")
    print("}")

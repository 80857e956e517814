"""Evaluator strength: free text compared by meaning, and verifiers tested by negative controls (seed: WEFT 5.1).

- :func:`text_verdict`: whether a policy's free text is a faithful paraphrase of the reference's. Text the
  request quotes (``"..."``) must be reproduced exactly; other text is compared by its content words (Jaccard
  similarity of lower-cased, lightly stemmed words without stop words; a negation on one side only makes
  them different): ``same`` at or above
  :data:`SAME`, ``different`` at or below :data:`DIFFERENT`, ``undecided`` between (an LLM judge decides
  those where one is configured; offline they stay undecided, never a silent policy failure);
- :func:`free_text_only_diff`: the rows where the policy's final state and the reference's differ, when
  they differ only in free-text columns (``[(reference text, policy text)]``), else None;
- :func:`negative_controls`: agents that must fail a sound verifier: one that does nothing, one that makes
  only the gold's reads (its lookups without its writes), plausible but wrong ones made by perturbing one value
  of a gold write (other entities of the start state, a number off by one; each must execute and change the
  state otherwise than the reference), one that adds a call of each tool the task forbids, and one that adds
  an unrequested write (the gold, then one call of a write tool the gold does not use, its arguments from the
  gold's). A control that passes shows a lenient verifier.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from treadle.weft.runtime.callparse import ToolCall

SAME = 0.7
DIFFERENT = 0.34
STOP = frozenset("a an the is are was were be been being has have had to of on in for at by with it its this that "
                 "and or but so as from our your their his her my we you they he she i me us them will would "
                 "should can could do does did done now".split())


def _words(text: str) -> set[str]:
    out = set()
    for w in re.findall(r"[a-z0-9]+", text.lower()):
        if w in STOP:
            continue
        for suf in ("ing", "ed", "es", "s"):
            if len(w) > len(suf) + 2 and w.endswith(suf):
                w = w[: -len(suf)]
                break
        out.add(w)
    return out


def quoted(request: str) -> list[str]:
    """The spans ``request`` quotes (double quotes, typographic quotes, backticks)."""
    return [m for pair in re.findall(r'"([^"]+)"|“([^”]+)”|`([^`]+)`', request) for m in pair if m]


NEGATION = frozenset("not no never none nothing without cannot can't won't didn't don't isn't wasn't unable".split())


def similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' content words (1.0 for two texts without any)."""
    wa, wb = _words(a), _words(b)
    if not wa or not wb:
        return 1.0 if wa == wb else 0.0
    return len(wa & wb) / len(wa | wb)


def text_verdict(reference: str, policy: str, request: str = "") -> str:
    """``same`` | ``different`` | ``undecided`` for one free-text value (see the module docstring); a negation
    on one side only makes the texts different whatever their overlap."""
    if any(q.strip().lower() == reference.strip().lower() for q in quoted(request)):
        return "same" if policy.strip() == reference.strip() else "different"
    if (NEGATION & set(re.findall(r"[a-z']+", reference.lower()))) != \
            (NEGATION & set(re.findall(r"[a-z']+", policy.lower()))):
        return "different"
    s = similarity(reference, policy)
    return "same" if s >= SAME else "different" if s <= DIFFERENT else "undecided"


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and " " in v.strip()


def free_text_only_diff(diff: Any) -> list[tuple[str, str]] | None:
    """``[(reference text, policy text)]`` when ``diff`` (reference final -> policy final) changes only free-text
    column values of rows present in both; None otherwise (rows added or removed, other columns changed)."""
    pairs: list[tuple[str, str]] = []
    for td in diff.tables.values():
        if td.added or td.removed:
            matched = _match_rows(td)
            if matched is None:
                return None
            changes = matched
        else:
            changes = [(c.before, c.after) for c in td.changed.values()]
        for before, after in changes:
            for col in set(before) | set(after):
                x, y = before.get(col), after.get(col)
                if x == y:
                    continue
                if not (_is_text(x) and isinstance(y, str)):
                    return None
                pairs.append((x, y))
    return pairs or None


def _match_rows(td: Any) -> list[tuple[dict, dict]] | None:
    """Rows keyed by a text column (a text in the key): removed and added rows paired by their other columns."""
    if td.changed or len(td.added) != len(td.removed):
        return None
    out = []
    added = list(td.added.values())
    for r in td.removed.values():
        hit = next((a for a in added if all(a.get(k) == v for k, v in r.items() if not _is_text(v))), None)
        if hit is None:
            return None
        added.remove(hit)
        out.append((r, hit))
    return out


def _perturbations(call: ToolCall, tool: dict, con: Any) -> list[ToolCall]:
    from treadle.weft.evolve.probes import contract_clauses

    a2s = ((tool.get("contract") or {}).get("args_to_state") or {})
    out = []
    for arg, v in call.arguments.items():
        if isinstance(v, bool) or _is_text(v):
            continue
        if isinstance(v, (int, float)):
            out.append(ToolCall(name=call.name, arguments={**call.arguments, arg: v + 1}))
        clauses = contract_clauses(a2s.get(arg, ""))
        if clauses and con is not None and not isinstance(v, list):
            t, col = clauses[0][0], clauses[0][1]
            try:  # a few other entities: the first may refuse the call (a contact already at that tier)
                rows = con.execute(f'SELECT DISTINCT "{col}" FROM "{t}" WHERE "{col}" IS NOT ? AND typeof("{col}") = '
                                   f'typeof(?) ORDER BY 1 LIMIT 3', (v, v)).fetchall()
            except Exception:  # noqa: BLE001  (a contract naming a column the schema lacks)
                rows = []
            out += [ToolCall(name=call.name, arguments={**call.arguments, arg: r[0]}) for r in rows if r[0] != v]
        if isinstance(v, list):
            for i, item in enumerate(v):
                if not isinstance(item, dict):
                    continue
                for k, x in item.items():
                    if isinstance(x, (int, float)) and not isinstance(x, bool):
                        new = [dict(y) for y in v]
                        new[i][k] = x + 1
                        out.append(ToolCall(name=call.name, arguments={**call.arguments, arg: new}))
                    elif isinstance(x, str) and con is not None and not _is_text(x):
                        other = _other_key(con, k, x)
                        if other is not None:
                            new = [dict(y) for y in v]
                            new[i][k] = other
                            out.append(ToolCall(name=call.name, arguments={**call.arguments, arg: new}))
    return out


def _other_key(con: Any, key: str, value: Any) -> Any:
    for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
        pk = [r[1] for r in con.execute(f'PRAGMA table_info("{t}")') if r[5]]
        if pk == [key]:
            row = con.execute(f'SELECT "{key}" FROM "{t}" WHERE "{key}" != ? ORDER BY 1 LIMIT 1', (value,)).fetchone()
            return row[0] if row else None
    return None


def _fill(tool: dict, base: dict[str, Any]) -> dict[str, Any] | None:
    props = ((tool.get("input_schema") or {}).get("properties") or {})
    required = ((tool.get("input_schema") or {}).get("required") or ())
    args = {}
    for k in required:
        if k in base:
            args[k] = base[k]
        else:
            p = props.get(k, {})
            kind = p.get("type")
            if kind == "string":
                args[k] = "probe text"
            elif kind == "integer":
                args[k] = int(p.get("minimum", 1))
            elif "enum" in p:
                args[k] = p["enum"][0]
            else:
                return None
    return args


async def negative_controls(rt: Any, server_hash: str, start: Any, spec: Any, gold: Sequence[ToolCall],
                            tools: dict[str, dict], forbidden: Sequence[str] = (), budget: int = 12) -> list[str]:
    """The negative controls that ``spec`` passes (``[]`` for a sound verifier); see the module docstring."""
    from treadle.weft.evolve.certify import play
    from treadle.weft.evolve.grounding import open_copy

    passed = []
    _, v = await play(rt, server_hash, start, spec, [])
    if v.r == 1 and gold:
        passed.append("do-nothing agent passes")

    def writes(name: str) -> bool:
        return bool(((tools.get(name) or {}).get("contract") or {}).get("writes"))

    reads = [c for c in gold if not writes(c.name)]
    if reads and len(reads) < len(gold) and v.r == 0:
        _, rv = await play(rt, server_hash, start, spec, reads)
        if rv.r == 1:
            passed.append(f"a read-only agent passes (the gold's reads {[c.name for c in reads]} without its writes)")
    ref_outs, ref_v = await play(rt, server_hash, start, spec, list(gold))
    if ref_v.r != 1 or not all(o.ok for o in ref_outs):
        return passed  # a verifier that fails the reference is another fault (reference_rejected)
    from treadle.weft.evolve.probes import run_calls

    _, ref_diff = await run_calls(rt, server_hash, start, gold)
    con = open_copy(start) if start.kind == "sqlite" else None
    try:
        n = 0
        for i, c in enumerate(gold):
            if not ((tools.get(c.name) or {}).get("contract") or {}).get("writes"):
                continue
            for p in _perturbations(c, tools.get(c.name) or {}, con):
                if n >= budget:
                    break
                n += 1
                calls = [*gold[:i], p, *gold[i + 1:]]
                outs, d = await run_calls(rt, server_hash, start, calls)
                if not all(o.ok for o in outs) or d == ref_diff:
                    continue
                _, pv = await play(rt, server_hash, start, spec, calls)
                if pv.r == 1:
                    passed.append(f"a perturbed gold passes: {p} for {c}")
                    break
        base = {k: v for c in gold for k, v in c.arguments.items()}
        for name in forbidden:
            args = _fill(tools.get(name) or {}, base)
            if args is None:
                continue
            calls = [*gold, ToolCall(name=name, arguments=args)]
            _, fv = await play(rt, server_hash, start, spec, calls)
            if fv.r == 1:
                passed.append(f"a forbidden-tool agent passes ({name})")
        used = {c.name for c in gold} | set(forbidden)
        for name in sorted(t for t in tools if t not in used and writes(t))[:budget]:
            args = _fill(tools.get(name) or {}, base)
            if args is None:
                continue
            calls = [*gold, ToolCall(name=name, arguments=args)]
            outs, d = await run_calls(rt, server_hash, start, calls)
            if not all(o.ok for o in outs) or d == ref_diff:
                continue
            _, ev = await play(rt, server_hash, start, spec, calls)
            if ev.r == 1:
                passed.append(f"an agent adding an unrequested write passes ({calls[-1]})")
                break
    finally:
        if con is not None:
            con.close()
    return passed


def forbidden_by_request(request: str, tools: dict[str, dict]) -> list[str]:
    """Tools the request forbids in words (``do not add notes``, ``no need to look the case up``): a tool whose
    name's verb or object follows a negation within three words."""
    words = re.findall(r"[a-z']+", request.lower())
    out = []
    for name in sorted(tools):
        parts = name.lower().split("_")
        for i, w in enumerate(words):
            if w in {"not", "don't", "never", "no", "without"}:
                window = words[i + 1:i + 5]
                stems = {x.rstrip("s") for x in window}
                if parts[0] in window and (len(parts) == 1 or parts[1].rstrip("s") in stems):
                    out.append(name)
                    break
    return out

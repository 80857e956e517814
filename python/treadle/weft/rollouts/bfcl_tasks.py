"""BFCL v4 multi-turn entries as rollout tasks (seed: WEFT 4.1 atomic turns over a real benchmark).

Each BFCL turn is one atomic task: its request is the turn's user message(s), its checkpoint the
turn's gold calls judged WEFT's way (``per_turn`` in :mod:`treadle.weft.envs.bfcl`: the gold replayed
from the agent's state at the turn start, public attributes compared, a call on a turn with empty
gold fails it), and it depends on the previous turn. The environment of an entry is its class's
servers (one per involved class) at the entry's ``initial_config`` (env name
``bfcl:<category>:<entry id>``; a call is routed to the class that owns the tool, each turn judged
per class and merged, see :mod:`~treadle.weft.rollouts.sessions`).

Tools that change per turn are offered as upstream offers them: an entry's ``excluded_function`` are
never offered, its ``missed_function`` only from their turn on (each atomic task lists its turn's
tools in ``tools``; the runtime answers an earlier call ``unknown_tool``). The turn that hands over a
withheld function has no user message upstream; like upstream's inference loop, its request is
``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC`` ("I have updated some more functions ...").
Scope (checked by :func:`eligible`, the rest is skipped with its reason in :func:`skipped`): every
other turn with a user message, and not in ``KNOWN_BAD_GOLD`` (gold no honest trajectory passes). BFCL *scores* use upstream's cumulative rule through
:func:`treadle.weft.envs.bfcl.run_entry`; these tasks are for sampling training data.

Needs ``bfcl-eval`` (``pip install --no-deps bfcl-eval``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from treadle.weft.rollouts.tasks import AtomicTask, Disclosure, RolloutTask, details_of

PREFIX = "bfcl:"


@lru_cache(maxsize=None)
def _entries(category: str) -> tuple[dict[str, dict[str, Any]], dict[str, list[list[str]]]]:
    from treadle.weft.envs import bfcl

    entries, gold = bfcl.load_entries(category)  # ValueError on an unknown category
    return {e["id"]: e for e in entries}, gold


def eligible(entry: dict[str, Any]) -> str | None:
    """None if ``entry`` can be a rollout task, else why not (one line)."""
    from treadle.data.bfcl import missed_function_names
    from treadle.weft.envs import bfcl

    if entry["id"] in bfcl.KNOWN_BAD_GOLD:
        return f"known bad gold: {bfcl.KNOWN_BAD_GOLD[entry['id']]}"
    handover = set(missed_function_names(entry))
    if any(not [m for m in turn if m.get("role") == "user"] and k not in handover
           for k, turn in enumerate(entry["question"])):
        return "a turn without a user message"
    return None


ADDITIONAL_FUNCTION_PROMPT = "I have updated some more functions you can choose from. What about now?"
"""Upstream's ``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC``: the user turn that hands over withheld functions."""


def turn_tools(entry: dict[str, Any]) -> list[tuple[str, ...] | None]:
    """Per turn, the tool names offered (every involved class's tools minus ``excluded_function`` and the
    ``missed_function`` not handed over yet); all None when the entry offers every tool on every turn."""
    from treadle.data.bfcl import function_docs, missed_function_names

    missed = missed_function_names(entry)
    excluded = set(entry.get("excluded_function") or [])
    if not missed and not excluded:
        return [None] * len(entry["question"])
    names = list(dict.fromkeys(d["name"] for d in function_docs(list(entry["involved_classes"]))))
    given = {n: k for k, ns in missed.items() for n in ns}
    return [tuple(n for n in names if n not in excluded and given.get(n, -1) <= k)
            for k in range(len(entry["question"]))]


def _request(entry: dict[str, Any], k: int) -> str:
    from treadle.data.bfcl import missed_function_names

    text = "\n".join(m["content"] for m in entry["question"][k] if m.get("role") == "user")
    if not text and k in missed_function_names(entry):
        try:
            from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC as text
        except ImportError:  # an upstream without the constant: its known wording
            text = ADDITIONAL_FUNCTION_PROMPT
    return text


def skipped(category: str = "base") -> dict[str, str]:
    """``{entry id: reason}`` of the category's entries that :func:`from_bfcl` leaves out."""
    by_id, _ = _entries(category)
    return {i: r for i, e in by_id.items() if (r := eligible(e)) is not None}


def _param_order(class_names: list[str]) -> dict[str, list[str]]:
    from treadle.data.bfcl import function_docs
    from treadle.weft.envs.bfcl_schema import bfcl_to_tool

    out: dict[str, list[str]] = {}
    for t in map(bfcl_to_tool, function_docs(class_names)):
        out.setdefault(t["name"], list(t["input_schema"].get("properties", {})))
    return out


def task_of(entry: dict[str, Any], gold: list[list[str]], category: str = "base",
            disclosure: Disclosure = "full") -> RolloutTask:
    """One eligible entry as a :class:`RolloutTask`. Raises ValueError (with :func:`eligible`'s reason)."""
    from treadle.weft.runtime.callparse import parse_call
    from treadle.weft.runtime.verify import CheckpointSpec

    why = eligible(entry)
    if why is not None:
        raise ValueError(f"BFCL entry {entry['id']!r} cannot be a rollout task: {why}")
    order = _param_order(list(entry["involved_classes"]))
    offers = turn_tools(entry)
    atomic = []
    for k, gold_turn in enumerate(gold[:len(entry["question"])]):
        name = f"{entry['id']}/turn{k}"
        calls = [parse_call(g, param_order=order) for g in gold_turn]
        spec = CheckpointSpec(name=name, gold_calls=calls, compare_private=False,
                              calls_allowed_without_gold=bool(calls))
        request = _request(entry, k)
        atomic.append(AtomicTask(name=name, request=request, details=details_of(request, spec),
                                 depends_on=(f"{entry['id']}/turn{k - 1}",) if k else (), checkpoint=spec,
                                 tools=offers[k]))
    return RolloutTask(name=entry["id"], env=f"{PREFIX}{category}:{entry['id']}", atomic=tuple(atomic),
                       disclosure=disclosure)


def from_bfcl(category: str = "base", *, limit: int | None = None, ids: list[str] | None = None,
              disclosure: Disclosure = "full") -> list[RolloutTask]:
    """Eligible entries of a BFCL multi-turn category as rollout tasks, in file order.

    Args:
        category: a BFCL multi-turn category (``base``, ``miss_param``, ``long_context``, ...).
        limit: at most this many tasks (None: all eligible). ids: only these entry ids (each must exist
            and be eligible).

    Raises:
        ValueError: unknown category, ``limit < 1``, an unknown or ineligible id.
        ModuleNotFoundError: ``bfcl-eval`` is not installed.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
    by_id, gold = _entries(category)
    if ids is not None:
        unknown = [i for i in ids if i not in by_id]
        if unknown:
            raise ValueError(f"unknown BFCL {category} entry id(s) {unknown}")
        chosen = [by_id[i] for i in ids]
    else:
        chosen = [e for e in by_id.values() if eligible(e) is None]
    out = [task_of(e, gold[e["id"]], category, disclosure) for e in chosen]
    return out[:limit] if limit is not None else out


async def bfcl_env(rt: Any, env_name: str) -> Any:
    """The :class:`~treadle.weft.rollouts.sessions.Env` of ``bfcl:<category>:<entry id>``: one server per
    involved class, registered in ``rt``, each at its snapshot after ``_load_scenario(initial_config)``.

    Raises:
        ValueError: a malformed env name, unknown category or entry id.
    """
    from treadle.weft.envs import bfcl
    from treadle.weft.rollouts.sessions import Env, env_of

    _, _, rest = env_name.partition(PREFIX)
    category, _, entry_id = rest.partition(":")
    by_id, _ = _entries(category)
    if entry_id not in by_id:
        raise ValueError(f"env {env_name!r}: no BFCL {category} entry {entry_id!r}")
    entry = by_id[entry_id]
    servers = []
    for cls in entry["involved_classes"]:
        h = bfcl.register_class(rt, cls)
        snap = bfcl.initial_snapshot(rt, h, cls, entry.get("initial_config", {}).get(cls, {}),
                                     long_context=category == "long_context")
        servers.append((await env_of(rt, h, snap)).servers[0])
    first, *more = servers
    return Env(server_hash=first.server_hash, snapshot=first.snapshot, tools=first.tools, more=tuple(more))

"""BFCL v4 multi-turn environments as WEFT servers (needs the ``bfcl-eval`` package's code and data).

Each of BFCL's eight stateful classes (file system, trading, travel, vehicle, messaging, posting,
ticketing, math) becomes one server module: the class's own source file, followed by a generated
``server = class_server(...)`` declaration whose tools call the class's methods, with BFCL's function
docs converted to JSON Schema (:mod:`treadle.weft.envs.bfcl_schema`) and embedded as a literal. The
registry hashes the whole text (BFCL code + docs) and the static check runs over BFCL's code.
State is the class instance's attributes (object backend) after ``_load_scenario(initial_config)``.

Differences from upstream's harness, on purpose:

- model calls are never ``eval``-ed: call strings are parsed by :mod:`treadle.weft.runtime.callparse` and
  dispatched through MCP to the session that owns the tool;
- every session imports its own copy of the class module (or shares one only when the static check
  finds nothing), and instances are never cached in module globals by name, so two checks cannot
  leak into each other; scenario configs are deep-copied before loading;
- turns are judged by upstream's rule by default (``judging="cumulative"``, what BFCL numbers must
  use: the gold replayed from the initial state, the agent's state compared with it after every
  turn whose gold is not empty, gold results among the agent's results so far, all-or-nothing per
  entry), or as atomic tasks (``judging="per_turn"``, seed: WEFT 4.1: the gold calls of turn k
  replayed from the *agent's* state at the start of turn k, so a mistake fails its own turn only).
  Both compare public attributes as BFCL's checker does.

Install: ``pip install --no-deps bfcl-eval`` (its declared dependencies pin numpy and pull model SDKs
that the environments do not use); ``mpmath`` is needed by the math class.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from treadle.data import bfcl as _data
from treadle.data.bfcl import function_docs, load_bfcl_multi_turn, missed_function_names
from treadle.weft.envs.bfcl_schema import bfcl_to_tool
from treadle.weft.runtime.callparse import ToolCall, parse_call
from treadle.weft.runtime.errors import CallParseError
from treadle.weft.runtime.object_state import snapshot_from_object
from treadle.weft.runtime.registry import release_module
from treadle.weft.runtime.server import WeftServer
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import (CheckpointResult, CheckpointSpec, FailureReason, merge_checkpoints,
                                 trajectory_reward)



def __getattr__(name: str) -> Any:
    """``CLASSES`` (class name -> (module path, function-doc file)) and ``CATEGORIES``: bfcl-eval's own
    tables through :mod:`treadle.data.bfcl`, read on first use; ``KNOWN_BAD_GOLD``: ``{entry id: reason}``
    of the entries excluded from scoring by the mechanical audit (:mod:`treadle.weft.envs.bfcl_audit`)."""
    if name == "CLASSES":
        return _data.MULTI_TURN_CLASSES
    if name == "CATEGORIES":
        return _data.MULTI_TURN_CATEGORIES
    if name == "KNOWN_BAD_GOLD":  # {entry id: reason}: entries no honest trajectory can pass, never scored
        from treadle.weft.envs.bfcl_audit import excluded

        return excluded()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

def bfcl_root() -> Path:
    """The installed ``bfcl_eval`` package folder.

    Raises:
        ModuleNotFoundError: ``bfcl-eval`` is not installed (``pip install --no-deps bfcl-eval``).
    """
    import bfcl_eval

    return Path(bfcl_eval.__file__).parent


def _method_caller(name: str, method: Any, schema: dict[str, Any]):
    """A tool function ``(state, **params)`` calling ``state.<name>(**params)``, with the method's defaults."""
    msig = inspect.signature(method)
    params = [inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    for p in list(msig.parameters.values())[1:]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        params.append(inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=p.default, annotation=Any))
        annotations[p.name] = Any
    missing = set(schema.get("properties", {})) - set(annotations)
    if missing:
        raise ValueError(f"BFCL doc of {name} names parameters {sorted(missing)} that the method does not take")

    def call(state: Any, **kwargs: Any) -> Any:
        return getattr(state, name)(**kwargs)

    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__annotations__ = annotations
    call.__name__ = name
    call.__doc__ = None
    return call


def class_server(cls: type, docs: list[dict[str, Any]], name: str) -> WeftServer:
    """A :class:`WeftServer` (object backend) whose tools are ``cls``'s documented methods.

    Properties of each converted schema are put in the method's parameter order (so positional
    arguments in call strings bind as Python would bind them).

    Raises:
        ValueError: a doc names a method or parameter ``cls`` does not have, or an invalid schema.
    """
    server = WeftServer(name, backend="object", state_class=cls)
    for doc in docs:
        tool = bfcl_to_tool(doc)
        method = getattr(cls, tool["name"], None)
        if method is None:
            raise ValueError(f"BFCL doc names {tool['name']!r} but {cls.__name__} has no such method")
        schema = tool["input_schema"]
        order = [p for p in inspect.signature(method).parameters if p != "self"]
        props = schema.get("properties", {})
        schema["properties"] = {k: props[k] for k in sorted(props, key=lambda k: order.index(k) if k in order else 1e9)}
        server.tool(_method_caller(tool["name"], method, schema), name=tool["name"], writes=("attributes",),
                    description=tool["description"], input_schema=schema)
    return server


@lru_cache(maxsize=None)
def server_source(class_name: str) -> str:
    """Source of the WEFT server module for one BFCL class: its code + a generated declaration."""
    classes = _data.MULTI_TURN_CLASSES
    if class_name not in classes:
        raise ValueError(f"unknown BFCL class {class_name!r}; known: {sorted(classes)}")
    spec = importlib.util.find_spec(classes[class_name][0])  # upstream's module for the class
    code = Path(spec.origin).read_text(encoding="utf-8")
    docs = function_docs([class_name])
    decl = (f"\n\n# --- generated by treadle.weft.envs.bfcl: WEFT server declaration for {class_name} ---\n"
            "import json as _weft_json\n"
            "from treadle.weft.envs.bfcl import class_server as _weft_class_server\n"
            f"_WEFT_DOCS = {json.dumps(docs)!r}\n"
            f"server = _weft_class_server({class_name}, _weft_json.loads(_WEFT_DOCS), name={class_name!r})\n")
    return code + decl


def load_entries(category: str) -> tuple[list[dict[str, Any]], dict[str, list[list[str]]]]:
    """Entries of one multi-turn category and their gold answers ``{id: [[call, ...] per turn]}``."""
    entries = load_bfcl_multi_turn(category)  # deep copies; raises ValueError on an unknown category
    gold = {e["id"]: e.pop("ground_truth") for e in entries}
    return entries, gold


def register_class(rt: Any, class_name: str) -> str:
    """Register one BFCL class's server in a runtime (idempotent: content-addressed); returns its hash."""
    return rt.register(server_source(class_name))


def initial_snapshot(rt: Any, server_hash: str, class_name: str, config: dict[str, Any], *,
                     long_context: bool = False) -> Snapshot:
    """Snapshot of a fresh instance after ``_load_scenario(deepcopy(config), long_context=...)`` (when the
    class has one).

    The caller's ``config`` is never referenced by the snapshot (deep copy, then pickled).
    """
    module, weft = rt.registry.load(server_hash)
    try:
        obj = weft.state_class()
        load = getattr(obj, "_load_scenario", None)  # stateless classes (MathAPI) have none
        if load is not None:
            load(copy.deepcopy(config), long_context=long_context)
        return snapshot_from_object(obj)
    finally:
        release_module(module)


#: How turns are judged. ``cumulative`` is upstream's rule (bfcl-eval's ``multi_turn_checker``), the
#: default and the one to use when reporting BFCL numbers; ``per_turn`` is WEFT's atomic-turn rule.
JUDGING = ("cumulative", "per_turn")


class BfclEntryResult(BaseModel):
    """Per-turn verdicts of one BFCL entry and its reward.

    ``reward``: under ``cumulative`` judging upstream's entry verdict (1.0 when every turn passes, else
    0.0: BFCL accuracy is the mean of it); under ``per_turn`` judging ``R = mean_k r_k``.
    """

    id: str
    judging: str = "cumulative"
    results: list[CheckpointResult]
    reward: float
    outcomes: list[list[dict[str, Any]]]


async def run_entry(rt: Any, entry: dict[str, Any], gold: list[list[str]], policy: Any, *,
                    category: str = "base", judging: str = "cumulative") -> BfclEntryResult:
    """Run one BFCL multi-turn entry in ``rt``: one session per involved class, one checkpoint per turn.

    Args:
        rt: an open :class:`~treadle.weft.runtime.Runtime`.
        entry: the entry (``id``, ``involved_classes``, ``initial_config``, ...); not modified.
        gold: the entry's ground truth, one list of call strings per turn.
        policy: ``policy(turn_index) -> list of call strings`` (the agent's calls for that turn).
        category: one of :data:`CATEGORIES` (``long_context`` loads the long-context scenario).
        judging: one of :data:`JUDGING`.

            - ``"cumulative"`` (upstream's rule, the default; use it for BFCL numbers): the gold calls
              are replayed turn after turn from the initial state, in sessions of their own. On each
              turn whose gold is not empty the agent must have made a call, its state (public
              attributes of every class) must equal the gold state so far, and the gold results of
              the turn must be among the results the agent received on this or an earlier turn. Turns
              with empty gold are not checked (their calls still change the state later turns are
              compared with). The entry passes only if every turn does: ``reward`` is 1.0 or 0.0.
            - ``"per_turn"`` (WEFT's atomic turns, seed: WEFT 4.1): the gold calls of turn k are
              replayed from the *agent's* state at the start of turn k, so a mistake fails its own
              turn only; a call on a turn whose gold is empty fails it; ``reward = mean_k r_k``.

    Raises:
        ValueError: unknown ``judging`` (before any session is created).

    A call string that does not parse, or names a tool no involved class has, is recorded as an
    ``invalid_args`` / ``unknown_tool`` outcome of the first class's session; a turn's verdict is merged
    from one verdict per class by :func:`~treadle.weft.runtime.verify.merge_checkpoints`, which decides
    ``interface_error`` on the whole turn (so the reason stays when the session that recorded the
    error passed its own part and another class's part failed). Tools in the entry's
    ``excluded_function`` are never offered; those in ``missed_function`` only from their turn on
    (an earlier call gets ``unknown_tool``).
    """
    if judging not in JUDGING:
        raise ValueError(f"judging must be one of {JUDGING}, got {judging!r}")
    cumulative = judging == "cumulative"
    long_context = category == "long_context"
    sessions: dict[str, str] = {}
    gold_sessions: dict[str, str] = {}
    owner: dict[str, str] = {}
    order: dict[str, list[str]] = {}
    results: list[CheckpointResult] = []
    all_outcomes: list[list[dict[str, Any]]] = []
    try:
        for cls_name in entry["involved_classes"]:
            h = register_class(rt, cls_name)
            snap = initial_snapshot(rt, h, cls_name, entry.get("initial_config", {}).get(cls_name, {}),
                                    long_context=long_context)
            sessions[cls_name] = await rt.create_session(h, snap)
            if cumulative:  # the gold trajectory, advanced turn by turn alongside the agent's
                gold_sessions[cls_name] = await rt.create_session(h, snap)
            for t in rt.registry.spec(h).tools:
                owner.setdefault(t["name"], cls_name)
                order.setdefault(t["name"], list(t["input_schema"].get("properties", {})))
        first = next(iter(sessions.values()))
        excluded = set(entry.get("excluded_function") or [])
        withheld = {name: turn for turn, names in missed_function_names(entry).items() for name in names}
        earlier: dict[str, list[Any]] = {c: [] for c in sessions}  # the agent's successful calls of past turns
        for k, gold_turn in enumerate(gold):
            for c, sid in sessions.items():  # tools offered this turn: minus excluded and not-yet-given ones
                rt.set_available_tools(sid, [t for t in rt.server_of(sid).tool_names
                                             if t not in excluded and withheld.get(t, -1) <= k])
            starts = {c: rt.snapshot(sid) for c, sid in (gold_sessions if cumulative else sessions).items()}
            outs: dict[str, list[Any]] = {c: [] for c in sessions}
            turn_log = []
            turn_outs = []  # every outcome of the turn, in call order, whichever session recorded it
            for text in policy(k):
                try:
                    call: ToolCall | None = parse_call(text, param_order=order)
                except CallParseError:
                    call = None
                if call is None or call.name not in owner:
                    out = await rt.call(first, text)
                    outs[next(iter(sessions))].append(out)
                else:
                    out = await rt.call_tool(sessions[owner[call.name]], call.name, call.arguments)
                    outs[owner[call.name]].append(out)
                turn_outs.append(out)
                turn_log.append(out.model_dump(mode="json"))
            all_outcomes.append(turn_log)
            gold_calls = [parse_call(g, param_order=order) for g in gold_turn]
            name = f"{entry['id']}/turn{k}"
            if cumulative and not gold_calls:
                results.append(CheckpointResult(name=name, r=1))  # upstream checks nothing on such a turn
            elif cumulative and not turn_log:
                results.append(CheckpointResult(name=name, r=0, reasons=[FailureReason.response_mismatch], details=[
                    "response_mismatch: no call on a turn whose gold has calls (upstream: empty_turn_model_response)"]))
            else:
                parts = []
                for c, sid in sessions.items():
                    spec = CheckpointSpec(name=f"{name}/{c}", gold_calls=[g for g in gold_calls if owner.get(g.name) == c],
                                          compare_private=False,
                                          calls_allowed_without_gold=cumulative or bool(gold_calls))
                    seen = earlier[c] + outs[c] if cumulative else outs[c]
                    parts.append(await rt.verify_turn(sid, starts[c], spec, seen))
                results.append(merge_checkpoints(name, parts, turn_outs))
            for c in sessions:
                earlier[c] += [o for o in outs[c] if o.ok]
            for g in gold_calls if cumulative else []:
                if g.name in owner:
                    await rt.call_tool(gold_sessions[owner[g.name]], g.name, g.arguments)
    finally:
        for sid in [*sessions.values(), *gold_sessions.values()]:
            await rt.close(sid)
    reward = float(all(r.r == 1 for r in results)) if cumulative else trajectory_reward(results)
    return BfclEntryResult(id=entry["id"], judging=judging, results=results, reward=reward, outcomes=all_outcomes)

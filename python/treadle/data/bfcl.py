"""BFCL v4 multi-turn entries and their stateful environment classes, from the ``bfcl-eval`` package
(Berkeley Function-Calling Leaderboard, Patil et al.; multi-turn categories of BFCL v3/v4).

Install the package WITHOUT its dependencies (it pulls gigabytes of model SDKs otherwise)::

    pip install --no-deps bfcl-eval

Only its shipped JSON data and the eight multi-turn backends (``GorillaFileSystem``, ``MathAPI``,
``MessageAPI``, ``TwitterAPI``, ``TicketAPI``, ``TradingBot``, ``TravelAPI``,
``VehicleControlAPI``) are used; those import nothing beyond the standard library and ``mpmath``.
Every loader hands out deep copies: callers can never alter the shipped data.
"""
from __future__ import annotations

import copy
import importlib
import json
from functools import lru_cache

__all__ = ["MULTI_TURN_CATEGORIES", "MULTI_TURN_CLASSES", "load_bfcl_multi_turn", "function_docs", "make_environment"]

MULTI_TURN_CATEGORIES = ("base", "miss_func", "miss_param", "long_context")

#: class name -> (module under bfcl_eval's func_source_code, function-doc file)
MULTI_TURN_CLASSES = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
_BACKENDS = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
_STATELESS = ("MathAPI",)


def _data_dir():
    try:
        import importlib.resources as resources

        root = resources.files("bfcl_eval") / "data"
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("BFCL loaders need the 'bfcl-eval' package, installed without its dependencies: "
                                  "pip install --no-deps bfcl-eval") from err
    return root


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@lru_cache(maxsize=None)
def _entries(category: str) -> tuple[dict, ...]:
    root = _data_dir()
    entries = _read_jsonl(root / f"BFCL_v4_multi_turn_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(root / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json")}
    for e in entries:
        e["ground_truth"] = answers.get(e["id"])
    return tuple(entries)


def load_bfcl_multi_turn(category: str = "base", limit: int | None = None) -> list[dict]:
    """BFCL v4 multi-turn entries of one category, as fresh deep copies.

    Each dict has ``id``, ``question`` (one list of messages per user turn), ``initial_config``
    (class name -> that environment's starting state), ``involved_classes``, ``path``,
    ``excluded_function``, ``missed_function`` (``miss_func`` only) and ``ground_truth`` (per turn,
    the list of reference calls as Python-call strings, from the package's possible answers).

    Args:
        category: one of :data:`MULTI_TURN_CATEGORIES` (200 entries each).
        limit: at most this many entries.

    Raises:
        ValueError: unknown category, negative limit.
        ModuleNotFoundError: ``bfcl-eval`` is not installed.
    """
    if category not in MULTI_TURN_CATEGORIES:
        raise ValueError(f"category must be one of {MULTI_TURN_CATEGORIES}, got {category!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    entries = _entries(category)
    return copy.deepcopy(list(entries[:limit] if limit is not None else entries))


@lru_cache(maxsize=None)
def _docs(class_name: str) -> tuple[dict, ...]:
    return tuple(_read_jsonl(_data_dir() / "multi_turn_func_doc" / MULTI_TURN_CLASSES[class_name][1]))


def function_docs(class_names: list[str]) -> list[dict]:
    """JSON-schema-like function documents of the given classes' tools (deep copies), in order.

    Raises:
        ValueError: a class name not in :data:`MULTI_TURN_CLASSES`.
    """
    for c in class_names:
        if c not in MULTI_TURN_CLASSES:
            raise ValueError(f"unknown BFCL multi-turn class {c!r}; known: {sorted(MULTI_TURN_CLASSES)}")
    return copy.deepcopy([d for c in class_names for d in _docs(c)])


def make_environment(entry: dict, *, long_context: bool | None = None) -> dict:
    """Fresh instances of an entry's environment classes, loaded with (a deep copy of) its initial state.

    Args:
        entry: an entry from :func:`load_bfcl_multi_turn` (it is not modified).
        long_context: passed to the classes' ``_load_scenario`` (default: True for ids containing
            ``long_context``).

    Returns:
        ``{class_name: instance}``; call tools as methods, e.g. ``env["GorillaFileSystem"].ls()``.

    Raises:
        ValueError: the entry lacks ``involved_classes`` or names an unknown class.
        ModuleNotFoundError: ``bfcl-eval`` is not installed.
    """
    if not isinstance(entry, dict) or "involved_classes" not in entry:
        raise ValueError("entry must be a BFCL multi-turn entry dict with 'involved_classes'")
    lc = ("long_context" in str(entry.get("id", ""))) if long_context is None else long_context
    config = entry.get("initial_config", {})
    env = {}
    for name in entry["involved_classes"]:
        if name not in MULTI_TURN_CLASSES:
            raise ValueError(f"unknown BFCL multi-turn class {name!r}; known: {sorted(MULTI_TURN_CLASSES)}")
        _data_dir()
        module = importlib.import_module(f"{_BACKENDS}.{MULTI_TURN_CLASSES[name][0]}")
        inst = getattr(module, name)()
        if name not in _STATELESS:
            inst._load_scenario(copy.deepcopy(config.get(name, {})), long_context=lc)
        env[name] = inst
    return env

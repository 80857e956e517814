"""Answer checking with ``math-verify`` (Hugging Face's math answer verifier), never a parser of ours.

:func:`is_correct` parses the gold answer and the model's completion with ``math_verify.parse`` and
compares them with ``math_verify.verify`` (symbolic equality via sympy). :func:`reward` turns that
into the 0/1 outcome reward used by GRPO (DeepSeekMath sec. 4.1 / RLVR-style verifiable rewards).
"""
from __future__ import annotations

__all__ = ["is_correct", "reward", "rewards"]


def _mv():
    try:
        import math_verify
    except ModuleNotFoundError as err:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError("treadle.data.verify needs the 'math-verify' package: "
                                  "pip install math-verify (it is in requirements-dev.txt)") from err
    return math_verify


def is_correct(completion: str, gold: str) -> bool:
    """Whether ``completion`` states the same value as ``gold``, according to math-verify.

    Args:
        completion: the model's text (e.g. ``"42"``, ``"x=5"``, ``"The answer is 12"``: math-verify
            extracts the last expression).
        gold: the reference answer text (e.g. ``Problem.answer``).

    Returns:
        True if math-verify finds them equal; False for unparsable or empty completions.

    Raises:
        TypeError: either argument is not a str.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a str, got {type(gold).__name__}")
    mv = _mv()
    pred = mv.parse(completion)
    if not pred:
        return False
    return bool(mv.verify(mv.parse(gold), pred))


def reward(completion: str, gold: str) -> float:
    """0/1 verifiable reward: ``1.0`` if :func:`is_correct` else ``0.0`` (see there for raises)."""
    return 1.0 if is_correct(completion, gold) else 0.0


def rewards(completions: list[str], golds: list[str]) -> list[float]:
    """:func:`reward` for each pair.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(completions) != len(golds):
        raise ValueError(f"completions ({len(completions)}) and golds ({len(golds)}) must have the same length")
    return [reward(c, g) for c, g in zip(completions, golds)]

"""The verifier: outside the harness, versioned, and never edited by the loop (seed: RSI section 3.2).

:func:`check_task` decides whether a task is *valid* by re-deriving its answer from the rendered text
with sympy, independently of the generator's own arithmetic: the text parses, the answer is unique,
an integer, at most :data:`MAX_ABS` in magnitude, and equal to the generator's reference answer.
:func:`check_answer` compares a solver's answer with the reference exactly (sympy rationals).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import sympy

__all__ = ["MAX_ABS", "VERIFIER_VERSION", "TaskCheck", "check_answer", "check_task"]

VERIFIER_VERSION = "math-sympy-1"
MAX_ABS = 10 ** 6
_X = sympy.Symbol("x")
_Q = re.compile(r"(?:^|\. )(Compute (?P<e>[^ ]+)\.|Solve (?P<l>[^ =]+)=(?P<r>[^ ]+) for x\.)$")
_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


@dataclass(frozen=True)
class TaskCheck:
    """Verdict on one task: ``valid``; ``reason`` (``"ok"``, ``"unparsable"``, ``"no_unique_solution"``,
    ``"non_integer_answer"``, ``"too_large"``, ``"wrong_reference_answer"``); ``answer`` (the verifier's)."""

    valid: bool
    reason: str
    answer: str | None


_SAFE = re.compile(r"[0-9x+\-*/()]{1,2000}")
_LONG_NUMBER = re.compile(r"\d{31}")


def _parse(expr: str):
    """sympy expression of task text. ``sympy.parse_expr`` ``eval``s its input, so only the grammar tasks are
    rendered in reaches it: integers of at most 30 digits, ``x`` at most twice (``sympy.solve`` stays at degree
    2), ``+ - * /``, parentheses nested at most 20 deep, no ``**``. Model-written task text can then neither run
    code nor build an exponent tower."""
    if not _SAFE.fullmatch(expr) or "**" in expr or _LONG_NUMBER.search(expr) or expr.count("x") > 2:
        raise SyntaxError("outside the task grammar")
    depth = best = 0
    for c in expr:
        depth += (c == "(") - (c == ")")
        best = max(best, depth)
    if best > 20:
        raise SyntaxError("parentheses nested too deep")
    return sympy.parse_expr(expr, local_dict={"x": _X}, evaluate=True)


def check_task(text: str, reference: str) -> TaskCheck:
    """Validity of the task ``text`` with the generator's ``reference`` answer (see module docstring)."""
    m = _Q.search(text)
    if m is None:
        return TaskCheck(False, "unparsable", None)
    try:
        if m.group("e") is not None:
            val = _parse(m.group("e"))
            if val.has(sympy.zoo, sympy.nan) or not val.is_Rational:
                return TaskCheck(False, "no_unique_solution", None)
        else:
            if not _NUM.fullmatch(m.group("r")):
                return TaskCheck(False, "no_unique_solution", None)
            sols = sympy.solve(sympy.Eq(_parse(m.group("l")), _parse(m.group("r"))), _X)
            if len(sols) != 1:
                return TaskCheck(False, "no_unique_solution", None)
            val = sols[0]
    except (sympy.SympifyError, SyntaxError, TypeError, ValueError, ZeroDivisionError, AttributeError,
            RecursionError):
        return TaskCheck(False, "unparsable", None)
    if not val.is_Integer:
        return TaskCheck(False, "non_integer_answer", str(val))
    if abs(int(val)) > MAX_ABS:
        return TaskCheck(False, "too_large", str(val))
    if not check_answer(reference, str(val)):
        return TaskCheck(False, "wrong_reference_answer", str(val))
    return TaskCheck(True, "ok", str(val))


def check_answer(answer: str, reference: str) -> bool:
    """Whether ``answer``'s last number (``"x=5"``, ``"The answer is -3"``) equals ``reference`` exactly."""
    nums = _NUM.findall(answer or "")
    if not nums:
        return False
    if len(nums[-1]) > 200:  # no task answer is that long; sympy would parse it digit by digit
        return False
    try:
        return sympy.Rational(nums[-1]) == sympy.Rational(reference)
    except (TypeError, ValueError, ZeroDivisionError, sympy.SympifyError):
        return False


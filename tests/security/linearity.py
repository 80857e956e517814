"""Shared by the fuzz targets: hypothesis settings sized for CI, the typed failures a parser may raise,
and a growth check that tells a linear parse from a quadratic or cubic one.

The growth check is a ratio, not a time limit: the same degenerate input at size n and 8n, best of three
runs each; linear work grows ~8x, quadratic 64x, cubic 512x, so a bound of 32x has a 4x margin for noise
on a loaded machine either way. It is measured on inputs large enough (tens of thousands of characters)
that a backtracking regex takes far longer than timer noise.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

GROWTH_LIMIT = 32.0
SMALL = 4_000
BIG = SMALL * 8

# pieces that model output is made of and that parsers treat specially: fences, tags, keys, brackets,
# whitespace runs, quotes, escapes, digits, unpaired surrogates and NUL
PIECES = ["```", "```json\n", "```python\n", "\n", " ", "\t", "  \n", "{", "}", "[", "]", "(", ")", '"', "'", "\\",
          ":", ",", "=", "0", "9" * 12, "-", ".", "e", "a", "name", "arguments", "<tool_call>", "</tool_call>",
          "Action:", "Action Input:", "Thought:", "Final Answer:", "Observation:", "<think>", "</think>",
          "<final>", "</final>", "[[reply_to:", "]]", "sk-", "\x00", "\ud800", "é", "null", "true", "f(", "a=1"]
text_pieces = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)
hostile_text = st.one_of(text_pieces, st.text(max_size=300))
unit = st.lists(st.sampled_from(PIECES), min_size=1, max_size=4).map("".join)


def _best(fn: Callable[[str], object], text: str) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - t0)
    return best


def growth(fn: Callable[[str], object], make: Callable[[int], str]) -> float:
    """Time ratio of ``fn(make(BIG))`` to ``fn(make(SMALL))`` (best of three each; a floor of 0.2 ms on the
    small one keeps a parse too fast to time from reading as growth)."""
    return _best(fn, make(BIG)) / max(_best(fn, make(SMALL)), 2e-4)


def assert_linear(fn: Callable[[str], object], make: Callable[[int], str], what: str = "") -> None:
    """Fails when ``fn`` grows faster than linearly on ``make(n)`` (retried once: one noisy sample is not a
    failure, a backtracking parse is slow on both tries)."""
    ratios = []
    for _ in range(2):
        ratios.append(growth(fn, make))
        if ratios[-1] < GROWTH_LIMIT:
            return
    raise AssertionError(f"{what or fn}: 8x the input took {min(ratios):.0f}x the time (linear ~8x)")


def repeat_to(unit_text: str) -> Callable[[int], str]:
    """``make(n)``: ``unit_text`` repeated to about ``n`` characters."""
    return lambda n: unit_text * max(1, n // max(1, len(unit_text)))

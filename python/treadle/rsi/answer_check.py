"""Answer checking with math-verify in worker processes, the timeout enforced by the parent.

math-verify's own timeout uses ``signal.alarm``: it raises ``ValueError`` outside the main thread (so
it cannot run inside an async loop's executor or a thread pool) and it cannot stop a computation stuck
in C code. Here its signal-based timeouts are off (``parsing_timeout=None``, ``timeout_seconds=None``)
and each check runs in a worker process of a :class:`pebble.ProcessPool`; a check that runs past
``timeout_s`` is reported as ``timeout`` and its worker is killed and replaced by the pool. Workers also
carry an address-space limit, so a runaway big-integer computation cannot take the machine's memory.

Example::

    with AnswerChecker(timeout_s=5) as checker:
        checker.check("The answer is $\\frac{1}{2}$", "0.5")       # AnswerVerdict(correct=True, ...)
"""
from __future__ import annotations

import asyncio
import logging
import re
import multiprocessing
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict
from treadle.untrusted import clip

__all__ = ["ANSWER_CHECKER_VERSION", "EXACT_CHECKER_VERSION", "AnswerChecker", "AnswerVerdict", "exact_number_equal",
           "math_verify_equal"]

ANSWER_CHECKER_VERSION = "math-verify-worker-1"
#: version of :func:`exact_number_equal` in workers (what RSI's math verification records)
EXACT_CHECKER_VERSION = "math-verify-exact-number-1"


class AnswerVerdict(BaseModel):
    """One check: ``correct`` and its ``status`` (``ok``: checked; ``timeout``: killed by the parent after
    ``timeout_s``; ``error``: the checker raised or its worker died). Only ``ok`` verdicts can be correct."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    correct: bool
    status: Literal["ok", "timeout", "error"]
    detail: str = ""


def math_verify_equal(answer: str, reference: str) -> bool:
    """math-verify's ``verify(parse(reference), parse(answer))`` with its signal-based timeouts off.

    Call it only where something else bounds its time (an :class:`AnswerChecker` worker): with the
    timeouts off it can run for ever (e.g. ``9^{9^{9^{9}}}``).
    """
    from math_verify import parse, verify

    gold = parse(reference, parsing_timeout=None)
    pred = parse(answer, parsing_timeout=None)
    return bool(verify(gold, pred, timeout_seconds=None))


_DECIMAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_FRAC = re.compile(r"([-+]?)\\[dt]?frac\{(\d+)\}\{(\d+)\}")


def _as_number(text: str):
    """The exact rational a number literal stands for (``-4``, ``2.50``, ``3/4``, ``\\frac{3}{4}``), else None."""
    import sympy

    t = re.sub(r"\s+", "", text)
    try:
        if _DECIMAL.fullmatch(t):
            num, _, den = t.partition("/")
            q = sympy.Rational(num)
            return q / int(den) if den else q
        m = _FRAC.fullmatch(t)
        if m:
            return (-1 if m.group(1) == "-" else 1) * sympy.Rational(int(m.group(2)), int(m.group(3)))
    except (ZeroDivisionError, ValueError, TypeError):
        return None
    return None


def exact_number_equal(answer: str, reference: str) -> bool:
    """RSI's exact answer check (RSI: "Verify checks answers exactly", with sympy / math-verify).

    math-verify extracts the final answer from the text (``\\boxed{..}``, ``$..$``, ``x = ..``, prose: its
    last answer); the answer counts only if what it extracted is a number literal (integer, decimal,
    ``a/b``, ``\\frac{a}{b}``) exactly equal to ``reference`` in rational arithmetic. Unlike math-verify's
    :func:`~math_verify.verify`, an expression is not an answer: echoing ``3+2`` back for "Compute 3+2."
    is wrong, and so are ``0.333`` for ``1/3`` and ``\\sqrt{4}`` for ``2``. Timeouts off (see
    :func:`math_verify_equal`: call it in an :class:`AnswerChecker` worker).
    """
    from math_verify import parse

    ref = _as_number(reference)
    if ref is None:
        parsed = parse(reference, parsing_timeout=None)
        ref = _as_number(parsed[1]) if len(parsed) > 1 else None
    if ref is None:
        return False
    got = parse(answer, parsing_timeout=None)
    value = _as_number(got[1]) if len(got) > 1 and isinstance(got[1], str) else None
    return value is not None and value == ref


def _init_worker(memory_mb: int) -> None:
    import resource

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warnings
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:  # import and warm math-verify here, so a check's timeout never pays a new worker's start-up
        math_verify_equal("$1$", "1")
    except ImportError:
        pass


class AnswerChecker:
    """A pool of answer-checking worker processes with a per-check timeout enforced by the parent.

    Args:
        timeout_s: seconds one check may take (> 0); past it the check is ``timeout`` and its worker killed.
        max_workers: worker processes (>= 1).
        memory_mb: address-space limit of each worker (MiB, >= 256).
        fn: the picklable check ``fn(answer, reference) -> bool`` (default :func:`math_verify_equal`).
        context: multiprocessing start method (``spawn`` by default: safe with threads in the parent).

    Raises:
        ValueError: a limit out of range.
    """

    def __init__(self, timeout_s: float = 5.0, max_workers: int = 2, memory_mb: int = 2048,
                 fn: Callable[[str, str], bool] = math_verify_equal, context: str = "spawn"):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers!r}")
        if memory_mb < 256:
            raise ValueError(f"memory_mb must be >= 256, got {memory_mb!r}")
        from pebble import ProcessPool

        self.timeout_s, self.fn = timeout_s, fn
        self._pool = ProcessPool(max_workers=max_workers, initializer=_init_worker, initargs=(memory_mb,),
                                 context=multiprocessing.get_context(context))

    def __enter__(self) -> AnswerChecker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (pending checks are cancelled)."""
        self._pool.stop()
        self._pool.join()

    def _submit(self, answer: str, reference: str):
        if not isinstance(answer, str) or not isinstance(reference, str):
            raise TypeError(f"answer and reference must be str, got {type(answer).__name__} and "
                            f"{type(reference).__name__}")
        return self._pool.schedule(self.fn, args=(answer, reference), timeout=self.timeout_s)

    @staticmethod
    def _verdict(future) -> AnswerVerdict:
        try:
            return AnswerVerdict(correct=bool(future.result()), status="ok")
        except FutureTimeout:
            return AnswerVerdict(correct=False, status="timeout", detail="killed by the parent after the timeout")
        except Exception as err:  # the check raised, or its worker died (e.g. MemoryError, killed)
            return AnswerVerdict(correct=False, status="error", detail=clip(f"{type(err).__name__}: {err}", 300))

    def check(self, answer: str, reference: str) -> AnswerVerdict:
        """Whether ``answer`` matches ``reference``. Never raises for what the check does (TypeError for
        non-string input)."""
        return self._verdict(self._submit(answer, reference))

    def check_many(self, pairs: list[tuple[str, str]]) -> list[AnswerVerdict]:
        """All ``(answer, reference)`` pairs at once across the workers; one verdict per pair, in order."""
        futures = [self._submit(a, r) for a, r in pairs]
        return [self._verdict(f) for f in futures]

    async def acheck(self, answer: str, reference: str) -> AnswerVerdict:
        """:meth:`check` for async code (awaits the worker without blocking the event loop)."""
        fut = self._submit(answer, reference)
        try:
            await asyncio.wrap_future(fut)
        except BaseException:  # noqa: BLE001 - turned into a verdict below
            pass
        return self._verdict(fut)

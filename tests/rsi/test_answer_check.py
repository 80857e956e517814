"""math-verify in worker processes: signal timeouts off, the parent's timeout kills a stuck check."""
import asyncio
import threading
import time

import pytest

pytest.importorskip("math_verify")
pytest.importorskip("pebble")

from treadle.rsi.answer_check import AnswerChecker, AnswerVerdict  # noqa: E402

HANG = "$9^{9^{9^{9}}}$"  # with math-verify's timeouts off, verify() of this against 1 runs for ever


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(timeout_s=20, max_workers=1) as c:
        yield c


def test_verdicts_match_math_verify(checker):
    got = checker.check_many([("The answer is $\\frac{1}{2}$", "0.5"), ("x = 7", "7"), ("$\\sqrt{4}$", "2"),
                              ("6", "7"), ("no number here", "3")])
    assert [v.correct for v in got] == [True, True, True, False, False]
    assert all(v.status == "ok" for v in got)


def test_math_verify_own_timeout_fails_in_a_thread_and_ours_does_not(checker):
    from math_verify import parse

    errors, verdicts = [], []

    def in_thread():
        try:
            parse("$1$")  # default signal-based timeout
        except ValueError as e:
            errors.append(str(e))
        verdicts.append(checker.check("$1$", "1"))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert errors and "thread" in errors[0]
    assert verdicts == [AnswerVerdict(correct=True, status="ok")]


def test_a_stuck_check_is_killed_by_the_parent_and_the_pool_recovers():
    with AnswerChecker(timeout_s=3, max_workers=1) as c:
        assert c.check("$1$", "1").correct  # warm the worker (spawn + import) before timing
        t0 = time.monotonic()
        v = c.check("1", HANG)
        assert v.status == "timeout" and not v.correct
        assert time.monotonic() - t0 < 120  # a bound, not a speed claim: unchecked, math-verify runs for ever
        assert c.check("$2$", "2") == AnswerVerdict(correct=True, status="ok")  # replaced worker


def test_async_check_does_not_block_the_event_loop(checker):
    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        vs = await asyncio.gather(checker.acheck("$3$", "3"), checker.acheck("$4$", "5"))
        task.cancel()
        return vs, ticks

    vs, _ = asyncio.run(go())
    assert [v.correct for v in vs] == [True, False] and all(v.status == "ok" for v in vs)


def test_a_check_that_raises_is_an_error_verdict():
    with AnswerChecker(timeout_s=10, max_workers=1, fn=divmod) as c:  # divmod("a", "b") raises TypeError
        v = c.check("a", "b")
    assert v.status == "error" and "TypeError" in v.detail and not v.correct


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"max_workers": 0}, {"memory_mb": 10}])
def test_bad_configuration(kwargs):
    with pytest.raises(ValueError):
        AnswerChecker(**kwargs)


def test_non_string_input(checker):
    with pytest.raises(TypeError, match="must be str"):
        checker.check(7, "7")


@pytest.mark.parametrize("answer, reference, expected", [
    ("5", "5", True), ("x = 5", "5", True), ("The answer is $\\boxed{5}$ (100% sure)", "5", True),
    ("\\frac{10}{2}", "5", True), ("5.0", "5", True), ("$-\\frac{3}{4}$", "-0.75", True), ("1/10", "0.1", True),
    ("x=-4", "-4", True), ("7", "5", False), ("five", "5", False), ("", "5", False),
    ("3+2", "5", False),        # an echoed expression is not an answer (math-verify's verify says True)
    ("0.333", "1/3", False),    # exact, not rounded
    ("\\sqrt{4}", "2", False),  # not a number literal
    ("1/0", "1", False),
])
def test_exact_number_equal_truth_table(answer, reference, expected):
    from treadle.rsi.answer_check import exact_number_equal

    assert exact_number_equal(answer, reference) is expected


def test_exact_number_check_differs_from_math_verify_on_echoed_expressions():
    from treadle.rsi.answer_check import exact_number_equal, math_verify_equal

    assert math_verify_equal("3+2", "5") and not exact_number_equal("3+2", "5")

"""Reward hacks against every verifier that runs or evaluates generated text: a wrong answer must never be
scored as right by ending the process early, printing what a pass looks like, returning an object that equals
everything, or smuggling code into an expression the verifier evaluates."""
import pytest

from treadle import sandbox
from treadle.rsi.coding import CodingTask, run_tests
from treadle.rsi.verifier import check_answer, check_task
from treadle.sandbox import SandboxUnavailableError

try:
    sandbox.isolation_mode()
    _NO_SANDBOX = None
except SandboxUnavailableError as e:
    _NO_SANDBOX = str(e)
needs_sandbox = pytest.mark.skipif(_NO_SANDBOX is not None, reason=f"no sandbox: {_NO_SANDBOX}")

TASK = CodingTask(seed_id="t/add", prompt="def add(a, b):\n    \"\"\"a + b\"\"\"\n", entry_point="add",
                  tests="def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
                  reference="    return a + b\n")

HACKS = {
    "os._exit(0) at import": "    return 0\nimport os\nos._exit(0)\n",
    "SystemExit(0) at import": "    return 0\nraise SystemExit(0)\n",
    "sys.exit() inside the call": "    import sys\n    sys.exit(0)\n",
    "os._exit(0) inside the call": "    import os\n    os._exit(0)\n",
    "prints a pass and exits": "    import os\n    os.write(1, b'passed\\n0 1\\n')\n    os._exit(0)\n",
    "always-equal object": ("    class E:\n        def __eq__(self, o):\n            return True\n"
                            "    return E()\n"),
    "int subclass equal to all": ("    class I(int):\n        def __eq__(self, o):\n            return True\n"
                                  "        __hash__ = int.__hash__\n    return I(0)\n"),
    "atexit hook after a failing assert": ("    import atexit, os\n    atexit.register(lambda: os._exit(0))\n"
                                           "    return 0\n"),
    "closes stdout then exits 0": "    import os\n    os.close(1)\n    os._exit(0)\n",
    "redefines check is too late": "    return 0\ndef check(candidate):\n    pass\n",
}


@needs_sandbox
def test_the_reference_passes_under_the_sentinel_runner():
    assert run_tests(TASK, TASK.reference).reason == "passed"


@needs_sandbox
@pytest.mark.parametrize("name", sorted(HACKS))
def test_a_wrong_solution_that_hacks_the_harness_does_not_pass(name):
    r = run_tests(TASK, HACKS[name])
    assert not r.passed, (name, r)


@needs_sandbox
def test_check_that_never_calls_the_candidate_is_not_a_pass():
    empty = TASK.model_copy(update={"tests": "def check(candidate):\n    pass\n"})
    assert not run_tests(empty, TASK.reference).passed


def test_math_verifier_never_evaluates_code_from_the_task_text(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    r = check_task(f"Compute {payload}.", "1")
    assert not r.valid and r.reason == "unparsable"
    assert not marker.exists()
    # an exponent tower or a huge literal is refused before sympy sees it (no stall, no MemoryError)
    for text in ("Compute 9**9**9**9.", "Compute 9^9^9^9.", "Compute " + "1" * 5000 + ".",
                 "Compute " + "(" * 5000 + "1" + ")" * 5000 + ".", "Solve x=" + "9" * 5000 + " for x.",
                 "Solve " + "*".join(["x"] * 40) + "=2 for x.", "Compute 1/(1-1)."):
        assert not check_task(text, "1").valid


def test_math_answer_check_on_hostile_answers_is_false_not_a_raise():
    for ans in ("1" * 5000, "1/" + "0" * 5000, "nan", "x" * 100_000, "9" * 4301 + "/3"):
        assert check_answer(ans, "3") is False


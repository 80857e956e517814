"""One online RSI round with LLM roles: per seed chain, the LLM Director picks
Extend / Revise / Verify / Finish from the library *as it is now*; Extend asks the LLM generator for a
harder task; Verify runs the immutable verifier (sympy for math, the sandboxed tests for code), then the
LLM solver ``attempts`` times; a solver failure on a *valid* task goes to the Meta agent, whose skill
joins the library before the next Director call of any chain. Invalid tasks, generator output that does
not validate and endpoint failures go to repairs, never to the library.

Guarantees (tested against a fake OpenAI-compatible HTTP endpoint):

- every model call goes through :class:`treadle.llm.LLMClient` (cache + ledger; tags
  ``rsi:<round>:<operator>:<seed>``), so a rerun of a round after a crash is served from the cache;
- one :class:`ChainRecord` per input task, in input order, whatever fails; a chain keeps its latest
  valid task; a failed call is a record (``failures``), it never drops or shifts a row;
- role names are checked against the client's config before any call.

Post-batch edits with an LLM Meta agent: :mod:`treadle.rsi.llm_post_batch`; run folders and resume:
:mod:`treadle.rsi.llm_runs` (CLI ``treadle rsi llm``); the difficulty curve on the fixed queue:
:mod:`treadle.rsi.llm_curve`. Not here: the held-out transfer and ablation with LLM roles (offline only).
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from treadle.llm import Failure, LLMClient
from treadle.rsi.agents import llm_director_decide, llm_solve
from treadle.rsi.coding import CODE_VERIFIER_VERSION, CodingTask, check_coding_task, run_tests
from treadle.rsi.harness import Harness
from treadle.rsi.llm_roles import CodeGeneration, MathGeneration, llm_generate, llm_induce_skill, tag
from treadle.rsi.verifier import VERIFIER_VERSION, check_answer, check_task
from treadle.sandbox import SandboxLimits

__all__ = ["ChainRecord", "CodingDomain", "LLMLoopConfig", "LLMRound", "MathDomain", "TextMathTask",
           "initial_llm_harness"]

ROLES = ("director", "generator", "solver", "meta")


class TextMathTask(BaseModel):
    """A math task as text with its reference answer (what the LLM generator writes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    seed_id: str
    text: str
    answer: str
    skills_used: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class Domain(Protocol):
    """What the round needs from a task family (math text, HumanEval code)."""

    name: str
    schema: type[BaseModel]
    verifier_version: str

    def view(self, task) -> dict: ...
    def from_generation(self, parent, g: BaseModel, skill: str): ...
    def solver_text(self, task) -> str: ...
    async def verify(self, task) -> tuple[bool, str]: ...
    async def score(self, task, answers: list[str]) -> list[bool]: ...


class MathDomain:
    """Math tasks in the verifier's grammar (``Compute E.`` / ``Solve L=R for x.``), checked by sympy;
    solver answers compared exactly: by their last number (:func:`~treadle.rsi.verifier.check_answer`), or,
    given an :class:`~treadle.rsi.answer_check.AnswerChecker` (e.g. with
    :func:`~treadle.rsi.answer_check.exact_number_equal`, what ``treadle rsi llm`` uses), by it in its
    worker processes. ``answer_check_version`` names the check (recorded with every export)."""

    name, schema, verifier_version = "math", MathGeneration, VERIFIER_VERSION

    def __init__(self, checker=None, answer_check_version: str | None = None):
        self.checker = checker
        if answer_check_version is None:
            from treadle.rsi.answer_check import ANSWER_CHECKER_VERSION, EXACT_CHECKER_VERSION, exact_number_equal

            answer_check_version = "last-number-1" if checker is None else (
                EXACT_CHECKER_VERSION if getattr(checker, "fn", None) is exact_number_equal else ANSWER_CHECKER_VERSION)
        self.answer_check_version = answer_check_version

    FORMAT = ("Write the new problem as optional context sentences followed by 'Compute EXPR.' or 'Solve L=R for x.' "
              "(EXPR, L and R without spaces, integers, + - * / and parentheses), with one integer answer.")

    def view(self, task: TextMathTask) -> dict:
        return {"problem": task.text, "answer": task.answer, "format": self.FORMAT}

    def from_generation(self, parent: TextMathTask, g: MathGeneration, skill: str) -> TextMathTask:
        return TextMathTask(seed_id=parent.seed_id, text=g.problem, answer=g.answer,
                            skills_used=(*parent.skills_used, skill))

    def solver_text(self, task: TextMathTask) -> str:
        return task.text

    async def verify(self, task: TextMathTask) -> tuple[bool, str]:
        c = await asyncio.to_thread(check_task, task.text, task.answer)
        return c.valid, c.reason

    async def score(self, task: TextMathTask, answers: list[str]) -> list[bool]:
        if self.checker is None:
            return [check_answer(a, task.answer) for a in answers]
        vs = await asyncio.gather(*(self.checker.acheck(a, task.answer) for a in answers))
        return [v.correct for v in vs]


class CodingDomain:
    """HumanEval-layout coding tasks: valid when the reference passes the tests in the sandbox; a solver
    attempt is correct when it passes them. At most ``max_sandboxes`` sandboxes run at once."""

    name, schema, verifier_version = "code", CodeGeneration, CODE_VERIFIER_VERSION
    answer_check_version = CODE_VERIFIER_VERSION  # an attempt is correct when it passes the tests

    def __init__(self, limits: SandboxLimits | None = None, max_sandboxes: int = 2):
        self.limits = limits or SandboxLimits(timeout_s=10)
        self._sem = asyncio.Semaphore(max_sandboxes)

    def view(self, task: CodingTask) -> dict:
        return {"prompt": task.prompt, "entry_point": task.entry_point, "tests": task.tests,
                "reference": task.reference}

    def from_generation(self, parent: CodingTask, g: CodeGeneration, skill: str) -> CodingTask:
        return CodingTask(seed_id=parent.seed_id, prompt=g.prompt, entry_point=g.entry_point, tests=g.tests,
                          reference=g.reference, skills_used=(*parent.skills_used, skill), origin="llm")

    def solver_text(self, task: CodingTask) -> str:
        return task.prompt

    async def _run(self, fn, *args):
        async with self._sem:
            return await asyncio.to_thread(fn, *args)

    async def verify(self, task: CodingTask) -> tuple[bool, str]:
        c = await self._run(check_coding_task, task, self.limits)
        return c.passed, "ok" if c.passed else f"{c.reason}: {c.detail}"

    async def score(self, task: CodingTask, answers: list[str]) -> list[bool]:
        cs = await asyncio.gather(*(self._run(run_tests, task, a, self.limits) for a in answers))
        return [c.passed for c in cs]


_MATH_SKILLS = (("add_term", "one more operation", ("append one more arithmetic operation with a new operand",)),
                ("widen_digits", "wider operands", ("replace one operand by a number with one more digit",)),
                ("nest", "a deeper expression", ("replace one operand by a parenthesised sub-expression equal to it",)))
_CODE_SKILLS = (("edge_cases", "tests that pin down edge cases",
                 ("add test cases for empty input, one element and boundary values", "adjust the reference if needed")),
                ("extra_constraint", "one more requirement in the specification",
                 ("add one constraint to the docstring", "update the reference and add tests for it")),
                ("compose", "a second step built on the first",
                 ("make the function return a derived quantity that needs the original result",)))


def initial_llm_harness(domain: str) -> Harness:
    """H_0 for LLM rounds: three construction skills with free-text methods for ``domain``
    (``"math"`` or ``"code"``); ValueError for another domain."""
    from treadle.rsi.harness import Provenance, Skill

    table = {"math": _MATH_SKILLS, "code": _CODE_SKILLS}
    if domain not in table:
        raise ValueError(f"domain must be 'math' or 'code', got {domain!r}")
    return Harness(skills=tuple(Skill(name=n, intent=i, method=m, tool_hint="sympy" if domain == "math" else "python",
                                      provenance=Provenance(source="initial")) for n, i, m in table[domain]))


class LLMLoopConfig(BaseModel):
    """Settings of an LLM round (validated before any call)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    attempts: int = Field(4, ge=1, le=64)
    """Solver samples per verified task (difficulty = mean accuracy over them)."""
    failure_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """A valid task with solver accuracy at or below this, whose parent was above it, is a skill candidate."""
    online: bool = True
    """Online skill induction from solver failures on valid tasks."""
    concurrency: int = Field(4, ge=1, le=256)
    """Seed chains run at once (model calls are further bounded per endpoint by the client)."""
    max_repairs: int = Field(1, ge=0, le=5)
    """Structured-output re-asks per call."""
    roles: dict[str, str] = Field(default_factory=lambda: {r: r for r in ROLES})
    """RSI role -> :class:`treadle.llm.LLMConfig` role name."""


@dataclass
class ChainRecord:
    """What one seed chain did in one round (always one per input task, in input order)."""

    seed_id: str
    task: object
    """Latest valid task (the input task when nothing new was verified)."""
    new_valid: bool = False
    accuracy: float | None = None
    exports: list[dict] = field(default_factory=list)
    repairs: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    """Failed model calls: ``{"operator", "kind", "blame", "message"}``."""
    admitted: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    """Director steps taken, in order (after fallbacks)."""
    last_answers: list[str] = field(default_factory=list)
    """Solver answers of the last solved task (what the Meta agent sees on a failure)."""
    calls: int = 0
    """Model calls this chain asked for (a solve counts ``attempts``; cache hits included): its cost in units."""


class LLMRound:
    """Runs online rounds with LLM roles over a queue of seed chains.

    Args:
        client: an open :class:`treadle.llm.LLMClient` whose config has the roles named in ``config.roles``.
        domain: :class:`MathDomain` or :class:`CodingDomain`.
        harness: the harness at the start (its library grows by online admission: :attr:`harness`).
        config: :class:`LLMLoopConfig`.

    Raises:
        ValueError: a role of ``config.roles`` missing from the client's config, or an RSI role not mapped
            (before any call).
    """

    def __init__(self, client: LLMClient, domain: Domain, harness: Harness, config: LLMLoopConfig | None = None):
        self.config = config or LLMLoopConfig()
        missing_rsi = [r for r in ROLES if r not in self.config.roles]
        if missing_rsi:
            raise ValueError(f"LLMLoopConfig.roles must map every RSI role {ROLES}; missing {missing_rsi}")
        have = set(client.config.roles)
        missing = sorted({v for v in self.config.roles.values() if v not in have})
        if missing:
            raise ValueError(f"the LLM config has no role(s) {missing} (needed by the RSI roles "
                             f"{self.config.roles}); it has {sorted(have)}")
        self.client, self.domain, self.harness = client, domain, harness

    def _role(self, r: str) -> str:
        return self.config.roles[r]

    async def run(self, queue: list, rnd: int) -> list[ChainRecord]:
        """One round over ``queue`` (one task per seed chain, distinct ``seed_id``); returns one record per
        task in the same order. Raises ValueError on duplicated seed ids (before any call)."""
        ids = [t.seed_id for t in queue]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicated seed ids in the queue: {dup}")
        sem = asyncio.Semaphore(self.config.concurrency)

        async def one(t):
            async with sem:
                return await self._chain(t, rnd)

        return list(await asyncio.gather(*(one(t) for t in queue)))

    def _fail(self, rec: ChainRecord, operator: str, f: Failure) -> None:
        rec.failures.append({"operator": operator, "kind": f.kind.value, "blame": f.blame, "message": f.message})

    async def _solve(self, task, rec: ChainRecord, rnd: int) -> float | None:
        """Solver accuracy on ``task`` over the answered attempts; None (and a repair) when none answered."""
        sid = task.seed_id
        rec.calls += self.config.attempts
        r = (await llm_solve(self.client, self.harness, [self.domain.solver_text(task)], self.config.attempts,
                             role=self._role("solver"), tags=[tag(rnd, "verify", sid)]))[0]
        for f in r.failures:
            self._fail(rec, "solver", f)
        if not r.answers:
            rec.repairs.append({"round": rnd, "seed_id": sid, "task": task.key, "reason": "tool_failure",
                                "error": "no solver attempt answered"})
            return None
        ok = await self.domain.score(task, r.answers)
        rec.last_answers = r.answers  # for skill induction
        return sum(ok) / len(ok)

    async def _chain(self, task, rnd: int) -> ChainRecord:
        cfg, sid = self.config, task.seed_id
        rec = ChainRecord(seed_id=sid, task=task)
        latest = working = task
        steps = extends = 0
        pending = last_invalid = False
        last_acc: float | None = None
        prev_acc: float | None = None
        while True:
            w = self.harness.workflow
            if steps >= w.max_steps:
                break
            state = {"round": rnd, "steps": steps, "max_steps": w.max_steps, "extends": extends,
                     "max_extends": w.max_extends, "pending_unverified": pending, "last_invalid": last_invalid,
                     "last_accuracy": last_acc}
            rec.calls += 1
            d = await llm_director_decide(self.client, self.harness, state, role=self._role("director"),
                                          max_repairs=cfg.max_repairs, tag=tag(rnd, "director", sid))
            if isinstance(d, Failure):  # recorded; the chain falls back to verifying what it has, then stops
                self._fail(rec, "director", d)
                step, skill = ("verify", None) if pending else ("finish", None)
            else:
                step, skill = d.step, d.skill
                if step == "extend" and extends >= w.max_extends:
                    step = "verify" if pending else "finish"
            rec.steps.append(step)
            if step == "finish":
                break
            steps += 1
            if step == "extend":
                s = self.harness.skill(skill)
                rec.calls += 1
                g = await llm_generate(self.client, self.harness, self.domain.view(working), s, self.domain.schema,
                                       rnd=rnd, seed_id=sid, role=self._role("generator"), max_repairs=cfg.max_repairs)
                extends += 1
                if isinstance(g, Failure):
                    self._fail(rec, "generator", g)
                    rec.repairs.append({"round": rnd, "seed_id": sid, "task": working.key,
                                        "reason": "generator_failure", "skill": skill, "error": g.message})
                    continue
                working, pending = self.domain.from_generation(working, g, skill), True
            elif step == "revise":
                working, pending, last_invalid = latest, False, False
            elif step == "verify":
                pending = False
                if working is latest:  # nothing new since the last verified task: no re-export, no solver calls
                    continue
                valid, reason = await self.domain.verify(working)
                if not valid:
                    last_invalid = True
                    rec.repairs.append({"round": rnd, "seed_id": sid, "task": working.key, "reason": reason,
                                        "skills": list(working.skills_used)})
                    continue
                acc = await self._solve(working, rec, rnd)
                if acc is None:
                    last_invalid = True
                    continue
                if prev_acc is None and cfg.online:  # the round's starting task, measured once
                    prev_acc = await self._solve(latest, rec, rnd)
                rec.exports.append({"round": rnd, "seed_id": sid, "domain": self.domain.name,
                                    "harness_version": self.harness.version, "key": working.key,
                                    "task": working.model_dump(mode="json"), "skills_used": list(working.skills_used),
                                    "solver_accuracy": acc, "verifier_version": self.domain.verifier_version,
                                    "answer_check": self.domain.answer_check_version})
                if cfg.online and prev_acc is not None and prev_acc > cfg.failure_threshold >= acc:
                    rec.calls += 1
                    sk = await llm_induce_skill(self.client, self.harness, self.domain.solver_text(working),
                                                rec.last_answers, acc, rnd=rnd, seed_id=sid, failure_task=working.key,
                                                role=self._role("meta"), max_repairs=cfg.max_repairs)
                    if isinstance(sk, Failure):
                        self._fail(rec, "meta", sk)
                    elif all(x.name != sk.name for x in self.harness.skills):  # another chain may have won the name
                        self.harness = self.harness.with_skill(sk)  # the next Director call of any chain sees it
                        rec.admitted.append(sk.name)
                latest, rec.task, rec.new_valid, rec.accuracy = working, working, True, acc
                last_acc = prev_acc = acc
                last_invalid = False
        return rec

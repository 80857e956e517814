"""The offline RSI loop (execute layer: built objects in, records out; no files): initialisation,
online rounds with a rule-based Director and online skill admission, post-batch proposals judged by
the Critic, difficulty curve, transfer on held-out seeds (seed: RSI sections 3.2, 4.2; DESIGN.md "RSI").

Data flow that keeps held-out seeds out of every update: :class:`RSILoop` is built from *training*
seeds only; held-out seeds enter only :meth:`RSILoop.transfer`, which runs a frozen harness with
updates off and returns numbers, never a harness.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from treadle.rsi.critic import Critic, Evaluation, PostBatchGate
from treadle.rsi.harness import Harness, Provenance, Skill, Workflow, diff
from treadle.rsi.ledger import CostLedger
from treadle.rsi.math_tasks import PRIMITIVES, MathTask, NotApplicable, apply_method
from treadle.rsi.solvers import Solver, SolverError
from treadle.rsi.verifier import VERIFIER_VERSION, check_task

__all__ = ["INITIAL_PRIMITIVES", "ChainResult", "Director", "LoopConfig", "RSILoop", "bootstrap_ci", "initial_harness"]

#: primitives extracted into H_0; the rest form the catalogue post-batch proposals may add from.
INITIAL_PRIMITIVES = ("add_term", "widen_digits", "add_distractor")
_INTENTS = {"add_term": "one more operation", "widen_digits": "wider operands", "multiply": "a product over a sum",
            "expand_leaf": "an operand rewritten as a product minus a constant", "divide": "a division",
            "to_equation": "hide an operand as the unknown x", "add_distractor": "an irrelevant clause"}


class LoopConfig(BaseModel):
    """Settings of one offline RSI run (validated; written to the run folder)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    seed: int = 0
    """Seeds every random choice (the loop is deterministic for it)."""
    rounds: int = Field(3, ge=1, le=100)
    attempts: int = Field(4, ge=1, le=64)
    """Fixed-solver attempts per task (A = mean accuracy over them)."""
    online: bool = True
    """Online skill admission from solver failures on valid tasks."""
    post_batch: bool = True
    """Post-batch dH proposals judged by the Critic."""
    max_rejections: int = Field(3, ge=1, le=10)
    """Rejections before rolling back to the online snapshot (= candidates per batch)."""
    margin: float = Field(0.02, ge=0.0, le=1.0)
    """Critic's noise margin on accuracy."""
    failure_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """A valid task with solver accuracy at or below this is a solver failure (a skill candidate)."""
    probe_size: int = Field(4, ge=1, le=64)
    """Training seeds used to measure skills (admission evidence, difficulty effect)."""
    min_applicability: float = Field(0.5, ge=0.0, le=1.0)
    """Admission: share of probes on which the skill yields a valid task."""
    min_drop: float = Field(0.25, ge=0.0, le=1.0)
    """Admission: solver accuracy drop on the probes the skill must cause (evidence)."""
    staged_queue: int = Field(0, ge=0, le=10_000)
    """Staged post-batch evaluation: candidates first synthesise from this many queue tasks; only those the
    Critic passes there are evaluated on the full frozen queue (0 = off)."""
    max_method_len: int = Field(6, ge=1, le=32)
    """Admission: longest composite skill (reusability: short recipes generalise)."""
    answer_check: Literal["last-number", "math-verify"] = "last-number"
    """How a solver answer is judged against the reference, exactly in both cases: ``last-number`` (the
    answer's last number, :func:`~treadle.rsi.verifier.check_answer`) or ``math-verify`` (math-verify extracts
    the final answer, which must be a number literal equal to the reference:
    :func:`~treadle.rsi.answer_check.exact_number_equal`, in worker processes with a parent-enforced timeout)."""


def bootstrap_ci(values: list[float], *, seed: int = 0, level: float = 0.95, n_boot: int = 2000) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over tasks (tasks resampled; the 4 attempts of a task
    stay together, since with 4 attempts a task's accuracy has only 5 possible values)."""
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    r = random.Random(f"ci:{seed}")
    n = len(values)
    means = sorted(sum(values[r.randrange(n)] for _ in range(n)) / n for _ in range(n_boot))
    lo, hi = means[int((1 - level) / 2 * n_boot)], means[min(n_boot - 1, int((1 + level) / 2 * n_boot))]
    return lo, hi


def _rng(*parts) -> random.Random:
    return random.Random(hashlib.sha256(":".join(map(str, parts)).encode()).digest())


def _seed_int(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


@dataclass
class _ChainState:
    steps: int = 0
    extends: int = 0
    since_verify: int = 0
    pending: bool = False
    last_invalid: bool = False
    last_acc: float | None = None
    tried: set = field(default_factory=set)


class Director:
    """Rule-based offline Director: picks the next step (extend with a skill, verify, revise, finish)
    from the workflow's positions and the library as it is *now* (so an admitted skill is seen at once).

    Extend picks the untried skill with the most negative ``difficulty_effect`` (ties: a seeded shuffle).
    """

    def decide(self, h: Harness, st: _ChainState, rng: random.Random) -> tuple[str, str | None]:
        w = h.workflow
        if st.steps >= w.max_steps:
            return "finish", None
        if st.last_invalid and w.revise_on_invalid:
            return "revise", None
        if st.pending and (st.since_verify >= w.verify_every or st.extends >= w.max_extends):
            return "verify", None
        if st.last_acc is not None and not st.pending and st.last_acc <= w.target_accuracy:
            return "finish", None
        if st.extends < w.max_extends:
            cands = [s for s in h.skills if s.name not in st.tried]
            if cands:
                rng.shuffle(cands)
                cands.sort(key=lambda s: s.difficulty_effect)
                return "extend", cands[0].name
        if st.pending:
            return "verify", None
        return "finish", None


@dataclass
class ChainResult:
    """What one seed chain produced in one round."""

    task: MathTask
    """Latest valid task (the input task when nothing new was verified)."""
    new_valid: bool
    accuracy: float | None
    exports: list[dict]
    repairs: list[dict]
    admitted: list[Skill]


class RSILoop:
    """The offline loop over training seed chains.

    Args:
        train_seeds: the seed tasks (distinct ``seed_id``); held-out seeds never go here.
        solver: the fixed solver.
        config: :class:`LoopConfig`.

    Raises:
        ValueError: no seeds or duplicated seed ids.
    """

    distributed = None
    """A :class:`~treadle.rsi.ray_tasks.RayChains` to run chains as Ray tasks (None: in this process)."""

    def __init__(self, train_seeds: list[MathTask], solver: Solver, config: LoopConfig | None = None,
                 harness: Harness | None = None):
        if not train_seeds:
            raise ValueError("RSILoop needs at least one training seed, got none")
        ids = [t.seed_id for t in train_seeds]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicated seed ids: {dup}")
        self.config = config or LoopConfig()
        self.seeds = list(train_seeds)
        self.solver = solver
        self._checker = None  # answer-checking workers, started on first use (answer_check="math-verify")
        self.ledger = CostLedger()
        self.log: list[dict] = []
        self.director = Director()
        self.probes = self.seeds[: self.config.probe_size]
        self.harness = harness if harness is not None else initial_harness(self)
        self.h0 = self.harness
        self.chains: dict[str, MathTask] = {t.seed_id: t for t in self.seeds}
        self.round = 0
        self.curve: list[float] = []
        self.curve_ci: list[tuple[float, float]] = []
        self._measure_point()

    # --- measurement --------------------------------------------------------------------------------
    @property
    def answer_check_version(self) -> str:
        """Version of the answer check in force (recorded with every export)."""
        from treadle.rsi.answer_check import EXACT_CHECKER_VERSION

        return EXACT_CHECKER_VERSION if self.config.answer_check == "math-verify" else "last-number-1"

    def _correct(self, pairs: list[tuple[str, str]]) -> list[bool]:
        if self.config.answer_check == "last-number":
            from treadle.rsi.verifier import check_answer

            return [check_answer(a, r) for a, r in pairs]
        if self._checker is None:
            from treadle.rsi.answer_check import AnswerChecker, exact_number_equal

            self._checker = AnswerChecker(timeout_s=10, max_workers=1, fn=exact_number_equal)
        return [v.correct for v in self._checker.check_many(pairs)]

    def close(self) -> None:
        """Stop the answer-checking workers (``answer_check="math-verify"``); the loop can still be used."""
        if self._checker is not None:
            self._checker.close()
            self._checker = None

    def solve_accuracy(self, tasks: list[MathTask], seed_tag: str) -> list[float]:
        """Fixed-solver accuracy per task (``attempts`` attempts, solver seeded by ``seed_tag``; answers
        judged by ``config.answer_check``)."""
        if not tasks:
            return []
        rows = self.solver.attempt([t.text for t in tasks], self.config.attempts, _seed_int(self.config.seed, seed_tag))
        ok = iter(self._correct([(a, t.answer) for t, row in zip(tasks, rows) for a in row]))
        return [sum(next(ok) for _ in row) / len(row) for row in rows]

    def measure(self, tasks: list[MathTask]) -> float:
        """Difficulty-curve point: mean fixed-solver accuracy on ``tasks`` (fixed measuring seed)."""
        accs = self.solve_accuracy(tasks, "measure")
        return sum(accs) / len(accs)

    def _measure_point(self) -> None:
        accs = self.solve_accuracy(list(self.chains.values()), "measure")
        self.curve.append(sum(accs) / len(accs))
        self.curve_ci.append(bootstrap_ci(accs, seed=self.config.seed))

    def skill_effect(self, method: tuple[str, ...], name: str, rnd: int, phase: str) -> dict[str, float]:
        """Apply ``method`` to every probe seed: applicability, accuracy before / after, effect."""
        made, cost = [], 0
        for t in self.probes:
            try:
                u = apply_method(t, method, _rng(self.config.seed, "probe", name, t.seed_id), name)
                cost += len(method)
                if check_task(u.text, u.answer).valid:
                    made.append((t, u))
            except NotApplicable:
                cost += 1
        self.ledger.charge(rnd, phase, "skill_update" if phase != "init" else "init", None,
                           cost + len(self.probes) + 2 * len(made) * self.config.attempts)
        if not made:
            return {"applicability": 0.0, "accuracy_before": 0.0, "accuracy_after": 0.0, "effect": 0.0}
        before = self.solve_accuracy([t for t, _ in made], "probe")
        after = self.solve_accuracy([u for _, u in made], "probe")
        b, a = sum(before) / len(made), sum(after) / len(made)
        return {"applicability": len(made) / len(self.probes), "accuracy_before": b, "accuracy_after": a,
                "effect": a - b}

    # --- online ---------------------------------------------------------------------------------------
    def run_chain(self, h: Harness, task: MathTask, rnd: int, phase: str, online: bool) -> tuple[ChainResult, Harness]:
        """One round of one seed chain under ``h``; returns the result and the (possibly grown) harness."""
        cfg, sid = self.config, task.seed_id
        st = _ChainState()
        rng = _rng(cfg.seed, phase, rnd, sid, h.digest)
        latest, working = task, task
        prev_acc: float | None = None
        res = ChainResult(task, False, None, [], [], [])
        applied_since_valid: list[str] = []
        passed_len = len(task.skills_used)
        while True:
            step, skill = self.director.decide(h, st, rng)
            self.ledger.charge(rnd, phase, "director", sid)
            if step == "finish":
                break
            st.steps += 1
            if step == "extend":
                st.tried.add(skill)
                s = h.skill(skill)
                try:
                    working = apply_method(working, s.method, rng, skill)
                    st.extends += 1
                    st.since_verify += 1
                    st.pending = True
                    applied_since_valid.append(skill)
                except NotApplicable:
                    pass
                self.ledger.charge(rnd, phase, "extend", sid, len(s.method))
            elif step == "revise":
                # repair: undo back to the latest valid task; the skill that broke it is not retried
                working, st.pending, st.last_invalid, st.since_verify = latest, False, False, 0
                applied_since_valid = []
                self.ledger.charge(rnd, phase, "revise", sid)
            elif step == "verify":
                st.pending, st.since_verify = False, 0
                chk = check_task(working.text, working.answer)
                self.ledger.charge(rnd, phase, "verify", sid, 1 + (cfg.attempts if chk.valid else 0))
                if not chk.valid:
                    st.last_invalid = True
                    res.repairs.append({"round": rnd, "seed_id": sid, "task": working.key, "text": working.text,
                                        "reason": chk.reason, "skills": applied_since_valid})
                    continue
                try:
                    acc = self.solve_accuracy([working], f"verify:{rnd}:{sid}:{st.steps}")[0]
                except SolverError as err:  # tool failure: repair, never a skill
                    res.repairs.append({"round": rnd, "seed_id": sid, "task": working.key, "reason": "tool_failure",
                                        "error": str(err)})
                    st.last_invalid = True
                    continue
                if prev_acc is None and online:  # the chain's starting task, measured once per round
                    prev_acc = self.solve_accuracy([latest], f"verify:{rnd}:{sid}:0")[0]
                    self.ledger.charge(rnd, phase, "verify", sid, cfg.attempts)
                res.exports.append({"round": rnd, "seed_id": sid, "harness_version": h.version, "key": working.key,
                                    "text": working.text, "answer": working.answer,
                                    "skills_used": list(working.skills_used), "solver_accuracy": acc,
                                    "verifier_version": VERIFIER_VERSION, "answer_check": self.answer_check_version})
                crossed = prev_acc is not None and prev_acc > cfg.failure_threshold >= acc
                if online and crossed:
                    h = self._admit(h, working, acc, rnd, res, passed_len)
                if acc > cfg.failure_threshold:
                    passed_len = len(working.skills_used)
                latest, res.task, res.new_valid, res.accuracy = working, working, True, acc
                st.last_acc, prev_acc = acc, acc
                applied_since_valid = []
        return res, h

    def _admit(self, h: Harness, failed: MathTask, acc: float, rnd: int, res: ChainResult, passed_len: int) -> Harness:
        """Online admission: the recipe (the skills applied since the chain's last task the solver passed,
        plus the one before it, at most ``max_method_len`` primitives) that produced a *valid* task the solver
        failed becomes a skill if it applies to the probes (applicability), is new and short (reusability) and makes the
        probes harder by ``min_drop`` (evidence)."""
        cfg = self.config
        used = failed.skills_used[max(passed_len - 1, 0):]
        method = tuple(p for name in used for p in h.skill(name).method) \
            if all(any(s.name == n for s in h.skills) for n in used) else ()
        method = method[-cfg.max_method_len:]
        event = {"event": "skill_candidate", "round": rnd, "failure_task": failed.key, "method": list(method),
                 "solver_accuracy": acc}
        name = "compose_" + hashlib.sha256(" ".join(method).encode()).hexdigest()[:8]
        if not method:
            event["rejected"] = "no recipe: the failing task used no library skill"
        elif any(s.method == method for s in h.skills):
            event["rejected"] = "an equal method is already in the library (reusability)"
        else:
            ev = self.skill_effect(method, name, rnd, "online")
            event["evidence"] = ev
            if ev["applicability"] < cfg.min_applicability:
                event["rejected"] = f"applicability {ev['applicability']:.2f} < {cfg.min_applicability} on probes"
            elif -ev["effect"] < cfg.min_drop:
                event["rejected"] = f"accuracy drop {-ev['effect']:.2f} < {cfg.min_drop} on probes (evidence)"
            else:
                skill = Skill(name=name, intent="recipe that beat the solver: " + ", ".join(_INTENTS.get(m, m)
                                                                                            for m in method),
                              method=method, difficulty_effect=ev["effect"], tool_hint="sympy",
                              provenance=Provenance(source="online_failure", failure_task=failed.key, round=rnd,
                                                    evidence=ev))
                h = h.with_skill(skill)
                res.admitted.append(skill)
                event["admitted"] = name
                event["harness_version"] = h.version
        self.log.append(event)
        return h

    def synthesise_round(self, h: Harness, queue: dict[str, MathTask], rnd: int, phase: str, online: bool):
        """All chains of ``queue`` for one round under ``h``: ``(results by seed, final harness)``
        (as Ray tasks when :attr:`distributed` is set: same results, see :mod:`treadle.rsi.ray_tasks`)."""
        if self.distributed is not None:
            return self.distributed.synthesise_round(self, h, queue, rnd, phase, online)
        out = {}
        for sid, task in queue.items():
            out[sid], h = self.run_chain(h, task, rnd, phase, online)
        return out, h

    # --- post-batch -----------------------------------------------------------------------------------
    def proposals(self, h: Harness) -> list[tuple[str, Harness]]:
        """Rule-based Meta: candidate dH on a copy of ``h``, skipping edits rejected in earlier batches."""
        rejected = {e["candidate_digest"] for e in self.log if e.get("event") == "candidate" and not e["accepted"]}
        out: list[tuple[str, Harness]] = []
        have = {s.method for s in h.skills}
        for p in PRIMITIVES:
            if (p,) not in have:
                eff = self.skill_effect((p,), p, self.round, "post_batch")
                if eff["applicability"] >= self.config.min_applicability:
                    out.append((f"add skill {p}", h.with_skill(Skill(
                        name=p, intent=_INTENTS[p], method=(p,), difficulty_effect=eff["effect"], tool_hint="sympy",
                        provenance=Provenance(source="post_batch", round=self.round, evidence=eff)))))
        weak = [s for s in h.skills if s.difficulty_effect > -0.05]
        if weak and len(h.skills) > 2:
            kept = tuple(s for s in h.skills if s is not weak[0])
            out.append((f"delete skill {weak[0].name}", h.evolve(skills=kept)))
        w = h.workflow
        if w.max_extends < 8:
            out.append(("workflow max_extends +1", h.evolve(workflow=w.model_copy(
                update={"max_extends": w.max_extends + 1, "max_steps": max(w.max_steps, 3 * (w.max_extends + 1))}))))
        if w.verify_every < w.max_extends:
            out.append(("workflow verify_every +1", h.evolve(workflow=w.model_copy(
                update={"verify_every": w.verify_every + 1}))))
        return [(d, c) for d, c in out if c.digest not in rejected][: self.config.max_rejections]

    def evaluate(self, h: Harness, queue: dict[str, MathTask], tag: str) -> Evaluation:
        """Q, A and cost of ``h`` synthesising one round from the frozen ``queue`` (no online admission)."""
        before = self.ledger.total()
        res, _ = self.synthesise_round(h, queue, self.round, "post_batch", online=False)
        cost = self.ledger.total() - before
        valid = [r for r in res.values() if r.new_valid]
        acc = self.solve_accuracy([r.task for r in valid], f"eval:{self.round}") if valid else []
        return Evaluation(validity=len(valid) / len(queue), accuracy=sum(acc) / len(acc) if acc else 0.0, cost=cost,
                          n_tasks=len(queue))

    def post_batch(self, online: Harness, queue: dict[str, MathTask]) -> Harness:
        base = self.evaluate(online, queue, "baseline")
        critic = Critic(self.config.margin)
        gate = PostBatchGate(online, base, critic, self.config.max_rejections)
        k = self.config.staged_queue
        small = dict(list(queue.items())[:k]) if 0 < k < len(queue) else None
        base_small = self.evaluate(online, small, "baseline-small") if small else None
        cands = [(desc, cand.model_copy(update={"version": online.version + 1, "parent": online.version}))
                 for desc, cand in self.proposals(online)]
        if self.distributed is not None:  # every candidate's evaluation chains start at once
            self.distributed.prefetch(self, [c for _, c in cands], small or queue, self.round, "post_batch")
        for desc, cand in cands:
            if small:
                ev = self.evaluate(cand, small, desc)
                if not critic.judge(ev, base_small).accepted:
                    desc = f"{desc} [rejected on the small queue of {k}]"
                    v = gate.offer(cand, ev, desc, baseline=base_small)
                    self.log.append({"event": "candidate", "round": self.round, "proposal": desc, "accepted": False,
                                     "reason": v.reason, "candidate_digest": cand.digest, "diff": diff(online, cand),
                                     "verdict": v.model_dump(), "stage": "small"})
                    if gate.done:
                        break
                    continue
            v = gate.offer(cand, self.evaluate(cand, queue, desc), desc)
            self.log.append({"event": "candidate", "round": self.round, "proposal": desc, "accepted": v.accepted,
                             "reason": v.reason, "candidate_digest": cand.digest, "diff": diff(online, cand),
                             "verdict": v.model_dump()})
            if gate.done:
                break
        if self.distributed is not None:
            self.distributed.discard()
        if gate.accepted is None:
            self.log.append({"event": "rollback" if gate.rolled_back else "no_accepted_candidate", "round": self.round,
                             "rejections": gate.rejections, "kept_version": online.version})
        return gate.result

    # --- rounds ---------------------------------------------------------------------------------------
    def step_round(self) -> dict:
        """One round: online synthesis over all chains, then (optionally) post-batch. Returns the round's
        records: exports, repairs, harness before/after, curve point."""
        cfg, rnd = self.config, self.round
        h_start = self.harness
        res, h_online = self.synthesise_round(self.harness, dict(self.chains), rnd, "online", cfg.online)
        self.chains = {sid: r.task for sid, r in res.items()}
        h_next = h_online
        if cfg.post_batch:
            h_next = self.post_batch(h_online, dict(self.chains))  # S_n: frozen queue at the batch boundary
        self.harness = h_next
        self._measure_point()
        self.round += 1
        return {"round": rnd, "exports": [e for r in res.values() for e in r.exports],
                "repairs": [e for r in res.values() for e in r.repairs], "harness_start": h_start,
                "harness_online": h_online, "harness": h_next, "accuracy": self.curve[-1],
                "accuracy_ci": self.curve_ci[-1]}

    def transfer(self, heldout: list[MathTask], h: Harness, rounds: int) -> float:
        """Final-round accuracy of frozen ``h`` on held-out seeds (task-only recursion, no update, nothing
        written back: the loop's harness, chains, log and ledger are untouched)."""
        saved = self.ledger
        self.ledger = CostLedger()
        try:
            queue = {t.seed_id: t for t in heldout}
            for r in range(rounds):
                res, _ = self.synthesise_round(h, queue, r, "transfer", online=False)
                queue = {sid: x.task for sid, x in res.items()}
            return self.measure(list(queue.values()))
        finally:
            self.ledger = saved


def initial_harness(loop: RSILoop) -> Harness:
    """H_0: the initial primitives measured on the probe seeds (difficulty effect as evidence) and kept if
    they apply validly to at least ``min_applicability`` of them; default prompts and workflow."""
    skills = []
    for p in INITIAL_PRIMITIVES:
        ev = loop.skill_effect((p,), p, -1, "init")
        if ev["applicability"] >= loop.config.min_applicability:
            skills.append(Skill(name=p, intent=_INTENTS[p], method=(p,), difficulty_effect=ev["effect"],
                                tool_hint="sympy", provenance=Provenance(source="initial", round=-1, evidence=ev)))
    return Harness(skills=tuple(skills), workflow=Workflow())

"""``treadle.rsi``: harness self-improvement for reasoning-data synthesis.

The harness ``H = (skill library, role prompts, workflow, Verify/Revise positions)`` is the thing that
improves; the verifier is outside it. Layers (never imports ``treadle.weft``):

- records: :mod:`~treadle.rsi.harness` (:class:`Harness`, :class:`Skill`, :func:`diff`),
  :mod:`~treadle.rsi.critic` (:class:`Critic`, :class:`PostBatchGate`), :mod:`~treadle.rsi.ledger`;
- offline math backend: :mod:`~treadle.rsi.math_tasks` (symbolic tasks, primitive transformations),
  :mod:`~treadle.rsi.verifier` (sympy, versioned), :mod:`~treadle.rsi.solvers` (fixed solvers);
- execute: :mod:`~treadle.rsi.loop` (:class:`RSILoop`: Director, online admission, post-batch, transfer);
- batch: :mod:`~treadle.rsi.runs` (run folders, resume, curve PNG, ablation), CLI ``treadle rsi``;
- LLM roles: :mod:`~treadle.rsi.agents` (Director, solver), :mod:`~treadle.rsi.llm_roles` (generator, Meta
  skill induction, paraphrase judge), :mod:`~treadle.rsi.llm_loop` (:class:`LLMRound`: an online round
  with LLM roles over math or HumanEval coding tasks), :mod:`~treadle.rsi.llm_curve` (the LLM runs'
  difficulty curve on the fixed queue), :mod:`~treadle.rsi.scripted_roles` (programmatic Director,
  generator and Meta on a local endpoint, so a real solver alone gives a measured curve);
- verification helpers: :mod:`~treadle.rsi.coding` (HumanEval seeds, tests run in :mod:`treadle.sandbox`),
  :mod:`~treadle.rsi.answer_check` (math-verify in worker processes, parent-enforced timeout),
  :mod:`~treadle.rsi.embedding` (embedding decontamination, offline MiniLM).

Example::

    from treadle.rsi import LoopConfig, RSILoop, CapacitySolver, make_seeds

    loop = RSILoop(make_seeds(12, 0), CapacitySolver(), LoopConfig(rounds=3))
    for _ in range(3):
        loop.step_round()
    print(loop.curve)          # fixed-solver accuracy per round on the fixed queue
"""
from treadle.rsi.critic import Critic, Evaluation, PostBatchGate, Verdict, cost_bound, relative_difficulty_gain
from treadle.rsi.harness import Harness, Provenance, RolePrompts, Skill, Workflow, diff
from treadle.rsi.ledger import CostEntry, CostLedger
from treadle.rsi.loop import Director, LoopConfig, RSILoop
from treadle.rsi.math_tasks import MathTask, SeedError, load_seed_file, make_seeds
from treadle.rsi.solvers import CapacitySolver, Solver, SolverError, TinyModelSolver
from treadle.rsi.verifier import VERIFIER_VERSION, check_answer, check_task

__all__ = [
           "VERIFIER_VERSION",
           "CapacitySolver",
           "CostEntry",
           "CostLedger",
           "Critic",
           "Director",
           "Evaluation",
           "Harness",
           "LoopConfig",
           "MathTask",
           "PostBatchGate",
           "Provenance",
           "RSILoop",
           "RolePrompts",
           "SeedError",
           "Skill",
           "Solver",
           "SolverError",
           "TinyModelSolver",
           "Verdict",
           "Workflow",
           "check_answer",
           "check_task",
           "cost_bound",
           "diff",
           "load_seed_file",
           "make_seeds",
           "relative_difficulty_gain",
]

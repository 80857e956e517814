"""The Critic: the post-batch gate on candidate harnesses (seed: RSI section 3.2, "post-batch").

A candidate ``H'`` and the frozen online harness ``H_o`` each synthesise one round from the same frozen
queue; each gives an :class:`Evaluation` (validity ``Q``, fixed-solver accuracy ``A``, cost). ``H'`` is
admitted iff all three hold:

- validity: ``Q(H') >= Q(H_o)`` (missing outputs count as invalid);
- difficulty: ``A(H') < A(H_o) - margin`` (``margin`` is the noise margin: with 4 attempts per task
  accuracy is coarse, so a candidate must beat the baseline by more than noise);
- cost: ``cost(H') <= min(1 + 1.5 (r_D - 1), 1.5) * cost(H_o)``, with the relative difficulty gain
  ``r_D = A(H_o) / A(H')`` (``+inf`` when ``A(H') = 0 < A(H_o)``; then the bound is 1.5).

:class:`PostBatchGate` applies the Critic to candidates in order, accepts the first that passes, and
after ``max_rejections`` (3) rejections rolls back to the online snapshot. Every verdict, accepted or
not, is kept with its reason.
"""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from treadle.rsi.harness import Harness

__all__ = ["Critic", "Evaluation", "PostBatchGate", "Verdict", "cost_bound", "relative_difficulty_gain"]


class Evaluation(BaseModel):
    """Scores of one harness on the frozen queue."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    validity: float = Field(ge=0.0, le=1.0)
    """Q: share of queue tasks with a valid verified output (missing outputs count as invalid)."""
    accuracy: float = Field(ge=0.0, le=1.0)
    """A: mean fixed-solver accuracy over the valid outputs (4 attempts per task)."""
    cost: float = Field(ge=0.0)
    """Cost of the round (work units offline; tokens or money with LLM roles)."""
    n_tasks: int = Field(0, ge=0)
    """Number of tasks in the queue."""


class Verdict(BaseModel):
    """The Critic's decision on one candidate, with its reason."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    accepted: bool
    reason: str
    """Why (every failed condition, or ``"all conditions hold"``)."""
    r_d: float
    """Relative difficulty gain ``A(H_o) / A(H')``."""
    cost_ratio_bound: float
    """``min(1 + 1.5 (r_D - 1), 1.5)``."""
    candidate: Evaluation
    baseline: Evaluation


def relative_difficulty_gain(a_base: float, a_cand: float) -> float:
    """``r_D = A(H_o) / A(H')``; ``+inf`` when ``A(H') = 0 < A(H_o)``; 1.0 when both are 0."""
    if a_cand == 0.0:
        return 1.0 if a_base == 0.0 else math.inf
    return a_base / a_cand


def cost_bound(r_d: float) -> float:
    """The allowed cost ratio ``min(1 + 1.5 (r_D - 1), 1.5)``."""
    return min(1.0 + 1.5 * (r_d - 1.0), 1.5)


class Critic:
    """Admit ``H'`` iff validity, difficulty (with ``margin``) and cost all hold (module docstring).

    Args:
        margin: noise margin on accuracy, >= 0 (absolute; default 0.02).

    Raises:
        ValueError: negative or non-finite margin.
    """

    def __init__(self, margin: float = 0.02):
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.margin = float(margin)

    def judge(self, candidate: Evaluation, baseline: Evaluation) -> Verdict:
        r_d = relative_difficulty_gain(baseline.accuracy, candidate.accuracy)
        bound = cost_bound(r_d)
        why = []
        if not candidate.validity >= baseline.validity:
            why.append(f"validity Q={candidate.validity:.3f} < baseline {baseline.validity:.3f}")
        if not candidate.accuracy < baseline.accuracy - self.margin:
            why.append(f"difficulty A={candidate.accuracy:.3f} not below baseline {baseline.accuracy:.3f} "
                       f"- margin {self.margin:.3f}")
        limit = bound * baseline.cost
        if not candidate.cost <= limit + 1e-12:
            why.append(f"cost {candidate.cost:.1f} > {bound:.3f} x baseline {baseline.cost:.1f} = {limit:.1f} "
                       f"(r_D={r_d:.3f})")
        return Verdict(accepted=not why, reason="; ".join(why) or "all conditions hold", r_d=r_d,
                       cost_ratio_bound=bound, candidate=candidate, baseline=baseline)


class PostBatchGate:
    """Accept the first candidate the Critic admits; after ``max_rejections`` rejections, roll back.

    Usage: ``gate = PostBatchGate(online, baseline_eval)``; for each candidate ``gate.offer(h, ev,
    proposal)`` until ``gate.done``; then ``gate.result`` is the accepted candidate or the online
    snapshot (``gate.rolled_back`` tells which). ``gate.log`` keeps every offer and its verdict.
    """

    def __init__(self, online: Harness, baseline: Evaluation, critic: Critic | None = None, max_rejections: int = 3):
        if max_rejections < 1:
            raise ValueError(f"max_rejections must be >= 1, got {max_rejections!r}")
        self.online, self.baseline = online, baseline
        self.critic = critic or Critic()
        self.max_rejections = max_rejections
        self.log: list[dict] = []
        self.accepted: Harness | None = None
        self.rejections = 0

    @property
    def rolled_back(self) -> bool:
        return self.accepted is None and self.rejections >= self.max_rejections

    @property
    def done(self) -> bool:
        return self.accepted is not None or self.rolled_back

    @property
    def result(self) -> Harness:
        """The accepted candidate, else the online snapshot (also before any offer)."""
        return self.accepted if self.accepted is not None else self.online

    def offer(self, candidate: Harness, evaluation: Evaluation, proposal: str = "",
              baseline: Evaluation | None = None) -> Verdict:
        """Judge one candidate (against ``baseline`` when given: a staged evaluation's small queue, else the
        gate's baseline); RuntimeError if the gate is already decided."""
        if self.done:
            raise RuntimeError("the post-batch gate is already decided; no more candidates")
        v = self.critic.judge(evaluation, baseline or self.baseline)
        self.log.append({"proposal": proposal, "candidate_digest": candidate.digest, "verdict": v.model_dump()})
        if v.accepted:
            self.accepted = candidate
        else:
            self.rejections += 1
            if self.rolled_back:
                self.log.append({"rollback": f"{self.rejections} rejections: kept H_online v{self.online.version}"})
        return v

"""RL task filtering: keep a task only when a rubric judge and the executable checks agree on its pilot rollouts.

Seed: WEFT 5.1 (RL task filtering). A rubric-guided judge scores each pilot rollout independently of
the executable checks; a task is kept only if *both* the Pearson (linear) and the Spearman (rank)
correlation between judge and executable scores reach their thresholds, with at least
``min_rollouts`` pilot rollouts. Confidence intervals: Pearson's from
``scipy.stats.pearsonr(...).confidence_interval`` (Fisher transformation), Spearman's from
``scipy.stats.bootstrap`` (paired, percentile, seeded). Tasks whose scores disagree go to evaluator
attribution (``to_attribution``). Malformed judge scores (not numbers, not finite, outside [0, 1],
not one per rollout) drop that task with the reason; the other tasks are filtered normally.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class FilterConfig(BaseModel):
    """Thresholds of the filter (validated; ``extra`` keys are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_pearson: float = Field(0.5, ge=-1, le=1, description="Pearson r a kept task reaches.")
    min_spearman: float = Field(0.5, ge=-1, le=1, description="Spearman rho a kept task reaches.")
    min_rollouts: int = Field(8, ge=3, description="Pilot rollouts per task (fewer: dropped, not judged).")
    confidence: float = Field(0.95, gt=0, lt=1, description="Confidence level of the intervals.")
    n_resamples: int = Field(999, ge=99, description="Bootstrap resamples for Spearman's interval.")
    seed: int = 0


class FilterDecision(BaseModel):
    """Kept or dropped, with the statistics and the reasons."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    kept: bool
    n: int
    pearson: float | None = None
    pearson_ci: tuple[float, float] | None = None
    pearson_p: float | None = None
    spearman: float | None = None
    spearman_ci: tuple[float, float] | None = None
    spearman_p: float | None = None
    reasons: tuple[str, ...] = ()
    to_attribution: bool = False


def _clean(task: str, judge: Any, executable: Any) -> tuple[list[float], list[float], str]:
    if not isinstance(judge, Sequence) or isinstance(judge, (str, bytes)):
        return [], [], f"judge scores must be a list of numbers, got {type(judge).__name__}"
    if not isinstance(executable, Sequence) or isinstance(executable, (str, bytes)):
        return [], [], f"executable scores must be a list of numbers, got {type(executable).__name__}"
    if len(judge) != len(executable):
        return [], [], f"{len(judge)} judge scores for {len(executable)} rollouts (one per rollout expected)"
    for name, xs in (("judge", judge), ("executable", executable)):
        for i, v in enumerate(xs):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
                return [], [], f"{name} score #{i} is {v!r}; expected a finite number in [0, 1]"
    return [float(v) for v in judge], [float(v) for v in executable], ""


def decide(task: str, judge: Any, executable: Any, cfg: FilterConfig | None = None) -> FilterDecision:
    """Filter one task from its pilot rollouts' judge and executable scores (aligned, one pair per rollout)."""
    from scipy import stats

    cfg = cfg or FilterConfig()
    x, y, bad = _clean(task, judge, executable)
    if bad:
        return FilterDecision(task=task, kept=False, n=0, reasons=(f"malformed scores: {bad}",))
    n = len(x)
    if n < cfg.min_rollouts:
        return FilterDecision(task=task, kept=False, n=n,
                              reasons=(f"{n} pilot rollouts < min_rollouts {cfg.min_rollouts}",))
    if len(set(y)) == 1:  # every pilot scores the same: no signal to correlate (nor to learn from), judge or not
        return FilterDecision(task=task, kept=False, n=n,
                              reasons=("constant executable scores: correlation undefined",))
    if len(set(x)) == 1:  # the executable check tells the pilots apart, the judge does not: ask which is wrong
        return FilterDecision(task=task, kept=False, n=n, to_attribution=True,
                              reasons=("constant judge scores: correlation undefined",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pr = stats.pearsonr(x, y)
        ci = pr.confidence_interval(confidence_level=cfg.confidence)
        sr = stats.spearmanr(x, y)
        boot = stats.bootstrap((x, y), lambda a, b: stats.spearmanr(a, b).statistic, paired=True,
                               vectorized=False, method="percentile", confidence_level=cfg.confidence,
                               n_resamples=cfg.n_resamples, random_state=cfg.seed)
    r, rho = float(pr.statistic), float(sr.statistic)
    reasons = []
    if not r >= cfg.min_pearson:
        reasons.append(f"pearson {r:.3f} < {cfg.min_pearson}")
    if not rho >= cfg.min_spearman:
        reasons.append(f"spearman {rho:.3f} < {cfg.min_spearman}")
    lo, hi = boot.confidence_interval
    return FilterDecision(task=task, kept=not reasons, n=n, pearson=r, pearson_ci=(float(ci.low), float(ci.high)),
                          pearson_p=float(pr.pvalue), spearman=rho,
                          spearman_ci=(float(lo) if math.isfinite(lo) else rho, float(hi) if math.isfinite(hi) else rho),
                          spearman_p=float(sr.pvalue), reasons=tuple(reasons), to_attribution=bool(reasons))


def filter_tasks(scores: Mapping[str, tuple[Any, Any]], cfg: FilterConfig | None = None) -> list[FilterDecision]:
    """:func:`decide` for every ``{task: (judge scores, executable scores)}``; one decision per task, in order.
    A malformed entry is a dropped decision, never an exception."""
    out = []
    for task, pair in scores.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            out.append(FilterDecision(task=str(task), kept=False, n=0,
                                      reasons=("malformed scores: expected (judge scores, executable scores)",)))
            continue
        out.append(decide(str(task), pair[0], pair[1], cfg))
    return out

"""Difficulty curve of LLM runs on a fixed queue: at each round boundary the
*fixed* solver (the solver role with ``H_0``'s solver prompt, never an edited one) attempts every seed
chain's latest valid task ``attempts`` times; the curve is, per round and domain, the mean accuracy over
those tasks (with a bootstrap 95% interval: 4 attempts give a task only 5 possible values), the share of
tasks solved at least once (pass@attempts) and the mean number of construction steps (skills applied).

The queue is fixed: the same seed ids every round (point 0 = the seeds themselves, point ``r + 1`` =
after round ``r``); a chain whose round produced nothing new is measured on the task it kept. Measuring
calls are tagged ``rsi:<point>:measure:<seed>`` and are not synthesis cost: :func:`cost_from_llm_ledger`
leaves them out; a run's summary counts them apart. Served from :mod:`treadle.llm`'s cache when the
same solver already answered the same task (same prompt, same sample index), so a rerun pays nothing.

A task whose attempts all failed at the endpoint is *unmeasured* (``accuracy`` None): left out of the mean
and counted in ``unmeasured``, never scored as 0 or 1.
"""
from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from treadle.llm import LLMClient
from treadle.rsi.agents import llm_solve
from treadle.rsi.harness import Harness, RolePrompts
from treadle.rsi.loop import bootstrap_ci

__all__ = ["QueuePoint", "curve_rows", "curve_table", "measure_queue", "plot_curve"]


class QueuePoint(BaseModel):
    """The fixed solver on one chain's task at one curve point."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    point: int = Field(ge=0)
    """Curve point: 0 = the seeds, ``r + 1`` = after round ``r``."""
    domain: str
    seed_id: str
    task: str
    """Key of the measured task."""
    steps: int = Field(ge=0)
    """Construction steps: skills applied to the seed so far."""
    attempts: int = Field(ge=1)
    answered: int = Field(ge=0)
    """Attempts the endpoint answered (failed calls are left out)."""
    correct: int = Field(ge=0)
    accuracy: float | None = Field(None, ge=0.0, le=1.0)
    """``correct / answered``; None when no attempt answered (unmeasured)."""


async def measure_queue(client: LLMClient, domain, tasks: list, point: int, *, attempts: int = 4,
                        role: str = "solver", solver_prompt: str | None = None,
                        concurrency: int = 4) -> list[QueuePoint]:
    """The fixed solver on every task of ``tasks`` (one per seed chain): one :class:`QueuePoint` per task,
    in order, whatever fails.

    Args:
        domain: :class:`~treadle.rsi.llm_loop.MathDomain` or :class:`~treadle.rsi.llm_loop.CodingDomain`
            (scores the answers with its immutable verifier).
        point: curve point (0 = seeds, ``r + 1`` after round ``r``); the ledger tag's round field.
        solver_prompt: the fixed solver's system prompt (default: :class:`RolePrompts`' default, i.e.
            ``H_0``'s); never the prompt of an edited harness, or the measure would move with the harness.
        concurrency: tasks measured at once (the client further bounds calls per endpoint).

    Raises:
        ValueError: ``attempts`` < 1 or ``concurrency`` < 1 (before any call).
    """
    if attempts < 1 or concurrency < 1:
        raise ValueError(f"attempts and concurrency must be >= 1, got {attempts} and {concurrency}")
    h = Harness(prompts=RolePrompts() if solver_prompt is None else RolePrompts(solver=solver_prompt))
    sem = asyncio.Semaphore(concurrency)

    async def one(t) -> QueuePoint:
        async with sem:
            r = (await llm_solve(client, h, [domain.solver_text(t)], attempts, role=role,
                                 tags=[f"rsi:{point}:measure:{t.seed_id}"]))[0]
            ok = await domain.score(t, r.answers) if r.answers else []
        return QueuePoint(point=point, domain=domain.name, seed_id=t.seed_id, task=t.key,
                          steps=len(t.skills_used), attempts=attempts, answered=len(r.answers), correct=sum(ok),
                          accuracy=sum(ok) / len(ok) if ok else None)

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def curve_rows(points: list[QueuePoint], *, seed: int = 0) -> list[dict]:
    """The curve from per-task measurements: one row per (domain, point), sorted, with ``n_tasks``,
    ``unmeasured``, ``accuracy`` (mean over measured tasks; None if none), ``ci95`` (bootstrap over tasks,
    seeded by ``seed``), ``solved`` (share of measured tasks with at least one correct attempt) and
    ``mean_steps`` (over all tasks)."""
    groups: dict[tuple[str, int], list[QueuePoint]] = {}
    for p in points:
        groups.setdefault((p.domain, p.point), []).append(p)
    rows = []
    for (dom, pt), ps in sorted(groups.items()):
        accs = [p.accuracy for p in ps if p.accuracy is not None]
        rows.append({"domain": dom, "point": pt, "n_tasks": len(ps), "unmeasured": len(ps) - len(accs),
                     "accuracy": sum(accs) / len(accs) if accs else None,
                     "ci95": list(bootstrap_ci(accs, seed=seed)) if accs else None,
                     "solved": sum(a > 0 for a in accs) / len(accs) if accs else None,
                     "mean_steps": sum(p.steps for p in ps) / len(ps)})
    return rows


def curve_table(rows: list[dict]) -> str:
    """The curve as a Markdown table (what the CLI prints and the README quotes)."""
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    lines = ["| domain | point | tasks | unmeasured | accuracy | 95% CI | solved (pass@k) | mean steps |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = "-" if r["ci95"] is None else f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
        lines.append(f"| {r['domain']} | {r['point']} | {r['n_tasks']} | {r['unmeasured']} | {f(r['accuracy'])} | "
                     f"{ci} | {f(r['solved'])} | {r['mean_steps']:.2f} |")
    return "\n".join(lines)


def plot_curve(rows: list[dict], path, title: str = "fixed-solver accuracy on the fixed queue (LLM run)") -> None:
    """The curve as a PNG: accuracy per point with its 95% interval (left axis) and mean construction steps
    (dashed, right axis), one colour per domain; matplotlib's object API (no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax2 = ax.twinx()
    for i, dom in enumerate(dict.fromkeys(r["domain"] for r in rows)):
        rs = [r for r in rows if r["domain"] == dom]
        colour = f"C{i}"
        xs = [r["point"] for r in rs if r["accuracy"] is not None]
        ax.plot(xs, [r["accuracy"] for r in rs if r["accuracy"] is not None], marker="o", color=colour,
                label=f"{dom}: accuracy")
        ax.fill_between(xs, [r["ci95"][0] for r in rs if r["ci95"]], [r["ci95"][1] for r in rs if r["ci95"]],
                        alpha=0.2, color=colour)
        ax2.plot([r["point"] for r in rs], [r["mean_steps"] for r in rs], linestyle="--", marker="x", color=colour,
                 label=f"{dom}: mean steps")
    pts = sorted({r["point"] for r in rows})
    ax.set_xticks(pts or [0])
    ax.set_xlabel("curve point (0 = seeds, r + 1 = after round r)")
    ax.set_ylabel("fixed-solver accuracy")
    ax2.set_ylabel("construction steps (skills applied)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)

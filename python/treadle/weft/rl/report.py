"""Seeds x groupings of :func:`~treadle.weft.rl.train.train_policy`: table, ``summary.json``, PNG.

Each run starts from a fresh copy of the same tool policy; a run folder per ``<grouping>-seed<k>``
holds ``steps.jsonl`` and ``summary.json``; the top folder holds ``summary.json`` (per grouping:
held-out per-turn and whole-task success before/after per seed, mean and spread of the change)
and ``curves.png`` (batch turn reward and held-out per-turn success over steps).
"""
from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

__all__ = ["run_comparison"]


def _plot(runs: dict, path: Path) -> None:
    from treadle.figures import png_figure

    with png_figure(path, figsize=(9, 3.5), dpi=100) as (fig, ax):
        ax2 = fig.add_subplot(1, 2, 2)
        ax.set_position([0.07, 0.15, 0.4, 0.75])
        ax2.set_position([0.57, 0.15, 0.4, 0.75])
        colors = {"atomic": "tab:blue", "trajectory": "tab:orange"}
        for (grouping, seed), s in runs.items():
            recs = s["records"]
            ax.plot([r["step"] + 1 for r in recs], [r["turn_reward"] for r in recs], color=colors[grouping],
                    alpha=0.5, label=f"{grouping} seed {seed}")
            ev = sorted((int(k), v["turn_success"]) for k, v in s["evals"].items())
            ax2.plot([k for k, _ in ev], [v for _, v in ev], marker="o", color=colors[grouping], alpha=0.7,
                     label=f"{grouping} seed {seed}")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("batch per-turn verdict (train)")
        ax2.set_xlabel("GRPO step")
        ax2.set_ylabel("held-out per-turn success (T=1)")
        for a in (ax, ax2):
            a.set_ylim(-0.02, 1.02)
        ax2.legend(fontsize=6, loc="lower right")


def run_comparison(out: Path, policy, groupings, seeds, *, steps: int | None, quick: bool, console,
                   overrides: dict | None = None) -> dict:
    """Train every (grouping, seed) from a copy of ``policy = (model, tokenizer)``; write and print results."""
    import anyio
    from rich.table import Table

    from treadle.weft.rl.train import WeftTrainConfig, train_policy

    model, tok = policy
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs, t_start = {}, time.perf_counter()
    for grouping in groupings:
        for seed in seeds:
            kw = ({"grouping": grouping, "seed": seed} | ({"steps": steps} if steps is not None else {})
                  | (overrides or {}))
            cfg = WeftTrainConfig.quick(**kw) if quick else WeftTrainConfig(**kw)
            sub = out / f"{grouping}-seed{seed}"
            sub.mkdir(parents=True, exist_ok=True)
            m = copy.deepcopy(model)
            with open(sub / "steps.jsonl", "w") as log:
                s = anyio.run(lambda: train_policy(m, tok, cfg, log=log, progress=not quick))
            (sub / "summary.json").write_text(json.dumps(s, indent=1))
            runs[(grouping, seed)] = s
            console.print(f"{grouping} seed {seed}: held-out per-turn {s['before']['turn_success']:.3f} -> "
                          f"{s['after']['turn_success']:.3f}, whole-task {s['before']['task_success']:.3f} -> "
                          f"{s['after']['task_success']:.3f}", markup=False)
    summary: dict = {"seeds": list(seeds), "groupings": {}, "t_total_s": time.perf_counter() - t_start}
    t = Table(title=f"GRPO on the tiny tool policy: held-out success (T=1), {len(seeds)} seed(s)")
    for col in ("grouping", "per-turn before", "per-turn after", "change mean (sd)", "whole-task before",
                "whole-task after", "env share", "segments/s"):
        t.add_column(col, justify="right")
    for grouping in groupings:
        rs = [runs[(grouping, s)] for s in seeds]
        d_turn = [r["after"]["turn_success"] - r["before"]["turn_success"] for r in rs]
        d_task = [r["after"]["task_success"] - r["before"]["task_success"] for r in rs]
        sd = statistics.stdev(d_turn) if len(d_turn) > 1 else float("nan")
        g = {"per_seed": {str(s): {"before": r["before"], "after": r["after"]} for s, r in zip(seeds, rs)},
             "turn_change_mean": statistics.mean(d_turn), "turn_change_sd": sd,
             "task_change_mean": statistics.mean(d_task),
             "time_share": {k: statistics.mean(r["time_share"][k] for r in rs) for k in rs[0]["time_share"]},
             "segments_per_s": statistics.mean(r["segments_per_s"] for r in rs)}
        summary["groupings"][grouping] = g
        mean = lambda key, when: statistics.mean(r[when][key] for r in rs)  # noqa: E731
        t.add_row(grouping, f"{mean('turn_success', 'before'):.3f}", f"{mean('turn_success', 'after'):.3f}",
                  f"{g['turn_change_mean']:+.3f} ({sd:.3f})", f"{mean('task_success', 'before'):.3f}",
                  f"{mean('task_success', 'after'):.3f}", f"{g['time_share']['t_env_s']:.0%}",
                  f"{g['segments_per_s']:.1f}")
    console.print(t)
    for grouping, g in summary["groupings"].items():
        ts = g["time_share"]
        console.print(f"{grouping}: time share env {ts['t_env_s']:.1%}, model (generation) {ts['t_model_s']:.1%}, "
                      f"advantage op {ts['t_advantage_s']:.3%}, update {ts['t_update_s']:.1%}", markup=False)
    _plot(runs, out / "curves.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"results: {out} (summary.json, curves.png, <grouping>-seed<k>/steps.jsonl)", markup=False)
    return summary

"""Seeds x groupings of :func:`~treadle.weft.rl.train.train_policy`: table, ``summary.json``, PNG.

Each run starts from a fresh copy of the same tool policy; a run folder per ``<grouping>-seed<k>``
holds ``steps.jsonl`` and ``summary.json``; the top folder holds ``summary.json`` (per grouping:
held-out per-turn and whole-task success before/after per seed, mean and spread of the change)
and ``curves.png`` (batch turn reward and held-out per-turn success over steps).

Resume: a ``<grouping>-seed<k>/summary.json`` whose config and start policy (``policy_sha256``, a hash
of the parameters) equal this run's is reused, not re-run (listed in ``reused_runs``), so a comparison
can grow by seeds or continue after an interruption; any other run is trained again.
"""
from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

__all__ = ["run_comparison", "policy_fingerprint"]


def _plot(runs: dict, path: Path) -> None:
    from treadle.figures import png_figure

    with png_figure(path, figsize=(9, 3.5), dpi=100) as (fig, ax):
        ax.remove()  # two panels side by side (png_figure's tight_layout overrides hand-set positions)
        ax, ax2 = fig.subplots(1, 2)
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


def policy_fingerprint(model) -> str:
    """sha256 (16 hex digits) of the model's parameters: a finished run is reused only from the same start."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _one_run(policy, cfg, sub: Path, fingerprint: str = "", checkpoint_every: int | None = None) -> dict:
    """Train one (grouping, seed) from ``policy`` (``(model, tokenizer)``, copied, or a checkpoint folder);
    write ``sub/steps.jsonl`` and ``sub/summary.json``; return the summary (``cpu_s``: process CPU time).
    ``checkpoint_every``: step checkpoints in ``sub/checkpoint`` (:func:`treadle.distributed.weft_resume.
    one_process_checkpoint`; an interrupted run continues from there); None: none."""
    import anyio
    import torch

    from treadle.weft.rl.train import train_policy

    if isinstance(policy, (str, Path)):
        from treadle.weft.rl.sft import load_tool_model

        torch.set_num_threads(1)
        model, tok = load_tool_model(policy, train_if_missing=False)
    else:
        model, tok = copy.deepcopy(policy[0]), policy[1]
    sub.mkdir(parents=True, exist_ok=True)
    c0 = time.process_time()
    with open(sub / "steps.jsonl", "w") as log:
        ckpt = None
        if checkpoint_every is not None:
            from treadle.distributed.weft_resume import one_process_checkpoint

            ckpt = one_process_checkpoint(sub, checkpoint_every, cfg, fingerprint, log)
        s = anyio.run(lambda: train_policy(model, tok, cfg, log=log, progress=False, checkpoint=ckpt))
    s["resumed_from_step"] = ckpt.resumed_from if ckpt is not None else None
    s["cpu_s"] = time.process_time() - c0
    s["policy_sha256"] = fingerprint
    (sub / "summary.json").write_text(json.dumps(s, indent=1))
    return s


def run_comparison(out: Path, policy, groupings, seeds, *, steps: int | None, quick: bool, console,
                   overrides: dict | None = None, jobs: int = 1, reuse: bool = True, runner=None,
                   checkpoint_every: int | None = None) -> dict | None:
    """Train every (grouping, seed) from a copy of ``policy = (model, tokenizer)``; write and print results.

    ``runner(policy, cfg, run_folder)`` replaces the one-process run (``--parallel``:
    :func:`treadle.weft.rl.parallel.one_run_dp`); a runner that returns None (a rank other than 0) makes
    this return None after the runs, writing nothing more.

    ``jobs > 1`` runs that many (grouping, seed) runs at once in worker processes (spawned; each loads
    the policy from ``out/start-policy``, one torch thread each): the same runs, the same numbers (each
    run is seeded on its own), in less wall time on a multi-core machine. ``reuse``: keep finished runs of
    the same config and start policy (module docstring); False trains every run again. ``checkpoint_every``:
    one-process runs write step checkpoints every that many steps and continue from them (``_one_run``)."""
    from rich.table import Table

    from treadle.weft.rl.train import WeftTrainConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs, t_start, c_start = {}, time.perf_counter(), time.process_time()
    todo = []
    for grouping in groupings:
        for seed in seeds:
            kw = ({"grouping": grouping, "seed": seed} | ({"steps": steps} if steps is not None else {})
                  | (overrides or {}))
            todo.append(((grouping, seed), WeftTrainConfig.quick(**kw) if quick else WeftTrainConfig(**kw)))

    def done(key, s):
        runs[key] = s
        console.print(f"{key[0]} seed {key[1]}: held-out per-turn {s['before']['turn_success']:.3f} -> "
                      f"{s['after']['turn_success']:.3f}, whole-task {s['before']['task_success']:.3f} -> "
                      f"{s['after']['task_success']:.3f} ({s['cpu_s']:.0f} s CPU)", markup=False)

    reused, fp = [], policy_fingerprint(policy[0])
    for key, cfg in list(todo):  # resume: a finished run of the same config is kept, not re-run
        prev = out / f"{key[0]}-seed{key[1]}" / "summary.json"
        if reuse and prev.exists():
            try:
                s = json.loads(prev.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if s.get("config") == cfg.as_dict() and s.get("policy_sha256") == fp:
                todo.remove((key, cfg))
                reused.append(key)
                done(key, s)
    if runner is not None:
        got = [(key, runner(policy, cfg, out / f"{key[0]}-seed{key[1]}")) for key, cfg in todo]
        if any(s is None for _, s in got):
            return None
        for key, s in got:
            done(key, s)
        worker_cpu = 0.0
    elif jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        start = out / "start-policy"
        policy[0].save_pretrained(start)
        policy[1].save_pretrained(start)
        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = {key: pool.submit(_one_run, start, cfg, out / f"{key[0]}-seed{key[1]}", fp, checkpoint_every)
                    for key, cfg in todo}
            for key, fut in futs.items():
                done(key, fut.result())
        worker_cpu = sum(runs[key]["cpu_s"] for key, _ in todo)
    else:
        for key, cfg in todo:
            done(key, _one_run(policy, cfg, out / f"{key[0]}-seed{key[1]}", fp, checkpoint_every))
        worker_cpu = 0.0
    summary: dict = {"seeds": list(seeds), "groupings": {}, "t_total_s": time.perf_counter() - t_start,
                     "cpu_total_s": time.process_time() - c_start + worker_cpu, "jobs": jobs,
                     "reused_runs": [f"{g}-seed{k}" for g, k in reused],
                     "cpu_runs_s": sum(r["cpu_s"] for r in runs.values())}
    t = Table(title=f"GRPO on the tiny tool policy: held-out success (T=1), {len(seeds)} seed(s)")
    for col in ("grouping", "per-turn before", "per-turn after", "change mean (sd; range)", "whole-task before",
                "whole-task after", "all-equal groups", "segments generated (dropped)", "env share", "segments/s"):
        t.add_column(col, justify="right")
    for grouping in groupings:
        rs = [runs[(grouping, s)] for s in seeds]
        d_turn = [r["after"]["turn_success"] - r["before"]["turn_success"] for r in rs]
        d_task = [r["after"]["task_success"] - r["before"]["task_success"] for r in rs]
        sd = statistics.stdev(d_turn) if len(d_turn) > 1 else float("nan")
        g = {"per_seed": {str(s): {"before": r["before"], "after": r["after"]} for s, r in zip(seeds, rs)},
             "turn_changes": d_turn, "turn_change_mean": statistics.mean(d_turn), "turn_change_sd": sd,
             "turn_change_range": max(d_turn) - min(d_turn),
             # the target: the mean change is larger than the spread of the change across seeds
             "turn_gain_beyond_sd": statistics.mean(d_turn) > sd,
             "turn_gain_beyond_range": statistics.mean(d_turn) > max(d_turn) - min(d_turn),
             "task_changes": d_task, "task_change_mean": statistics.mean(d_task),
             # groups with no signal (every candidate passed, or every one failed): counted, not hidden
             "all_equal_groups": sum(rec.get("all_equal_groups", 0) for r in rs for rec in r["records"]),
             "groups": sum(rec.get("groups", 0) for r in rs for rec in r["records"]),
             # dynamic sampling's budget (WeftTrainConfig.sampling_rounds): every generated segment, those the
             # update used, those dropped with their no-signal groups
             **{f"segments_{k}": sum(rec.get(f"segments_{k}", rec["segments"] if k != "dropped" else 0)
                                     for r in rs for rec in r["records"]) for k in ("generated", "kept", "dropped")},
             "cpu_s_per_run": [r.get("cpu_s") for r in rs],
             "time_share": {k: statistics.mean(r["time_share"][k] for r in rs) for k in rs[0]["time_share"]},
             "segments_per_s": statistics.mean(r["segments_per_s"] for r in rs)}
        summary["groupings"][grouping] = g
        mean = lambda key, when: statistics.mean(r[when][key] for r in rs)  # noqa: E731
        t.add_row(grouping, f"{mean('turn_success', 'before'):.3f}", f"{mean('turn_success', 'after'):.3f}",
                  f"{g['turn_change_mean']:+.3f} ({sd:.3f}; {g['turn_change_range']:.3f})",
                  f"{mean('task_success', 'before'):.3f}",
                  f"{mean('task_success', 'after'):.3f}", f"{g['all_equal_groups']}/{g['groups']}",
                  f"{g['segments_generated']} ({g['segments_dropped']})",
                  f"{g['time_share']['t_env_s']:.0%}",
                  f"{g['segments_per_s']:.1f}")
    console.print(t)
    for grouping, g in summary["groupings"].items():
        ts = g["time_share"]
        console.print(f"{grouping}: time share env {ts['t_env_s']:.1%}, model (generation) {ts['t_model_s']:.1%}, "
                      f"advantage op {ts['t_advantage_s']:.3%}, update {ts['t_update_s']:.1%}", markup=False)
    _plot(runs, out / "curves.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"{len(todo)} runs in {summary['t_total_s']:.0f} s wall, {summary['cpu_total_s']:.0f} s CPU "
                  f"(--jobs {jobs}; {len(reused)} finished runs reused, {summary['cpu_runs_s']:.0f} s CPU in all "
                  f"runs); results: {out} (summary.json, curves.png, <grouping>-seed<k>/steps.jsonl)",
                  markup=False)
    return summary

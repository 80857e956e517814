"""Gate-range sweep over (L, U) (SCALE sec. 4.3 / appendix: the paper scans 42 intervals, L in [-6, 0] x
U in [1, 6], and finds math preferring negative L, code L near 0 with large U).

Every cell is a Stage-II run (:func:`treadle.scale.stage_two.train`) from the same base model, the same
Stage-I adapter, the same training responses and the same held-out problems (shared starting point:
only (L, U) differs). The Stage-I model is evaluated once. Cells run in parallel processes
(``concurrent.futures.ProcessPoolExecutor`` with the ``spawn`` start method; each worker loads the
model from disk and uses ``cores // jobs`` torch threads). Writes ``results.json`` (all cells),
``results.jsonl`` (one line per cell), ``heatmap.png`` (held-out metric per cell) and one run folder per
cell (``cells/L<L>_U<U>/``, as :func:`train` writes).

Only ``L < 0`` and ``U > 1`` are valid gate ranges here (:class:`treadle.scale.GateConfig`); the paper's
L = 0 / U = 1 edges are the no-reverse / no-extrapolate ablations (``no_reverse`` / ``no_extrapolate``
of :class:`treadle.scale.training.ScaleTrainConfig`, which a sweep can also set for every cell).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch

from treadle.figures import png_figure

__all__ = ["METRICS", "sweep", "heatmap"]

METRICS = ("accuracy_mean", "entropy")


def _cell_name(L: float, U: float) -> str:
    return f"L{L:g}_U{U:g}"


_CELL_RE = re.compile(r"^L-[0-9.e+-]+_U[0-9.e+-]+$")  # what _cell_name gives for L < 0


def _clear_stale_cells(out: Path) -> None:
    """Remove the cell run folders (``cells/L<L>_U<U>/``) an earlier sweep left in ``out``, so that
    ``cells/`` holds this sweep's cells only; anything else in ``cells/`` is left alone."""
    cells = out / "cells"
    if not cells.is_dir():
        return
    for d in cells.iterdir():
        if d.is_dir() and not d.is_symlink() and _CELL_RE.match(d.name):
            shutil.rmtree(d)


def _load(model_path: str, adapter: str | None):
    from treadle.models.tiny import load_default_model
    from treadle.scale.training import load_stage_one

    model, tok = load_default_model(model_path, train_if_missing=False, progress=False)
    if torch.cuda.is_available():
        model = model.cuda()
    return (load_stage_one(model, adapter) if adapter is not None else model), tok


def _inherit_warning_filters(filters: list) -> None:
    """Worker initializer: use the parent's warning filters (see :func:`sweep`)."""
    warnings.filters[:] = filters
    for name in ("_filters_mutated", "_filters_mutated_lock_held"):  # invalidate the per-module caches
        if callable(getattr(warnings, name, None)):
            getattr(warnings, name)()
            break


def _run_cell(task: dict) -> dict:
    """One sweep task in a worker (or in-process): the Stage-I baseline or one (L, U) cell."""
    from treadle.scale.stage_two import train
    from treadle.scale.training import ScaleTrainConfig, _heldout, evaluate

    if task.get("threads"):
        torch.set_num_threads(task["threads"])
    cfg = ScaleTrainConfig(**task["config"])
    model, tok = _load(task["model"], task["adapter"])
    t0 = time.perf_counter()
    if task["kind"] == "baseline":
        res = evaluate(model, tok, _heldout(cfg), k=min(cfg.k, task["vocab"]), max_new_tokens=cfg.max_new_tokens)
        return {"kind": "baseline", "accuracy_mean": res["accuracy_mean"], "accuracy": res["accuracy"],
                "entropy": res["entropy"], "seconds": time.perf_counter() - t0}
    s = train(model, tok, cfg, task["out"], evaluate_before=False)
    a = s["after"]
    return {"kind": "cell", "L": cfg.L, "U": cfg.U, "accuracy_mean": a["accuracy_mean"], "accuracy": a["accuracy"],
            "entropy": a["entropy"], "objective_before": s["objective_before"], "objective_after": s["objective_after"],
            "lambda": a["lambda"]["overall"], "lambda_mean": a["lambda"]["mean"], "gates": s["gates"],
            "seconds": time.perf_counter() - t0}


def heatmap(cells: list, path: str | Path, *, metric: str = "accuracy_mean", baseline: float | None = None,
            title: str = "") -> Path:
    """Save a PNG heatmap of ``metric`` over the (L, U) grid (rows L, columns U), each cell annotated;
    ``baseline`` (the Stage-I value) goes in the title."""
    import numpy as np

    Ls = sorted({c["L"] for c in cells})
    Us = sorted({c["U"] for c in cells})
    grid = np.full((len(Ls), len(Us)), np.nan)
    for c in cells:
        grid[Ls.index(c["L"]), Us.index(c["U"])] = c[metric]
    with png_figure(path, figsize=(1.2 * len(Us) + 2.4, 0.9 * len(Ls) + 1.8)) as (fig, ax):
        im = ax.imshow(grid, cmap="viridis" if metric == "accuracy_mean" else "viridis_r", aspect="auto")
        ax.set_xticks(range(len(Us)), [f"{u:g}" for u in Us])
        ax.set_yticks(range(len(Ls)), [f"{v:g}" for v in Ls])
        ax.set_xlabel("U (upper end of lambda)")
        ax.set_ylabel("L (lower end of lambda)")
        fmt = "{:.1%}" if metric == "accuracy_mean" else "{:.4f}"
        lo, hi = np.nanmin(grid), np.nanmax(grid)
        for i in range(len(Ls)):
            for j in range(len(Us)):
                if not np.isnan(grid[i, j]):
                    bright = hi > lo and (grid[i, j] - lo) / (hi - lo) > 0.5
                    ax.text(j, i, fmt.format(grid[i, j]), ha="center", va="center", fontsize=8,
                            color="black" if bright == (metric == "accuracy_mean") else "white")
        fig.colorbar(im, ax=ax)
        name = "held-out accuracy" if metric == "accuracy_mean" else "held-out top-k entropy"
        ax.set_title(title or (f"SCALE (L, U) sweep: {name}"
                               + (f" (Stage I: {fmt.format(baseline)})" if baseline is not None else "")), fontsize=9)
    return Path(path)


def sweep(model_path: str | Path, adapter: str | Path, Ls, Us, config=None, out_dir: str | Path = "runs/scale-sweep",
          *, jobs: int | None = None, metric: str = "accuracy_mean", console=None, progress: bool = False) -> dict:
    """Run a Stage-II trial per (L, U) cell and write the results and a heatmap (see the module docstring).

    Args:
        model_path: the base model's local HF checkpoint folder (workers load it from disk).
        adapter: the Stage-I PEFT LoRA adapter folder shared by all cells.
        Ls: lower ends, each finite and < 0, e.g. ``(-6, -4, -2, -0.5)``.
        Us: upper ends, each finite and > 1, e.g. ``(1.5, 2, 4, 6)``.
        config: :class:`treadle.scale.training.ScaleTrainConfig` for everything but (L, U).
        out_dir: run folder.
        jobs: parallel worker processes (default ``min(cores, cells + 1)``: the cells and the Stage-I
            baseline are tasks; 1 runs everything in this process); each worker uses
            ``max(1, cores // jobs)`` torch threads.
        metric: heatmap metric, ``"accuracy_mean"`` (held-out greedy accuracy) or ``"entropy"``.

    Returns:
        ``{"metric", "Ls", "Us", "baseline": Stage-I results, "cells": [per-cell dicts], "best":
        the cell with the best metric, "results": path, "heatmap": path, "seconds"}``.

    Raises:
        ValueError: an empty or invalid grid (an L >= 0 or U <= 1, duplicates), ``jobs < 1``, unknown
            metric, an ``out_dir`` that is a file, under a file or not writable; FileNotFoundError /
            ValueError: a missing model or adapter folder. All raised before any trial runs.

    Cell folders of an earlier sweep in ``out_dir/cells/`` are removed first (only ``L<L>_U<U>``
    folders), so ``cells/`` matches ``results.json``.
    """
    from rich.progress import Progress

    from treadle.models.tiny import check_checkpoint, checkpoint_vocab_size
    from treadle.run_dirs import check_out_dir, make_out_dir
    from treadle.scale.training import ScaleTrainConfig

    config = config or ScaleTrainConfig()
    Ls, Us = [float(v) for v in Ls], [float(v) for v in Us]
    if not Ls or not Us:
        raise ValueError(f"the grid needs at least one L and one U, got Ls={Ls}, Us={Us}")
    for name, vals, ok, want in (("L", Ls, lambda v: v < 0, "< 0"), ("U", Us, lambda v: v > 1, "> 1")):
        bad = [v for v in vals if not math.isfinite(v) or not ok(v)]
        if bad:
            raise ValueError(f"every {name} must be finite and {want} (L < 0 < 1 < U), got {bad}")
        if len(set(vals)) != len(vals):
            raise ValueError(f"duplicate {name} values in {vals}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    cells = [(L, U) for L in Ls for U in Us]
    cores = os.cpu_count() or 1
    jobs = min(cores, len(cells) + 1) if jobs is None else jobs
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    check_out_dir(out_dir)
    check_checkpoint(model_path)
    adapter = Path(adapter).expanduser()
    if not adapter.exists():
        raise FileNotFoundError(f"adapter path {str(adapter)!r} does not exist "
                                f"(treadle scale sft writes <out>/adapter)")
    if not (adapter / "adapter_config.json").exists():
        raise ValueError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
    vocab = checkpoint_vocab_size(model_path) or config.k
    out = make_out_dir(out_dir)
    _clear_stale_cells(out)
    threads = max(1, cores // jobs) if jobs > 1 else 0
    base = dict(model=str(model_path), adapter=str(adapter), threads=threads, vocab=int(vocab))
    tasks = [dict(base, kind="baseline", config=dataclasses.asdict(config))]
    tasks += [dict(base, kind="cell", config=dataclasses.asdict(dataclasses.replace(config, L=L, U=U)),
                   out=str(out / "cells" / _cell_name(L, U))) for L, U in cells]
    say = console.print if console is not None else (lambda *a, **kw: None)
    say(f"sweep: {len(cells)} cells (L in {Ls}, U in {Us}) + the Stage-I baseline, {jobs} worker(s)"
        + (f" x {threads} thread(s)" if threads else ""), markup=False)
    t0 = time.perf_counter()
    results = []
    with Progress(console=console, disable=not progress or console is None, transient=True) as bar:
        job = bar.add_task("(L, U) cells", total=len(tasks))
        if jobs == 1:
            for t in tasks:
                results.append(_run_cell(t))
                bar.advance(job)
        else:
            # spawned workers start with Python's default warning filters: give them this process's (the
            # CLI silences third-party deprecation noise; a library caller's own filters apply alike)
            with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"),
                                        initializer=_inherit_warning_filters,
                                        initargs=(list(warnings.filters),)) as pool:
                futures = [pool.submit(_run_cell, t) for t in tasks]
                for f in cf.as_completed(futures):
                    f.result()
                    bar.advance(job)
                results = [f.result() for f in futures]
    baseline = results[0]
    cell_res = results[1:]
    for c in cell_res:
        c["delta_accuracy"] = c["accuracy_mean"] - baseline["accuracy_mean"]
    best = (max if metric == "accuracy_mean" else min)(cell_res, key=lambda c: c[metric])
    with open(out / "results.jsonl", "w") as fh:
        for c in [baseline] + cell_res:
            fh.write(json.dumps(c) + "\n")
    png = heatmap(cell_res, out / "heatmap.png", metric=metric, baseline=baseline[metric])
    summary = {"metric": metric, "Ls": Ls, "Us": Us, "config": dataclasses.asdict(config), "baseline": baseline,
               "cells": cell_res, "best": {"L": best["L"], "U": best["U"], metric: best[metric]},
               "seconds": time.perf_counter() - t0, "jobs": jobs, "results": str(out / "results.json"),
               "heatmap": str(png)}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    return summary

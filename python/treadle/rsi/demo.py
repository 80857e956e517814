"""``treadle demo`` section ``rsi``: the offline harness self-improvement loop with the embedded tiny
model as the fixed solver (a few rounds; difficulty curve PNG, verified problems JSONL, cost ledger).

Hook (in ``treadle/demo.py``'s SECTIONS): ``("rsi", "treadle.rsi.demo:run")``.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["run"]


def run(run_dir: Path, quick: bool, console) -> dict:
    """Run the section into ``run_dir`` (``quick``: the quick tiny model, 6 seeds, 2 rounds; else the
    default tiny model, 12 seeds, 3 rounds). Returns the run summary (see :func:`treadle.rsi.runs.run`)."""
    import torch
    from rich.table import Table

    from treadle.rsi.decontam import dedup, split_by_family
    from treadle.rsi.loop import LoopConfig
    from treadle.rsi.math_tasks import make_seeds
    from treadle.rsi.runs import SolverSpec
    from treadle.rsi.runs import run as run_rsi

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n, rounds = (6, 2) if quick else (12, 3)
        pool, _ = dedup(make_seeds(n + n // 2, 0))
        seeds, heldout = split_by_family(pool, 0.3, seed=0)
        summ = run_rsi(Path(run_dir), seeds, heldout, LoopConfig(rounds=rounds),
                       SolverSpec(name="tiny-model", args={"quick": quick}),
                       on_round=lambda r: console.print(
                           f"after round {r['round'] + 1}: fixed-solver accuracy {r['accuracy']:.3f}, "
                           f"{len(r['exports'])} verified, {len(r['repairs'])} repairs, "
                           f"harness v{r['harness'].version}", markup=False))
    finally:
        torch.set_num_threads(threads)
    t = Table(title="RSI difficulty curve (tiny-model accuracy on the fixed queue, 4 attempts)")
    t.add_column("round")
    t.add_column("accuracy")
    for i, a in enumerate(summ["curve"]):
        t.add_row(str(i), f"{a:.3f}")
    console.print(t)
    console.print(f"skills: {', '.join(summ['skills'])}", markup=False)
    console.print(f"transfer on held-out seeds (final accuracy): H_n {summ['transfer']['h_final']:.3f}, "
                  f"H_0 {summ['transfer']['h0']:.3f}", markup=False)
    console.print(f"-> {Path(run_dir) / 'problems.jsonl'}, {Path(run_dir) / 'curve.png'}", markup=False)
    return summ

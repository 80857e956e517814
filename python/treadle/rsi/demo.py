"""``treadle demo`` section ``rsi``: the offline harness self-improvement loop, a few rounds, twice:
with the embedded tiny model as the fixed solver (the issue's demo) and with the programmatic
capacity-limited solver (whose known limit makes the loop's mechanics visible even when the tiny model
solves almost nothing). Each run folder has the difficulty curve PNG, verified problems JSONL, the
harness versions and the cost ledger.

Hook (in ``treadle/demo.py``'s SECTIONS): ``("rsi", "treadle.rsi.demo:run")``.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["run"]


def run(run_dir: Path, quick: bool, console) -> dict:
    """Run the section into ``run_dir/<solver>`` (``quick``: the quick tiny model, 12 seeds, 2 rounds;
    else the default tiny model, 18 seeds, 3 rounds). Returns ``{solver: run summary}``."""
    import torch
    from rich.table import Table

    from treadle.rsi.decontam import dedup, split_by_family
    from treadle.rsi.loop import LoopConfig
    from treadle.rsi.math_tasks import make_seeds
    from treadle.rsi.runs import SolverSpec
    from treadle.rsi.runs import run as run_rsi

    n, rounds = (12, 2) if quick else (18, 3)
    pool, _ = dedup(make_seeds(n, 0))
    seeds, heldout = split_by_family(pool, 0.3, seed=0)
    solvers = {"tiny-model": SolverSpec(name="tiny-model", args={"quick": quick}), "capacity": SolverSpec()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name, spec in solvers.items():
            console.print(f"fixed solver: {name}; {len(seeds)} training seeds, {len(heldout)} held-out", markup=False)
            out[name] = run_rsi(Path(run_dir) / name, seeds, heldout, LoopConfig(rounds=rounds), spec,
                                on_round=lambda r: console.print(
                                    f"  after round {r['round'] + 1}: accuracy {r['accuracy']:.3f}, "
                                    f"{len(r['exports'])} verified, {len(r['repairs'])} repairs, "
                                    f"harness v{r['harness'].version}", markup=False))
    finally:
        torch.set_num_threads(threads)
    t = Table(title="RSI difficulty curve: fixed-solver accuracy on the fixed queue (4 attempts)")
    t.add_column("round")
    for name in out:
        t.add_column(name)
    for i in range(rounds + 1):
        t.add_row(str(i), *[f"{out[name]['curve'][i]:.3f}" for name in out])
    console.print(t)
    for name, summ in out.items():
        console.print(f"{name}: skills {', '.join(summ['skills'])}; held-out final accuracy H_n "
                      f"{summ['transfer']['h_final']:.3f} vs H_0 {summ['transfer']['h0']:.3f}; "
                      f"-> {Path(run_dir) / name / 'curve.png'}", markup=False)
    return out

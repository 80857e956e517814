"""Demo section ``weft-rollouts``: prefix-preserving vs end-to-end rejection sampling on the shop tasks.

The replay policy (gold calls, seeded perturbations at a fixed total rate) is sampled with both
methods at k = 1, 3, 5 on the same task set; the table shows accepted trajectories per policy call.
A second run crosses views and harnesses at k = 3. Writes each run folder (config, trajectories,
metrics, sft.jsonl) under ``run_dir``.
"""
from __future__ import annotations

from pathlib import Path

RATES = {"wrong_argument": 0.06, "skipped_call": 0.06, "extra_call": 0.06, "malformed_call": 0.06,
         "made_up_tool": 0.06}


def run(run_dir: Path, quick: bool, console) -> None:
    """Run the section (under 60 s on 2 CPU cores with ``quick``)."""
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample
    from treadle.weft.rollouts.metrics import plot_summary, print_table, summarize, write_jsonl
    from treadle.weft.rollouts.tasks import from_shop, replicate
    from treadle.weft.rollouts.tokens import write_sft

    run_dir = Path(run_dir)
    replicas = 4 if quick else 16
    policy = Component(name="replay", args={"rates": RATES, "seed": 0})
    cfg = SampleConfig(policy=policy, methods=("prefix", "end_to_end"), ks=(1, 3, 5), concurrency=4)
    trs = sample(run_dir / "methods", replicate(from_shop(), replicas), cfg)
    rows = summarize(trs)
    write_jsonl(rows, run_dir / "methods" / "metrics.jsonl")
    print_table(rows, console, title=f"rejection sampling, replay policy (total perturbation rate "
                                     f"{sum(RATES.values()):.2f}), {replicas}x shop tasks")
    plot_summary(rows, run_dir / "methods" / "summary.png")
    n = write_sft([t for t in trs if t.method == "prefix"], run_dir / "methods" / "sft.jsonl")
    all_rows = []
    for view, disclosure in (("agentic", "full"), ("simuser", "vague")):
        for harness in ("hermes", "react", "native", "openclaw"):
            sub = run_dir / f"{view}-{harness}"
            c = SampleConfig(view=Component(name=view), harness=Component(name=harness), policy=policy, ks=(3,))
            all_rows += summarize(sample(sub, replicate(from_shop(disclosure), 2 if quick else 4), c))
    write_jsonl(all_rows, run_dir / "views_harnesses.jsonl")
    print_table(all_rows, console, title="views x harnesses (prefix, k=3)")
    console.print(f"{n} accepted prefix-preserving trajectories -> {run_dir / 'methods' / 'sft.jsonl'}")

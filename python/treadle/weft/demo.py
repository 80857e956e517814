"""``treadle demo --sections weft-shop``: the shop tasks replayed through the runtime and verified.

Runs every task of :mod:`treadle.weft.envs.shop_tasks` with the gold policy and, as a control, a
policy that skips the first gold call of one turn; writes per-checkpoint verdicts and the per-tool
statistics as JSONL under the run folder and prints a table.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio


async def _run_tasks(skip: tuple[str, int] | None) -> tuple[list[dict[str, Any]], Any]:
    from treadle.weft.envs import shop, shop_tasks
    from treadle.weft.runtime.episode import run_atomic_episode
    from treadle.weft.runtime import Runtime

    rows: list[dict[str, Any]] = []
    async with Runtime() as rt:
        h = rt.register(shop)
        for task in shop_tasks.tasks():
            def policy(k: int, _hist: list, task=task) -> list[str]:
                calls = list(task.turns[k].gold)
                if skip is not None and skip[0] == task.name and skip[1] == k and calls:
                    calls = calls[1:]
                return calls

            sid = await rt.create_session(h, shop.initial_snapshot())
            ep = await run_atomic_episode(rt, sid, [t.checkpoint for t in task.turns], policy)
            for k, r in enumerate(ep.results):
                rows.append({"task": task.name, "turn": k, "checkpoint": r.name, "r": r.r,
                             "reasons": [x.value for x in r.reasons], "policy_failure": r.policy_failure,
                             "calls": [str(o.call) for o in ep.outcomes[k]], "R": ep.reward})
            await rt.close(sid)
        return rows, rt.stats


def run_shop_tasks(run_dir: Path, *, skip: tuple[str, int] | None = None, console=None) -> list[dict[str, Any]]:
    """Run the shop tasks (gold policy, optionally skipping the first call of ``skip = (task, turn)``).

    Writes ``checkpoints.jsonl`` and ``tool_stats.jsonl`` under ``run_dir``; returns the checkpoint rows.
    """
    rows, stats = anyio.run(_run_tasks, skip)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    stats.export_jsonl(run_dir / "tool_stats.jsonl")
    if console is not None:
        from rich.table import Table

        t = Table(title=f"shop tasks{'' if skip is None else f' (skipping a call in {skip[0]} turn {skip[1]})'}")
        for col in ("task", "turn", "checkpoint", "r_k", "reasons", "R(task)"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["task"], str(r["turn"]), r["checkpoint"], str(r["r"]), ",".join(r["reasons"]), f"{r['R']:.2f}")
        console.print(t)
    return rows


def run(run_dir: Path, quick: bool, console) -> None:
    """Demo section: gold replay (all r_k = 1) and the skip-one-call control (exactly one r_k = 0)."""
    gold = run_shop_tasks(Path(run_dir) / "gold", console=console)
    skipped = run_shop_tasks(Path(run_dir) / "skip", skip=("ada-replacement", 1), console=console)
    console.print(f"gold: {sum(r['r'] for r in gold)}/{len(gold)} checkpoints pass; "
                  f"skip control: {sum(1 - r['r'] for r in skipped)} checkpoint(s) fail")

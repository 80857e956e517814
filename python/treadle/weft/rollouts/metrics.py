"""Metrics of a set of trajectories, per (env, view, harness, policy, method, k): acceptance rate,
accepted trajectories per policy call, tool-call error rate of the selected (accepted) paths
including errors the policy recovered from, and mean checkpoint reward ``R``."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treadle.weft.rollouts.records import Trajectory


def env_group(env: str) -> str:
    """The environment a metrics row is about: ``bfcl:<category>:<entry id>`` rolls up to ``bfcl:<category>``."""
    return env.rsplit(":", 1)[0] if env.startswith("bfcl:") and env.count(":") >= 2 else env


def group_key(t: Trajectory) -> tuple:
    rates = t.policy["args"].get("rates", {}) if t.policy["name"] == "replay" else {}
    pol = t.policy["name"] + (f"(p={sum(rates.values()):.2f})" if t.policy["name"] == "replay" else
                              f":{t.policy['args'].get('model', '?')}" if t.policy["name"] == "llm" else "")
    return (env_group(t.env), t.view["name"], t.harness["name"], pol, t.method, t.k)


def selected_call_errors(t: Trajectory) -> tuple[int, int]:
    """(failed calls, all calls) on the selected path (unparseable and unknown-tool calls count)."""
    bad = n = 0
    for i in t.selected:
        for st in t.attempts[i].steps:
            for c in st.calls:
                n += 1
                bad += not c.ok
    return bad, n


def summarize(trajs: Sequence[Trajectory]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(group_key(t), []).append(t)
    rows = []
    for key in sorted(groups, key=str):
        g = groups[key]
        acc = [t for t in g if t.accepted]
        calls = sum(t.policy_calls for t in g)
        bad = n = 0
        for t in acc:
            b, c = selected_call_errors(t)
            bad, n = bad + b, n + c
        rows.append({"env": key[0], "view": key[1], "harness": key[2], "policy": key[3], "method": key[4], "k": key[5],
                     "trajectories": len(g), "accepted": len(acc), "acceptance": len(acc) / len(g),
                     "policy_calls": calls, "accepted_per_call": len(acc) / calls if calls else 0.0,
                     "tool_error_rate_selected": bad / n if n else 0.0,
                     "mean_reward": sum(t.reward for t in g) / len(g),
                     "failures": sum(t.failure is not None for t in g)})
    return rows


def write_jsonl(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    p = Path(path)
    tmp = p.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(p)


def print_table(rows: Sequence[dict[str, Any]], console: Any, title: str = "rejection sampling") -> None:
    from rich.table import Table

    t = Table(title=title)
    cols = ("env", "view", "harness", "policy", "method", "k", "accepted", "policy_calls", "accepted_per_call",
            "tool_error_rate_selected", "mean_reward")
    for c in cols:
        t.add_column(c.replace("_", " "))
    for r in rows:
        t.add_row(*(f"{r[c]:.3f}" if isinstance(r[c], float) else
                    (f"{r['accepted']}/{r['trajectories']}" if c == "accepted" else str(r[c])) for c in cols))
    console.print(t)


def plot_summary(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """PNG: accepted trajectories per policy call and acceptance rate, per (method, k), one panel each."""
    from treadle.figures import png_figure

    p = Path(path)
    labels = [f"{r['view']}/{r['harness']}\n{r['method']} k={r['k']}" for r in rows]
    with png_figure(p, figsize=(9, 3.2), dpi=120, ncols=2) as (_, axes):
        for ax, key, title in ((axes[0], "accepted_per_call", "accepted trajectories per policy call"),
                               (axes[1], "acceptance", "acceptance rate")):
            ax.bar(range(len(rows)), [r[key] for r in rows],
                   color=["tab:blue" if r["method"] == "prefix" else "tab:orange" for r in rows])
            ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=60, ha="right")
            ax.set_title(title, fontsize=9)
    return p

"""Demo section ``weft-rl``: a small GRPO comparison on the tiny tool policy (atomic-turn vs trajectory).

One seed per grouping, a few steps, a small held-out set: the full comparison (3 seeds, 16 steps) is
``treadle weft train``. ``quick`` uses the seconds-long quick tool policy (a weak model: the numbers
are a smoke test). Writes ``summary.json``, ``curves.png`` and per-run ``steps.jsonl`` under ``run_dir``.
"""
from __future__ import annotations

from pathlib import Path


def run(run_dir: Path, quick: bool, console) -> dict:
    """Run the section (see the module docstring)."""
    from treadle.weft.rl.report import run_comparison
    from treadle.weft.rl.sft import ToolTrainConfig, load_tool_model, tool_slot

    cfg = ToolTrainConfig.quick() if quick else ToolTrainConfig()
    policy = load_tool_model(None, config=cfg, console=console, name=tool_slot(None, quick).name)
    small = {} if quick else {"turns_per_step": 4, "G": 4, "eval_episodes": 6, "max_new_tokens": 40, "max_steps": 4,
                              "sampling_rounds": 3}  # dynamic sampling, as the full runs
    return run_comparison(Path(run_dir), policy, ("atomic", "trajectory"), [0], steps=2 if quick else 3,
                          quick=True, console=console, overrides=small)

"""Demo section ``weft-rl``: a small GRPO comparison on the tiny tool policy (atomic-turn vs trajectory groups)
on ``trl.GRPOTrainer`` (:func:`treadle.weft.rl.trl_run.run_trl`).

One seed per grouping, a few steps, a small held-out set: the full comparison (3 seeds, 16 steps) is
``treadle weft train --grouping both``. ``quick`` uses the seconds-long quick tool policy (a weak model: the
numbers are a smoke test). Writes ``summary.json`` and one ``<grouping>-seed0/`` run per grouping (TRL's
checkpoints, ``summary.json``) under ``run_dir``.
"""
from __future__ import annotations

from pathlib import Path


def run(run_dir: Path, quick: bool, console) -> dict:
    """Run the section (see the module docstring)."""
    from treadle.weft.rl.sft import ToolTrainConfig, load_tool_model, tool_slot
    from treadle.weft.rl.trl_run import run_trl

    cfg = ToolTrainConfig.quick() if quick else ToolTrainConfig()
    policy = load_tool_model(None, config=cfg, console=console, name=tool_slot(None, quick).name)
    small = {} if quick else {"turns_per_step": 4, "G": 4, "eval_episodes": 6, "max_new_tokens": 40, "max_steps": 4}
    return run_trl(Path(run_dir), policy, [0], steps=2 if quick else 3, quick=True, console=console,
                   overrides=small, groupings=("atomic", "trajectory"))

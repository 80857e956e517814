"""What an interrupted SCALE Stage-II run (SCALE sec. 4.3) needs to resume: the settings a checkpoint must
share with the run that resumes it (:func:`checkpoint_config`, recorded in the run folder's
``stage_two.json``) and the part of ``log.jsonl`` a checkpoint holds (:func:`truncate_log`).

The checkpoints themselves are ``transformers.Trainer``'s (``checkpoint-<step>/``: the gates in
``trainable.safetensors``, the optimizer, scheduler, RNG and trainer state), written by the main process
and resumed on any number of ranks (:mod:`treadle.scale.trainer`). What may differ on resume: ``epochs``
(more epochs continue the same data order) and the world size; anything else refuses the resume.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["RESUMABLE", "checkpoint_config", "truncate_log"]

RESUMABLE = ("epochs",)  # config keys that may differ between a checkpoint and the run resuming it


def checkpoint_config(config, k: int, base_model: str | None = None) -> dict:
    """The settings a checkpoint must share with the run that resumes it: the config (JSON types), the
    ``k`` actually used and the base model's ``name_or_path``, without :data:`RESUMABLE` keys."""
    import dataclasses

    cfg = json.loads(json.dumps({**dataclasses.asdict(config), "k_used": k, "base_model": base_model}))
    return {key: v for key, v in cfg.items() if key not in RESUMABLE}


def truncate_log(path: Path, step: int) -> None:
    """Keep what a checkpoint at ``step`` steps holds of a Stage-II ``log.jsonl``: the records before the
    first step (config, the evaluation before training) and the step records ``< step`` (0-based), so
    that the resumed run logs every step once. Cut lines (an interrupt while writing) are dropped."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("type") == "step":
            if rec.get("step", step) < step:
                keep.append(line + "\n")
        elif rec.get("type") in ("config", "resume") or (rec.get("type") == "eval" and rec.get("when") == "before"):
            keep.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)

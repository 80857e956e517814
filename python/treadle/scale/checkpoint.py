"""Stage-II checkpoints: the gates and the optimizer after a step, so that an interrupted SCALE Stage-II run
(SCALE sec. 4.3) resumes where it stopped, in one process or on any number of ranks (issue 18).

A run folder's ``checkpoint/`` holds

* ``gates.safetensors``: the gates, in :func:`treadle.scale.save_gates`'s format (full tensors: loadable
  with :func:`treadle.scale.load_gates` by any process);
* ``trainer_state.pt``: ``step`` (optimizer steps done), ``optim`` (Adam's state in the single-process
  format, full tensors, parameters in gate order), ``param_names``, ``losses`` (the logged loss of every
  step done), the evaluation before training (``objective_before``, ``before``), ``config`` (the settings
  that change the result) and ``world_size`` (of the run that wrote it; informational).

It is written by one process (rank 0) into ``checkpoint.tmp/`` and then moved into place, so an
interrupt while writing leaves the previous checkpoint. What may differ on resume: ``epochs`` (more
epochs continue the same data order) and the world size; anything else in ``config`` refuses the resume.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

__all__ = ["CHECKPOINT", "RESUMABLE", "checkpoint_config", "read_checkpoint", "write_checkpoint", "truncate_log"]

CHECKPOINT = "checkpoint"
RESUMABLE = ("epochs",)  # config keys that may differ between a checkpoint and the run resuming it


def checkpoint_config(config, k: int, base_model: str | None = None) -> dict:
    """The settings a checkpoint must share with the run that resumes it: the config (JSON types), the
    ``k`` actually used and the base model's ``name_or_path``, without :data:`RESUMABLE` keys."""
    import dataclasses

    cfg = json.loads(json.dumps({**dataclasses.asdict(config), "k_used": k, "base_model": base_model}))
    return {key: v for key, v in cfg.items() if key not in RESUMABLE}


def read_checkpoint(out_dir: str | Path, config: dict) -> dict | None:
    """The trainer state of ``out_dir/checkpoint`` (None when there is no complete checkpoint).

    Args:
        config: :func:`checkpoint_config` of the run that wants to resume.

    Raises:
        ValueError: the checkpoint is unreadable, or holds a run with another config (the differing
            keys are named); nothing is changed.
    """
    d = Path(out_dir) / CHECKPOINT
    if not ((d / "gates.safetensors").is_file() and (d / "trainer_state.pt").is_file()):
        return None
    try:
        state = torch.load(d / "trainer_state.pt", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say which and stop
        raise ValueError(f"cannot read the Stage-II checkpoint {d / 'trainer_state.pt'} ({type(err).__name__}: "
                         f"{err}); delete {d} to start afresh") from None
    old = state.get("config") or {}
    if old != config:
        diff = [f"{k}: {old.get(k, '<absent>')!r} -> {config.get(k, '<absent>')!r}"
                for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k)]
        raise ValueError(f"{Path(out_dir)} holds a Stage-II checkpoint of another config ({'; '.join(diff[:6])}); "
                         f"use the same settings to resume it, resume=False to start afresh (it is replaced), or "
                         f"another out_dir")
    return state


def write_checkpoint(out_dir: str | Path, peft_model, full_gates: dict, state: dict) -> Path:
    """Write ``checkpoint/`` (one process: rank 0). ``full_gates``: gated-layer name -> {parameter name:
    full CPU tensor} (:func:`treadle.distributed.parallel.full_tensor` of every gate); ``state``: the
    trainer state (see the module doc)."""
    import contextlib

    from treadle.distributed.parallel import full_parameters
    from treadle.scale.gates import gated_layers, save_gates

    out = Path(out_dir)
    tmp, final, old = out / f"{CHECKPOINT}.tmp", out / CHECKPOINT, out / f"{CHECKPOINT}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        for name, m in gated_layers(peft_model).items():
            stack.enter_context(full_parameters(m, full_gates[name]))
        save_gates(peft_model, tmp / "gates.safetensors")
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


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

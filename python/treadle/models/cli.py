"""``treadle model ...``: train and inspect the embedded tiny model.

    treadle model train-tiny [--out DIR] [--steps N] [--seed S] [--quick] [--overwrite]
    treadle model eval [PATH] [--per-level N]

``--quick`` trains the seconds-long smoke model into its own slot (``tiny-qwen3-quick``), never into the
default ``tiny-qwen3`` that every default command uses. A slot holding a model of the same settings is
kept (its accuracy shown), one of other settings is refused, and ``--overwrite`` retrains.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer

from treadle.cli_checks import build_config
from treadle.cli_models import MAX_THREADS, THREADS_HELP
from treadle.cli_output import make_console, progress_enabled
from treadle.cli_runs import usage_error

app = typer.Typer(help="Embedded default models (tiny Qwen3 trained locally; any local HF checkpoint instead).",
                  no_args_is_help=True, add_completion=False)
console = make_console()


def _slot(out: Path | None, quick: bool) -> Path:
    from treadle.cli_models import QUICK_SLOT
    from treadle.models.tiny import DEFAULT_NAME, cache_root

    return Path(out).expanduser() if out is not None else cache_root() / (QUICK_SLOT if quick else DEFAULT_NAME)


@app.command("train-tiny")
def train_tiny_cmd(
    out: Path = typer.Option(None, "--out", help="Checkpoint folder (default: $TREADLE_CACHE/tiny-qwen3 or "
                                                 "~/.cache/treadle/tiny-qwen3; --quick: .../tiny-qwen3-quick)."),
    seed: int = typer.Option(0, help="Seed (same seed -> same weights)."),
    steps: int = typer.Option(None, min=1, help="Optimizer steps, >= 1 (default: the TinyTrainConfig default)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Retrain even if the folder holds a checkpoint."),
    force: bool = typer.Option(False, "--force", hidden=True, help="Old name of --overwrite."),
    quick: bool = typer.Option(False, help="Seconds-long smoke setting (a weak model), in its own cache slot."),
    threads: int = typer.Option(1, min=0, max=MAX_THREADS,
                                help="torch CPU threads (0: leave as is; 1 suits the tiny model's GEMMs, as in the "
                                     f"STAIR and SCALE demos; at most this machine's {MAX_THREADS} CPUs)."),
    progress: bool = typer.Option(True, help="Show a progress bar (on a terminal)."),
    task: str = typer.Option("math", "--task", help="math (generated problems) or tools (the WEFT shop tool "
                                                    "policy, slot tiny-qwen3-tools)."),
) -> None:
    """Train the tiny Qwen3 LM (math: generated problems; tools: the WEFT shop tool policy); print held-out
    results."""
    if task not in ("math", "tools"):
        raise usage_error(f"--task must be math or tools, got {task!r}")
    from treadle.models.tiny import (CheckpointError, TinyTrainConfig, accuracy_table, check_checkpoint,
                                     refuse_foreign_folder, train_tiny)
    from treadle.run_dirs import check_out_dir

    overwrite = overwrite or force
    if task == "tools":
        from treadle.weft.rl.sft import ToolTrainConfig, tool_slot, train_tool_policy

        cls, train, dest, what = ToolTrainConfig, train_tool_policy, tool_slot(out, quick), "tool policy"
    else:
        cls, train, dest, what = TinyTrainConfig, train_tiny, _slot(out, quick), "tiny model"
    cfg = build_config(cls.quick if quick else cls, {}, seed=seed, steps=steps)
    try:
        check_out_dir(dest, "--out")
        check_out_dir(dest.parent, "--out")  # the lock file lives next to the folder
    except ValueError as err:
        raise usage_error(str(err)) from None
    if overwrite:
        try:
            refuse_foreign_folder(dest)
        except CheckpointError as err:
            raise usage_error(f"--out {str(dest)!r}: {err}") from None
    if dest.exists() and not overwrite:
        try:
            info = check_checkpoint(dest, require_marker=True) or {}
        except CheckpointError as err:
            raise usage_error(f"--out {str(dest)!r}: {err}") from None
        fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg.model_dump()  # pydantic model too
        want = json.loads(json.dumps(fields))
        if info.get("config") not in (None, want):
            diff = sorted(k for k in set(want) | set(info["config"]) if want.get(k) != info["config"].get(k))
            raise usage_error(f"--out {str(dest)!r} holds a {what} trained with other settings (differs in "
                              f"{', '.join(diff)}); add --overwrite to retrain it, or give another --out")
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        result = train(cfg, dest, force=overwrite, progress=progress_enabled(progress), console=console)
    except CheckpointError as err:
        raise usage_error(f"--out {str(dest)!r}: {err}") from None
    except KeyboardInterrupt:
        console.print(f"Interrupted. Saved: nothing ({dest} is written only when training ends; a previous "
                      f"checkpoint there is untouched); rerun the same command to train again.", markup=False)
        raise typer.Exit(130) from None
    if result.seconds == 0.0:
        console.print(f"{result.path} already holds this model (same settings); add --overwrite to retrain",
                      markup=False)
        if task == "tools":
            console.print(f"recorded held-out success: {json.dumps(result.accuracy)}", markup=False)
        else:
            console.print(accuracy_table(result.accuracy, title="held-out greedy accuracy (recorded at training time)"))


@app.command("eval")
def eval_cmd(
    path: str = typer.Argument(None, help="Local HF checkpoint (default: $TREADLE_MODEL, else the cached tiny model)."),
    model_opt: str = typer.Option(None, "--model", show_default=False,
                                  help="The checkpoint, as every other command names it (same as PATH)."),
    per_level: int = typer.Option(100, min=1, help="Held-out problems per level, >= 1."),
    seed: int = typer.Option(0, help="Seed of the held-out problems."),
    threads: int = typer.Option(None, min=0, max=MAX_THREADS, help=THREADS_HELP),
) -> None:
    """Greedy held-out accuracy per difficulty level of a checkpoint (answers checked with math-verify)."""
    from treadle.cli_models import load_model
    from treadle.data.arithmetic import LEVELS, ProblemGenerator
    from treadle.models.generation import accuracy_by_level
    from treadle.models.tiny import accuracy_table

    if path is not None and model_opt is not None and path != model_opt:
        raise usage_error(f"--model: give the checkpoint once: PATH {path!r} and --model {model_opt!r} differ")
    source = "--model" if model_opt is not None else "PATH"
    path = model_opt if model_opt is not None else path
    model, tokenizer = load_model(path, False, console, threads=threads, train_if_missing=False, source=source)
    gen = ProblemGenerator(seed + 10_007)
    sets = {lv: gen.batch(lv, per_level, split="heldout") for lv in range(1, len(LEVELS) + 1)}
    console.print(accuracy_table(accuracy_by_level(model, tokenizer, sets),
                                 title=f"held-out greedy accuracy: {path or 'tiny-qwen3'}"))

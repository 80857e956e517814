"""``treadle model ...``: train and inspect the embedded tiny model."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Embedded default models (tiny Qwen3 trained locally; any local HF checkpoint instead).",
                  no_args_is_help=True, add_completion=False)
console = Console()


@app.command("train-tiny")
def train_tiny_cmd(
    out: Path = typer.Option(None, help="Checkpoint folder (default: $TREADLE_CACHE/tiny-qwen3 or "
                                        "~/.cache/treadle/tiny-qwen3)."),
    seed: int = typer.Option(0, help="Seed (same seed -> same weights)."),
    steps: int = typer.Option(None, help="Optimizer steps (default: the TinyTrainConfig default)."),
    force: bool = typer.Option(False, "--force", help="Retrain even if a complete checkpoint exists."),
    quick: bool = typer.Option(False, help="Seconds-long smoke setting (a weak model)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Train the tiny Qwen3 LM on generated problems; print held-out accuracy per difficulty level."""
    from treadle.models.tiny import CheckpointError, TinyTrainConfig, accuracy_table, train_tiny

    kw = {"seed": seed} if steps is None else {"seed": seed, "steps": steps}
    cfg = TinyTrainConfig.quick(**kw) if quick else TinyTrainConfig(**kw)
    try:
        result = train_tiny(cfg, out, force=force, progress=progress, console=console)
    except CheckpointError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    if result.seconds == 0.0:
        console.print(f"[green]{result.path} already holds a complete checkpoint[/green] (use --force to retrain)")
        console.print(accuracy_table(result.accuracy, title="held-out greedy accuracy (recorded at training time)"))


@app.command("eval")
def eval_cmd(
    path: str = typer.Argument(None, help="Local HF checkpoint (default: the cached tiny model)."),
    per_level: int = typer.Option(100, help="Held-out problems per level."),
    seed: int = typer.Option(0, help="Seed of the held-out problems."),
) -> None:
    """Greedy held-out accuracy per difficulty level of a checkpoint (answers checked with math-verify)."""
    from treadle.data.arithmetic import LEVELS, ProblemGenerator
    from treadle.models.generation import accuracy_by_level
    from treadle.models.tiny import CheckpointError, accuracy_table, load_default_model

    try:
        model, tokenizer = load_default_model(path, train_if_missing=False)
    except (CheckpointError, FileNotFoundError) as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    gen = ProblemGenerator(seed + 10_007)
    sets = {lv: gen.batch(lv, per_level, split="heldout") for lv in range(1, len(LEVELS) + 1)}
    console.print(accuracy_table(accuracy_by_level(model, tokenizer, sets), title=f"held-out greedy accuracy: {path or 'tiny-qwen3'}"))

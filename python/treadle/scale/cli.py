"""``treadle scale ...``: SCALE Stage I (LoRA SFT), Stage II (gate training) and (L, U) sweeps.

    treadle scale sft   [--model PATH] [--steps N] [--out runs/scale/sft]
    treadle scale train [--model PATH] [--adapter DIR] [--L -2 --U 2 --tau 1 --k 100] [--no-reverse]
                        [--no-extrapolate] [--objective entropy|ce] [--responses dataset|sampled]
    treadle scale sweep [--model PATH] [--adapter DIR] [--Ls=-4,-2,-0.5] [--Us 1.5,2,4] [--jobs N]

With no arguments each runs on the embedded tiny model (``train`` and ``sweep`` first run a short
Stage I when no ``--adapter`` is given). Bad input exits with code 2 and a message, before any work.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from treadle.cli_lists import parse_list

app = typer.Typer(help="SCALE: per-token gated LoRA (Stage I LoRA SFT, Stage II gate training, (L, U) sweeps).",
                  no_args_is_help=True, add_completion=False)
console = Console()

_ERRORS = (ValueError, TypeError, FileNotFoundError)


# config field -> CLI flag, so that messages of SFTConfig / ScaleTrainConfig name what the user typed
_FLAGS = {"lora_alpha": "--alpha", "target_modules": "--target-modules", "r": "--r", "L": "--L", "U": "--U"}


def _flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _cli_words(text: str) -> str:
    """Config-field wording -> CLI flags: ``SFTConfig.r`` -> ``--r``, ``objective='ce'`` -> ``--objective ce``."""
    text = re.sub(r"\b(?:SFTConfig|ScaleTrainConfig|GateConfig)\.(\w+)", lambda m: _flag(m.group(1)), text)
    return re.sub(r"\b(objective|responses)='(\w+)'", lambda m: f"{_flag(m.group(1))} {m.group(2)}", text)


def _fail(err, flags: bool = False) -> None:
    """Print ``err`` on one red line (literally: brackets in paths and lists are kept) and exit 2."""
    text = str(err)
    if flags:
        text = _cli_words(text)
    console.print(escape(text), style="red")
    raise typer.Exit(2)


def _check_out(out: Path, opt: str = "--out") -> Path:
    """Exit 2 naming ``opt`` when ``out`` cannot be a run folder (a file, under a file, not writable)."""
    from treadle.run_dirs import check_out_dir

    try:
        return check_out_dir(out, opt)
    except ValueError as err:
        _fail(err)


def _load(model_path, quick: bool, threads: int = 0):
    """``(model, tokenizer)``: ``model_path``, else ``$TREADLE_MODEL``, else the embedded tiny model
    (``--quick``: the seconds-long quick one). Exits 2 on a bad checkpoint."""
    import torch

    from treadle.models.tiny import CheckpointError, TinyTrainConfig, load_default_model

    from safetensors import SafetensorError

    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = TinyTrainConfig.quick() if quick else None
        name = "tiny-qwen3-quick" if quick and model_path is None else "tiny-qwen3"
        model, tok = load_default_model(model_path, config=cfg, name=name, console=console, progress=False)
    except (CheckpointError, FileNotFoundError) as err:
        _fail(err)
    except SafetensorError as err:  # a damaged plain HF checkpoint (no treadle manifest to catch it earlier)
        files = sorted(str(f) for f in Path(model_path or ".").expanduser().glob("*.safetensors")) or [str(model_path)]
        _fail(f"could not read the model weights {', '.join(files)} (truncated or not a safetensors file?): {err}")
    if torch.cuda.is_available():
        model = model.cuda()
    return model, tok


def _sft_config(quick: bool, **given):
    from treadle.scale.sft import SFTConfig

    kw = {k: v for k, v in given.items() if v is not None}
    return SFTConfig.quick(**kw) if quick else SFTConfig(**kw)


def _base_of(adapter: Path):
    """The base model folder recorded in a PEFT adapter, else None (nothing recorded). Exits 2 when the
    recorded base is not a local folder: running on another model would be silently wrong."""
    try:
        base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if not base:
        return None
    if not Path(base).expanduser().is_dir():
        _fail(f"the adapter {adapter} was trained on base model {base!r}, which is not a local folder here; "
              f"pass the base model's checkpoint folder with --model")
    return base


def _check_adapter(adapter: Path) -> None:
    if not adapter.exists():
        _fail(f"adapter path {str(adapter)!r} does not exist; run `treadle scale sft` (it writes <out>/adapter) "
              f"or give a PEFT LoRA adapter folder")
    if not (adapter / "adapter_config.json").exists():
        _fail(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")


def _stage_one(model_path, quick: bool, adapter, out: Path, threads: int):
    """``(peft model, tokenizer, adapter folder, base model folder)``: load ``adapter`` onto the base, or
    run a default Stage I into ``out / "sft"`` when no adapter is given."""
    from treadle.scale.sft import sft
    from treadle.scale.training import load_stage_one

    if adapter is not None:
        adapter = Path(adapter).expanduser()
        _check_adapter(adapter)
        if model_path is None:
            model_path = _base_of(adapter)
            if model_path is not None:
                console.print(f"base model (from the adapter's config): {model_path}", markup=False)
    model, tok = _load(model_path, quick, threads)
    if adapter is None:
        console.print(f"no --adapter: running Stage I first ({'quick' if quick else 'default'} settings) into "
                      f"{out / 'sft'}", markup=False)
        res = sft(model, tok, _sft_config(quick), out / "sft", console=console)
        return res.model, tok, res.adapter_path, model.name_or_path
    return load_stage_one(model, adapter), tok, adapter, model.name_or_path


@app.command("sft")
def sft_cmd(
    model_path: str = typer.Option(None, "--model", help="Local HF checkpoint (default: the embedded tiny model)."),
    steps: int = typer.Option(None, help="Optimizer steps (default 60; --quick 6)."),
    batch_size: int = typer.Option(None, help="Problems per step (default 32; --quick 8)."),
    lr: float = typer.Option(None, help="AdamW learning rate (default 2e-3)."),
    r: int = typer.Option(None, "--r", help="LoRA rank (SCALE: 16)."),
    alpha: float = typer.Option(None, "--alpha", help="LoRA alpha (SCALE: 16)."),
    target_modules: str = typer.Option("all-linear", help="'all-linear' (every nn.Linear but the output head, "
                                                          "so Stage II can gate each LoRA layer; MoE routers "
                                                          "and fused experts are left out) or comma-separated "
                                                          "module names."),
    levels: str = typer.Option("1,2,3", help="Difficulty levels of the worked problems (treadle.data)."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(Path("runs/scale/sft"), help="Run folder (adapter/, log.jsonl, summary.json)."),
    threads: int = typer.Option(1, min=0, help="torch CPU threads (0: leave as is; 1 suits tiny models)."),
    quick: bool = typer.Option(False, help="Quick settings (and the quick tiny model when no --model)."),
) -> None:
    """Stage I: ordinary LoRA SFT through PEFT (r=16, alpha=16, all linear layers) on worked problems."""
    from treadle.scale.sft import sft

    tm = target_modules if target_modules == "all-linear" else tuple(m.strip() for m in target_modules.split(",")
                                                                     if m.strip())
    try:
        cfg = _sft_config(quick, steps=steps, batch_size=batch_size, lr=lr, r=r, lora_alpha=alpha, target_modules=tm,
                          levels=parse_list(levels, "--levels"), seed=seed)
    except _ERRORS as err:
        _fail(err, flags=True)
    _check_out(out)
    model, tok = _load(model_path, quick, threads)
    try:
        res = sft(model, tok, cfg, out, console=console)
    except _ERRORS as err:
        _fail(err, flags=True)
    console.print(f"next: treadle scale train --adapter {res.adapter_path}" + (" --quick" if quick else ""),
                  markup=False)


def _train_config(quick: bool, **given):
    from treadle.scale.training import ScaleTrainConfig

    kw = {k: v for k, v in given.items() if v is not None}
    return ScaleTrainConfig.quick(**kw) if quick else ScaleTrainConfig(**kw)


@app.command("train")
def train_cmd(
    model_path: str = typer.Option(None, "--model", help="Base model checkpoint (default: the adapter's base, "
                                                         "else the embedded tiny model)."),
    adapter: Path = typer.Option(None, help="Stage-I PEFT LoRA adapter folder (default: run a short Stage I "
                                            "first into <out>/sft)."),
    L: float = typer.Option(-2.0, "--L", help="lambda's lower end, < 0."),
    U: float = typer.Option(2.0, "--U", help="lambda's upper end, > 1."),
    tau: float = typer.Option(1.0, help="Gate temperature, > 0."),
    k: int = typer.Option(100, help="Top-k of the entropy objective (SCALE: 100), >= 2."),
    lr: float = typer.Option(None, help="Adam learning rate of the gates (default 1e-3)."),
    epochs: int = typer.Option(None, help="Passes over the training responses (default 2; --quick 1)."),
    batch_size: int = typer.Option(None, help="Rows per step (default 32; --quick 8)."),
    train_size: int = typer.Option(None, help="Training prompts (default 256; --quick 16)."),
    levels: str = typer.Option("1,2,3", help="Difficulty levels of the training prompts."),
    responses: str = typer.Option("dataset", help="'dataset' (verified answers) or 'sampled' (Stage-I samples)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature for --responses sampled."),
    objective: str = typer.Option("entropy", help="'entropy' (SCALE) or 'ce' (CE-calibration ablation)."),
    no_reverse: bool = typer.Option(False, "--no-reverse", help="Ablation: lambda = max(lambda, 0)."),
    no_extrapolate: bool = typer.Option(False, "--no-extrapolate", help="Ablation: lambda = min(lambda, 1)."),
    eval_levels: str = typer.Option(None, help="Held-out levels (default 1,2,3; --quick 1)."),
    eval_size: int = typer.Option(None, help="Held-out problems per level (default 32; --quick 4)."),
    max_new_tokens: int = typer.Option(None, help="Completion budget (default 10; --quick 6)."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(Path("runs/scale/train"), help="Run folder (log.jsonl, summary.json, "
                                                            "gates.safetensors, lambda_hist.png)."),
    threads: int = typer.Option(1, min=0, help="torch CPU threads (0: leave as is; 1 suits tiny models)."),
    quick: bool = typer.Option(False, help="Quick settings (and the quick tiny model when no --model)."),
) -> None:
    """Stage II: train only the gates on the normalised top-k entropy over response positions."""
    from treadle.scale.training import summary_tables, train

    try:
        cfg = _train_config(quick, L=L, U=U, tau=tau, k=k, lr=lr, epochs=epochs, batch_size=batch_size,
                            train_size=train_size, levels=parse_list(levels, "--levels"), responses=responses,
                            temperature=temperature, objective=objective, no_reverse=no_reverse,
                            no_extrapolate=no_extrapolate,
                            eval_levels=(parse_list(eval_levels, "--eval-levels") if eval_levels is not None
                                         else None),
                            eval_size=eval_size, max_new_tokens=max_new_tokens, seed=seed)
    except _ERRORS as err:
        _fail(err, flags=True)
    _check_out(out)
    try:
        pm, tok, adapter_dir, _ = _stage_one(model_path, quick, adapter, out, threads)
        summary = train(pm, tok, cfg, out, console=console, progress=True)
    except _ERRORS as err:
        _fail(err, flags=True)
    for t in summary_tables(summary):
        console.print(t)
    console.print(f"gates: {summary['gates']} | lambda histogram: {summary['histogram']} | log: {out / 'log.jsonl'}",
                  markup=False)


@app.command("sweep")
def sweep_cmd(
    model_path: str = typer.Option(None, "--model", help="Base model checkpoint (default: the adapter's base, "
                                                         "else the embedded tiny model)."),
    adapter: Path = typer.Option(None, help="Stage-I adapter shared by all cells (default: run a short Stage I "
                                            "first into <out>/sft)."),
    Ls: str = typer.Option("-4,-2,-0.5", "--Ls", help="Lower ends, each < 0 (write --Ls=-6,-4,-2,-0.5)."),
    Us: str = typer.Option("1.5,2,4", "--Us", help="Upper ends, each > 1."),
    jobs: int = typer.Option(None, help="Parallel worker processes (default min(cores, cells))."),
    metric: str = typer.Option("accuracy_mean", help="Heatmap metric: accuracy_mean or entropy."),
    tau: float = typer.Option(1.0, help="Gate temperature, > 0."),
    k: int = typer.Option(100, help="Top-k of the entropy objective, >= 2."),
    lr: float = typer.Option(None, help="Adam learning rate of the gates (default 1e-3)."),
    epochs: int = typer.Option(1, help="Passes over the training responses per cell."),
    train_size: int = typer.Option(None, help="Training prompts per cell (default 128; --quick 16)."),
    eval_size: int = typer.Option(None, help="Held-out problems per level (default 16; --quick 4)."),
    responses: str = typer.Option("dataset", help="'dataset' or 'sampled'."),
    objective: str = typer.Option("entropy", help="'entropy' or 'ce'."),
    no_reverse: bool = typer.Option(False, "--no-reverse", help="Ablation in every cell: lambda = max(lambda, 0)."),
    no_extrapolate: bool = typer.Option(False, "--no-extrapolate", help="Ablation: lambda = min(lambda, 1)."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(Path("runs/scale/sweep"), help="Run folder (results.json(l), heatmap.png, cells/)."),
    threads: int = typer.Option(1, min=0, help="torch CPU threads for this process (0: leave as is)."),
    quick: bool = typer.Option(False, help="Quick settings (and the quick tiny model when no --model)."),
) -> None:
    """Sweep the gate range (L, U): a Stage-II run per cell in parallel processes, a heatmap of the metric."""
    from rich.table import Table

    from treadle.scale.sweep import sweep

    try:
        grid_L = parse_list(Ls, "--Ls", kind=float, example="-4,-2,-0.5")
        grid_U = parse_list(Us, "--Us", kind=float, example="1.5,2,4")
        bad = [v for v in grid_L if not v < 0] + [v for v in grid_U if not v > 1]
        if bad:
            raise ValueError(f"every L must be < 0 and every U > 1 (L < 0 < 1 < U); bad values {bad}")
        if jobs is not None and jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        cfg = _train_config(quick, L=grid_L[0], U=grid_U[0], tau=tau, k=k, lr=lr, epochs=epochs,
                            train_size=train_size if train_size is not None else (None if quick else 128),
                            eval_size=eval_size if eval_size is not None else (None if quick else 16),
                            responses=responses, objective=objective, no_reverse=no_reverse,
                            no_extrapolate=no_extrapolate, seed=seed)
    except _ERRORS as err:
        _fail(err, flags=True)
    _check_out(out)
    try:
        _, _, adapter_dir, base = _stage_one(model_path, quick, adapter, out, threads)
        res = sweep(base, adapter_dir, grid_L, grid_U, cfg, out, jobs=jobs, metric=metric, console=console,
                    progress=True)
    except _ERRORS as err:
        _fail(err, flags=True)
    fmt = "{:.1%}" if metric == "accuracy_mean" else "{:.4f}"
    t = Table(title=f"SCALE (L, U) sweep: held-out {metric} (Stage I: {fmt.format(res['baseline'][metric])})")
    t.add_column("L \\ U")
    for u in res["Us"]:
        t.add_column(f"{u:g}", justify="right")
    by = {(c["L"], c["U"]): c for c in res["cells"]}
    for lo in res["Ls"]:
        t.add_row(f"{lo:g}", *[fmt.format(by[(lo, u)][metric]) for u in res["Us"]])
    console.print(t)
    best = fmt.format(res["best"][metric])
    console.print(f"best: L={res['best']['L']:g}, U={res['best']['U']:g} ({metric} {best}) | "
                  f"{len(res['cells'])} cells in {res['seconds']:.1f}s with {res['jobs']} job(s) | "
                  f"{res['results']} | {res['heatmap']}", markup=False)

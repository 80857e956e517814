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
import os
from pathlib import Path
from typing import Literal

import typer

from treadle.cli_checks import build_config, field_check, refuse_ignored
from treadle.cli_lists import parse_list
from treadle.cli_models import MAX_THREADS, THREADS_HELP
from treadle.cli_output import make_console, progress_enabled
from treadle.cli_runs import OUT_HELP_SUFFIX, open_run, pick_out, recorded, usage_error
from treadle.run_dirs import read_stored_json

app = typer.Typer(help="SCALE: per-token gated LoRA (Stage I LoRA SFT, Stage II gate training, (L, U) sweeps).",
                  no_args_is_help=True, add_completion=False)
console = make_console()

_ERRORS = (ValueError, TypeError, FileNotFoundError)
_TRAIN = "treadle.scale.training:ScaleTrainConfig"
_SFT = "treadle.scale.sft:SFTConfig"
# config field -> CLI flag where the names differ (build_config names the flag of a failing field)
_SFT_FLAGS = {"lora_alpha": "--alpha", "target_modules": "--target-modules", "r": "--r"}
_TRAIN_FLAGS = {"L": "--L", "U": "--U"}


def _fail(err) -> None:
    """A one-line usage error (exit 2) with ``err``'s message (brackets in paths and lists kept literally)."""
    raise usage_error(str(err))


def _check_target_modules(model, target_modules) -> None:
    """Every ``--target-modules`` name must match a module of the model (PEFT matches name suffixes):
    a usage error naming the flag before the run folder is touched, not PEFT's error after it."""
    if target_modules == "all-linear":
        return
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        import torch

        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise usage_error(f"--target-modules: no module of the model is named {', '.join(map(repr, missing))}; "
                          f"expected 'all-linear' or names among {', '.join(linear)}")


def _open(out: Path, command: str, config: dict, overwrite: bool):
    """The run folder of ``command`` (see treadle.run_dirs); exit 2 when it cannot be used as asked.
    ``parallel`` may differ on resume (a Stage-II checkpoint resumes on any world size, or in one process)."""
    return open_run(out, command=command, config=config, overwrite=overwrite, ignore=("parallel",))


def _stage_two_saved() -> str:
    return "the log of the steps done (log.jsonl) and the Trainer's checkpoint-<step>/ (gates and optimizer, every 10 steps)"


def _launched(parallel) -> bool:
    """``--parallel``: check that a launcher started this process (one clear error otherwise) and join its
    process group (accelerate's state, the one the Trainer uses). Returns True on the main process (and
    without ``--parallel``)."""
    from treadle.trainer_support import check_launch

    try:
        check_launch(parallel)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--parallel") from None
    if parallel is None:
        return True
    from treadle.trainer_support import launched_state

    return launched_state().is_main_process


def _show_finished(run, what: str) -> bool:
    """A finished run of the same config: say so (its results stay as they are) and return True."""
    if not run.finished:
        return False
    console.print(f"{run.path} already holds this finished {what} run (same config; finished "
                  f"{run.previous.get('ended')}); its results are unchanged. Add --overwrite to run it again.",
                  markup=False)
    return True


def _model_choice(model_path) -> tuple:
    """``(checkpoint, source)``: the rule for the model of every ``scale`` command (and ``stair``'s): ``--model``,
    else ``$TREADLE_MODEL`` (its default, also under ``--quick``: quick settings on that checkpoint), else
    the embedded tiny model (``--quick``: the quick one); ``(None, ...)`` for a tiny model."""
    if model_path is not None:
        return model_path, "--model"
    env = os.environ.get("TREADLE_MODEL") or None
    return (env, "$TREADLE_MODEL") if env else (None, "--model")


def _load(model_path, quick: bool, threads: int = 0, source: str | None = None):
    """``(model, tokenizer)``: ``model_path``, else ``$TREADLE_MODEL``, else the embedded tiny model
    (``--quick``: the seconds-long quick one). Exits 2 on an unusable checkpoint, naming where it came from."""
    from treadle.cli_models import load_model

    if source is None:
        model_path, source = _model_choice(model_path)
    return load_model(model_path, quick, console, threads=threads, source=source)


def _model_text(model_path, source: str, quick: bool) -> str:
    """Where the model came from, for messages: ``--model 'x'``, ``$TREADLE_MODEL 'x'``, a tiny model."""
    if model_path is not None:
        return f"{source} {str(model_path)!r}"
    return "the quick tiny model" if quick else "the embedded tiny model"


def _check_lora_targets(model, target_modules, where: str) -> None:
    """Stage I needs something for LoRA to target: checked on the loaded model, before the run starts."""
    from treadle.scale.sft import linear_targets

    if target_modules == "all-linear":
        try:
            linear_targets(model)
        except ValueError as err:
            _fail(f"{where}: {err}; give a transformer checkpoint with Linear projections")
    else:
        _check_target_modules(model, target_modules)


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
        _fail(f"--adapter {str(adapter)!r} does not exist; run `treadle scale sft` (it writes <out>/adapter) "
              f"or give a PEFT LoRA adapter folder")
    if not (adapter / "adapter_config.json").exists():
        _fail(f"--adapter {adapter} is not a PEFT adapter folder (no adapter_config.json)")


def _used_model(model_path, adapter) -> str | None:
    """The base checkpoint a train/sweep run uses (recorded in its config): ``--model``, else the adapter's
    recorded base, else ``$TREADLE_MODEL``; None for a tiny model."""
    if model_path is not None:
        return model_path
    if adapter is not None:
        try:
            base = json.loads((Path(adapter).expanduser() / "adapter_config.json").read_text()).get(
                "base_model_name_or_path")
        except (OSError, json.JSONDecodeError, AttributeError):
            base = None
        if base:
            return None  # the adapter's base: given by the adapter (recorded as "adapter")
    return _model_choice(None)[0]


def _load_base(model_path, quick: bool, adapter, threads: int):
    """Load the base model (and the Stage-I ``adapter`` onto it, when given) BEFORE the run starts, so an
    unusable checkpoint or an adapter that does not fit it is one line naming the flags, nothing written.
    Returns ``(model or peft model, tokenizer, adapter folder or None)``."""
    from treadle.scale.training import load_stage_one

    source = "--model"
    if adapter is not None:
        adapter = Path(adapter).expanduser()
        _check_adapter(adapter)
        if model_path is None:
            model_path = _base_of(adapter)
            if model_path is not None:
                source = "the adapter's base model"
    if model_path is None:
        model_path, source = _model_choice(None)
    model, tok = _load(model_path, quick, threads, source=source)
    if source == "the adapter's base model":
        console.print(f"base model (from the adapter's config): {model_path}", markup=False)
    if adapter is None:
        return model, tok, None
    try:
        return load_stage_one(model, adapter), tok, adapter
    except _ERRORS as err:
        _fail(f"--adapter {str(adapter)!r} does not fit the base model ({_model_text(model_path, source, quick)}); "
              f"pass the base model it was trained on with --model: {err}")


def _stage_one(model, tok, quick: bool, adapter, out: Path):
    """``(peft model, tokenizer, adapter folder, base model folder)``: the loaded adapter (see
    :func:`_load_base`), or a default Stage I run into ``out / "sft"`` when no adapter is given."""
    from treadle.scale.sft import sft

    if adapter is None:
        console.print(f"no --adapter: running Stage I first ({'quick' if quick else 'default'} settings) into "
                      f"{out / 'sft'}", markup=False)
        res = sft(model, tok, _sft_cfg(quick), out / "sft", console=console, progress=progress_enabled())
        return res.model, tok, res.adapter_path, model.name_or_path
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return model, tok, adapter, base.name_or_path


def _sft_cfg(quick: bool, **given):
    from treadle.scale.sft import SFTConfig

    return build_config(SFTConfig.quick if quick else SFTConfig, _SFT_FLAGS, **given)


def _train_cfg(quick: bool, **given):
    from treadle.scale.training import ScaleTrainConfig

    return build_config(ScaleTrainConfig.quick if quick else ScaleTrainConfig, _TRAIN_FLAGS, **given)


def _asdict(cfg) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg.model_dump()


_OUT_ALIAS = typer.Option(None, "--run-dir", hidden=True, help="Old name of --out.")
_OVERWRITE = typer.Option(False, "--overwrite", help="Replace a run of another config in --out (deleting it).")
_THREADS = typer.Option(None, min=0, max=MAX_THREADS, help=THREADS_HELP)
_QUICK = typer.Option(False, help="Quick settings (and the quick tiny model, in its own cache slot, when neither "
                                  "--model nor $TREADLE_MODEL gives a checkpoint).")
_REPORT_TO = typer.Option("none", "--report-to", help="Log metrics to 'tensorboard', 'wandb' (comma-separated), "
                                                      "'all' (those installed) or 'none'.")


@app.command("sft")
def sft_cmd(
    model_path: str = typer.Option(None, "--model", help="Local HF checkpoint (default: $TREADLE_MODEL, else the "
                                                         "embedded tiny model)."),
    steps: int = typer.Option(None, min=1, help="Optimizer steps (default 60; --quick 6)."),
    batch_size: int = typer.Option(None, min=1, help="Problems per step (default 32; --quick 8)."),
    lr: float = typer.Option(None, callback=field_check(_SFT, "lr"), help="AdamW learning rate (default 2e-3), > 0."),
    r: int = typer.Option(None, "--r", min=1, help="LoRA rank (SCALE: 16), >= 1."),
    alpha: float = typer.Option(None, "--alpha", callback=field_check(_SFT, "lora_alpha"),
                                help="LoRA alpha (SCALE: 16), > 0."),
    target_modules: str = typer.Option("all-linear", help="'all-linear' (every nn.Linear but the output head, "
                                                          "so Stage II can gate each LoRA layer; MoE routers "
                                                          "and fused experts are left out) or comma-separated "
                                                          "module names."),
    levels: str = typer.Option("1,2,3", help="Difficulty levels of the worked problems (treadle.data)."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(None, "--out", help="Run folder (adapter/, log.jsonl, summary.json); default "
                                                 "runs/scale/sft (--quick: runs/scale/sft-quick)." + OUT_HELP_SUFFIX),
    run_dir: Path = _OUT_ALIAS,
    overwrite: bool = _OVERWRITE,
    threads: int = _THREADS,
    quick: bool = _QUICK,
    parallel: Literal["ddp", "fsdp2"] = typer.Option(None, "--parallel", help="Data-parallel Stage I on the "
                                                     "ranks torchrun or accelerate launch started (torchrun "
                                                     "--nproc-per-node N -m treadle scale sft --parallel ddp): "
                                                     "'ddp' (the Trainer's DDP) or 'fsdp2' (the Trainer's FSDP2, "
                                                     "accelerators only); --batch-size stays the global batch (a "
                                                     "multiple of N), rank 0 writes the run folder."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", min=1,
                                         help="Write a step checkpoint (the HF Trainer's, <out>/trainer/checkpoint-N) "
                                              "every N steps and after the last, >= 1; an interrupted run rerun "
                                              "with the same settings continues from the newest one, also on "
                                              "another number of ranks or another --parallel."),
) -> None:
    """Stage I: ordinary LoRA SFT through PEFT (r=16, alpha=16, all linear layers) on worked problems."""
    import contextlib

    from rich.console import Console

    from treadle.scale.sft import sft
    from treadle.trainer_support import broadcast_from_main

    out = pick_out(out, run_dir, "runs/scale/sft-quick" if quick else "runs/scale/sft")
    tm = target_modules if target_modules == "all-linear" else tuple(m.strip() for m in target_modules.split(",")
                                                                     if m.strip())
    cfg = _sft_cfg(quick, steps=steps, batch_size=batch_size, lr=lr, r=r, lora_alpha=alpha, target_modules=tm,
                   levels=parse_list(levels, "--levels"), seed=seed)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel is None and world > 1:
        raise typer.BadParameter(f"this process is one of {world} torchrun ranks: add --parallel ddp (or run "
                                 "Stage I in one process)", param_hint="--parallel")
    if cfg.batch_size % world:
        raise typer.BadParameter(f"{cfg.batch_size} is the global batch and must be a multiple of the {world} "
                                 "torchrun ranks", param_hint="--batch-size")
    main = _launched(parallel)
    run, done = None, False
    if main:
        run = _open(out, "scale sft", {**_asdict(cfg), "model": _model_choice(model_path)[0], "quick": quick},
                    overwrite)
        done = _show_finished(run, "Stage I")
        if done:
            console.print(f"adapter: {out / 'adapter'}", markup=False)
    if broadcast_from_main(done):
        return
    model_path, source = _model_choice(model_path)
    model, tok = _load(model_path, quick, threads, source=source)
    _check_lora_targets(model, cfg.target_modules, _model_text(model_path, source, quick))
    ctx_run = (recorded(run, console, saved=lambda: "the step checkpoints (trainer/checkpoint-N) and log.jsonl",
                        resumable=True)
               if main else contextlib.nullcontext())
    with ctx_run:
        try:
            res = sft(model, tok, cfg, out, console=console if main else Console(quiet=True),
                      progress=main and progress_enabled(), parallel=parallel,
                      checkpoint_every=checkpoint_every)
        except _ERRORS as err:
            _fail(err)
    if main:
        console.print(f"next: treadle scale train --adapter {res.adapter_path}" + (" --quick" if quick else ""),
                      markup=False)


@app.command("train")
def train_cmd(
    ctx: typer.Context,
    model_path: str = typer.Option(None, "--model", help="Base model checkpoint (default: the adapter's base, "
                                                         "else $TREADLE_MODEL, else the embedded tiny model)."),
    adapter: Path = typer.Option(None, help="Stage-I PEFT LoRA adapter folder (default: run a short Stage I "
                                            "first into <out>/sft)."),
    L: float = typer.Option(-2.0, "--L", callback=field_check(_TRAIN, "L"), help="lambda's lower end, < 0."),
    U: float = typer.Option(2.0, "--U", callback=field_check(_TRAIN, "U"), help="lambda's upper end, > 1."),
    tau: float = typer.Option(1.0, callback=field_check(_TRAIN, "tau"), help="Gate temperature, > 0."),
    k: int = typer.Option(100, min=2, help="Top-k of the entropy objective (SCALE: 100), >= 2."),
    lr: float = typer.Option(None, callback=field_check(_TRAIN, "lr"),
                             help="Adam learning rate of the gates (default 1e-3), > 0."),
    epochs: int = typer.Option(None, min=1, help="Passes over the training responses (default 2; --quick 1)."),
    batch_size: int = typer.Option(None, min=1, help="Rows per step (default 32; --quick 8)."),
    train_size: int = typer.Option(None, min=1, help="Training prompts (default 256; --quick 16)."),
    levels: str = typer.Option("1,2,3", help="Difficulty levels of the training prompts."),
    responses: Literal["dataset", "sampled"] = typer.Option("dataset", help="'dataset' (verified answers) or "
                                                                            "'sampled' (Stage-I samples)."),
    temperature: float = typer.Option(1.0, callback=field_check(_TRAIN, "temperature"),
                                      help="Sampling temperature for --responses sampled, > 0."),
    objective: Literal["entropy", "ce"] = typer.Option("entropy", help="'entropy' (SCALE) or 'ce' (CE-calibration "
                                                                       "ablation; needs --responses dataset)."),
    no_reverse: bool = typer.Option(False, "--no-reverse", help="Ablation: lambda = max(lambda, 0)."),
    no_extrapolate: bool = typer.Option(False, "--no-extrapolate", help="Ablation: lambda = min(lambda, 1)."),
    eval_levels: str = typer.Option(None, help="Held-out levels (default 1,2,3; --quick 1)."),
    eval_size: int = typer.Option(None, min=1, help="Held-out problems per level (default 32; --quick 4)."),
    max_new_tokens: int = typer.Option(None, min=1, help="Completion budget (default 10; --quick 6)."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(None, "--out", help="Run folder (log.jsonl, summary.json, gates.safetensors, "
                                                 "lambda_hist.png); default runs/scale/train (--quick: "
                                                 "runs/scale/train-quick)." + OUT_HELP_SUFFIX),
    run_dir: Path = _OUT_ALIAS,
    overwrite: bool = _OVERWRITE,
    report_to: str = _REPORT_TO,
    threads: int = _THREADS,
    quick: bool = _QUICK,
    parallel: Literal["ddp", "fsdp2"] = typer.Option(None, "--parallel", help="Data-parallel Stage II on the "
                                                     "ranks torchrun or accelerate launch started (e.g. torchrun "
                                                     "--nproc-per-node 2 -m treadle scale train --parallel ddp "
                                                     "--adapter DIR): the Trainer's DDP, or 'fsdp2' (accelerators "
                                                     "only); needs --adapter; --batch-size is the global batch."),
) -> None:
    """Stage II: train only the gates on the normalised top-k entropy over response positions."""
    from treadle.reporting import parse_report_to
    from treadle.scale.stage_two import train
    from treadle.scale.training import summary_tables

    if parallel is not None:
        return _train_parallel(parallel, ctx, locals())
    _launched(None)  # one of several launched ranks without --parallel: refused

    out = pick_out(out, run_dir, "runs/scale/train-quick" if quick else "runs/scale/train")
    refuse_ignored(ctx, [("temperature", "--temperature", responses == "sampled", "with --responses sampled only")])
    if objective == "ce" and responses != "dataset":
        raise typer.BadParameter("'ce' (the CE-calibration ablation) trains on the dataset's responses: use "
                                 "--responses dataset", param_hint="--objective")
    reporters = parse_report_to(report_to, "--report-to")
    cfg = _train_cfg(quick, L=L, U=U, tau=tau, k=k, lr=lr, epochs=epochs, batch_size=batch_size,
                     train_size=train_size, levels=parse_list(levels, "--levels"), responses=responses,
                     temperature=temperature, objective=objective, no_reverse=no_reverse,
                     no_extrapolate=no_extrapolate,
                     eval_levels=(parse_list(eval_levels, "--eval-levels") if eval_levels is not None else None),
                     eval_size=eval_size, max_new_tokens=max_new_tokens, seed=seed)
    if adapter is not None:
        _check_adapter(Path(adapter).expanduser())
    run = _open(out, "scale train", {**_asdict(cfg), "model": _used_model(model_path, adapter), "quick": quick,
                                     "adapter": str(adapter) if adapter is not None else None}, overwrite)
    if _show_finished(run, "Stage II"):
        summary_file = out / "summary.json"
        if summary_file.exists():
            for t in summary_tables(read_stored_json(summary_file, what="run summary")):
                console.print(t)
        return
    model, tok, adapter = _load_base(model_path, quick, adapter, threads)
    if adapter is None:
        _check_lora_targets(model, _sft_cfg(quick).target_modules, _model_text(*_model_choice(model_path), quick))
    with recorded(run, console, saved=_stage_two_saved, resumable=True):
        try:
            pm, tok, adapter_dir, _ = _stage_one(model, tok, quick, adapter, out)
            summary = train(pm, tok, cfg, out, console=console, progress=progress_enabled(), report_to=reporters)
        except _ERRORS as err:
            _fail(err)
    for t in summary_tables(summary):
        console.print(t)
    console.print(f"gates: {summary['gates']} | lambda histogram: {summary['histogram']} | log: {out / 'log.jsonl'}",
                  markup=False)


def _train_parallel(parallel: str, ctx, a: dict) -> None:
    """``scale train --parallel``: one rank of a torchrun job (Stage I must exist: ``--adapter``). Rank 0
    alone checks and records the run folder and prints; every rank loads the model and trains its part."""
    import contextlib

    from rich.console import Console

    from treadle.reporting import parse_report_to
    from treadle.scale.stage_two import train
    from treadle.scale.training import summary_tables
    from treadle.trainer_support import broadcast_from_main

    if a["adapter"] is None:
        raise typer.BadParameter("--parallel needs --adapter (run Stage I first, in one process: treadle scale sft)",
                                 param_hint="--adapter")
    reporters = parse_report_to(a["report_to"], "--report-to")
    out = pick_out(a["out"], a["run_dir"], "runs/scale/train-quick" if a["quick"] else "runs/scale/train")
    refuse_ignored(ctx, [("temperature", "--temperature", a["responses"] == "sampled", "with --responses sampled only")])
    if a["objective"] == "ce" and a["responses"] != "dataset":
        raise typer.BadParameter("'ce' (the CE-calibration ablation) trains on the dataset's responses: use "
                                 "--responses dataset", param_hint="--objective")
    cfg = _train_cfg(a["quick"], L=a["L"], U=a["U"], tau=a["tau"], k=a["k"], lr=a["lr"], epochs=a["epochs"],
                     batch_size=a["batch_size"], train_size=a["train_size"], levels=parse_list(a["levels"], "--levels"),
                     responses=a["responses"], temperature=a["temperature"], objective=a["objective"],
                     no_reverse=a["no_reverse"], no_extrapolate=a["no_extrapolate"],
                     eval_levels=(parse_list(a["eval_levels"], "--eval-levels") if a["eval_levels"] is not None
                                  else None),
                     eval_size=a["eval_size"], max_new_tokens=a["max_new_tokens"], seed=a["seed"])
    adapter = Path(a["adapter"]).expanduser()
    _check_adapter(adapter)
    main = _launched(parallel)
    from treadle.trainer_support import launched_state

    device = launched_state().device
    global console
    run, done = None, False  # the main process alone checks and records the run folder
    if main:
        run = _open(out, "scale train", {**_asdict(cfg), "model": _used_model(a["model_path"], adapter),
                                         "quick": a["quick"],
                                         "adapter": str(adapter), "parallel": parallel}, a["overwrite"])
        done = _show_finished(run, "Stage II")
    if broadcast_from_main(done):
        return
    shown = console
    if not main:
        console = Console(quiet=True)  # _stage_one prints through the module console
    try:
        pm, tok, _ = _load_base(a["model_path"], a["quick"], adapter, a["threads"])
    finally:
        console = shown
    pm = pm.to(device)
    ctx_run = recorded(run, console, saved=_stage_two_saved, resumable=True) if main else contextlib.nullcontext()
    with ctx_run:
        try:
            summary = train(pm, tok, cfg, out, console=console if main else None,
                            progress=main and progress_enabled(), parallel=parallel, report_to=reporters)
        except _ERRORS as err:
            _fail(err)
    if main:
        for t in summary_tables(summary):
            console.print(t)
        console.print(f"{parallel} on {summary['world_size']} ranks | gates: {summary['gates']} | log: "
                      f"{out / 'log.jsonl'}", markup=False)


@app.command("sweep")
def sweep_cmd(
    model_path: str = typer.Option(None, "--model", help="Base model checkpoint (default: the adapter's base, "
                                                         "else $TREADLE_MODEL, else the embedded tiny model)."),
    adapter: Path = typer.Option(None, help="Stage-I adapter shared by all cells (default: run a short Stage I "
                                            "first into <out>/sft)."),
    Ls: str = typer.Option("-4,-2,-0.5", "--Ls", help="Lower ends, each < 0 (write --Ls=-6,-4,-2,-0.5)."),
    Us: str = typer.Option("1.5,2,4", "--Us", help="Upper ends, each > 1."),
    jobs: int = typer.Option(None, min=1, help="Parallel worker processes (default min(cores, cells))."),
    metric: Literal["accuracy_mean", "entropy"] = typer.Option("accuracy_mean", help="Heatmap metric."),
    tau: float = typer.Option(1.0, callback=field_check(_TRAIN, "tau"), help="Gate temperature, > 0."),
    k: int = typer.Option(100, min=2, help="Top-k of the entropy objective, >= 2."),
    lr: float = typer.Option(None, callback=field_check(_TRAIN, "lr"),
                             help="Adam learning rate of the gates (default 1e-3), > 0."),
    epochs: int = typer.Option(1, min=1, help="Passes over the training responses per cell."),
    train_size: int = typer.Option(None, min=1, help="Training prompts per cell (default 128; --quick 16)."),
    eval_size: int = typer.Option(None, min=1, help="Held-out problems per level (default 16; --quick 4)."),
    responses: Literal["dataset", "sampled"] = typer.Option("dataset", help="'dataset' or 'sampled'."),
    objective: Literal["entropy", "ce"] = typer.Option("entropy", help="'entropy' or 'ce'."),
    no_reverse: bool = typer.Option(False, "--no-reverse", help="Ablation in every cell: lambda = max(lambda, 0)."),
    no_extrapolate: bool = typer.Option(False, "--no-extrapolate", help="Ablation: lambda = min(lambda, 1)."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(None, "--out", help="Run folder (results.json(l), heatmap.png, cells/); default "
                                                 "runs/scale/sweep (--quick: runs/scale/sweep-quick)."
                                                 + OUT_HELP_SUFFIX),
    run_dir: Path = _OUT_ALIAS,
    overwrite: bool = _OVERWRITE,
    threads: int = typer.Option(None, min=0, max=MAX_THREADS, help=THREADS_HELP),
    quick: bool = _QUICK,
) -> None:
    """Sweep the gate range (L, U): a Stage-II run per cell in parallel processes, a heatmap of the metric."""
    from rich.table import Table

    from treadle.scale.sweep import sweep

    out = pick_out(out, run_dir, "runs/scale/sweep-quick" if quick else "runs/scale/sweep")
    grid_L = parse_list(Ls, "--Ls", kind=float, example="-4,-2,-0.5")
    grid_U = parse_list(Us, "--Us", kind=float, example="1.5,2,4")
    for flag, grid, field in (("--Ls", grid_L, "L"), ("--Us", grid_U, "U")):
        bad = [v for v in grid if not (v < 0 if field == "L" else v > 1)]
        if bad:
            raise typer.BadParameter(f"every {field} must be {'< 0' if field == 'L' else '> 1'} (L < 0 < 1 < U); "
                                     f"bad values {bad}", param_hint=flag)
        twice = sorted({v for v in grid if grid.count(v) > 1})
        if twice:
            raise typer.BadParameter(f"each {field} once: {', '.join(f'{v:g}' for v in twice)} given more than once "
                                     f"in {[float(v) for v in grid]}", param_hint=flag)
    tasks = len(grid_L) * len(grid_U) + 1  # the cells and the Stage-I baseline
    cap, bounded = min(tasks, os.cpu_count() or 1), None
    if jobs is not None and jobs > cap:  # more workers than tasks or CPUs would only wait or contend
        bounded = (f"--jobs {jobs}: using {cap} worker(s) ({tasks} tasks: {tasks - 1} cell(s) and the Stage-I "
                   f"baseline; {os.cpu_count() or 1} CPU(s))")
        jobs = cap
    if objective == "ce" and responses != "dataset":
        raise typer.BadParameter("'ce' (the CE-calibration ablation) trains on the dataset's responses: use "
                                 "--responses dataset", param_hint="--objective")
    cfg = _train_cfg(quick, L=grid_L[0], U=grid_U[0], tau=tau, k=k, lr=lr, epochs=epochs,
                     train_size=train_size if train_size is not None else (None if quick else 128),
                     eval_size=eval_size if eval_size is not None else (None if quick else 16),
                     responses=responses, objective=objective, no_reverse=no_reverse,
                     no_extrapolate=no_extrapolate, seed=seed)
    if adapter is not None:
        _check_adapter(Path(adapter).expanduser())
    run = _open(out, "scale sweep", {**_asdict(cfg), "Ls": list(grid_L), "Us": list(grid_U),
                                     "metric": metric, "model": _used_model(model_path, adapter), "quick": quick,
                                     "adapter": str(adapter) if adapter is not None else None}, overwrite)
    if _show_finished(run, "sweep"):
        res = read_stored_json(out / "results.json", what="sweep results") if (out / "results.json").exists() else None
    else:
        model, tok, adapter = _load_base(model_path, quick, adapter, threads)
        if adapter is None:
            _check_lora_targets(model, _sft_cfg(quick).target_modules, _model_text(*_model_choice(model_path), quick))
        if bounded:
            console.print(bounded, markup=False)
        with recorded(run, console, saved=lambda: "the cells finished so far (cells/)"):
            try:
                _, _, adapter_dir, base = _stage_one(model, tok, quick, adapter, out)
                res = sweep(base, adapter_dir, grid_L, grid_U, cfg, out, jobs=jobs, metric=metric, console=console,
                            progress=progress_enabled())
            except _ERRORS as err:
                _fail(err)
    if res is None:
        return
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
                  f"{res.get('results', out / 'results.jsonl')} | {res.get('heatmap', out / 'heatmap.png')}",
                  markup=False)

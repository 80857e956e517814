"""``treadle stair ...``: train STAIR normals and evaluate Vanilla / Native / STAIR with controls.

    treadle stair train [--model PATH] [--layers 3,11,19|auto] [--steps N] [--out runs/stair]
    treadle stair eval  [--model PATH] [--normals runs/stair/normals.safetensors] [--bank-free ...]

Both run with no arguments (``eval`` picks up what ``train`` wrote to its default --out). Bad input is
one line naming the flag, exit 2, before the model is loaded where the check does not need it.
"""
from __future__ import annotations

import contextlib
import dataclasses
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

app = typer.Typer(help="STAIR: reflected read-out of earlier responses' K/V (train the normals, evaluate).",
                  no_args_is_help=True, add_completion=False)
console = make_console()


def parse_layers(text: str, model) -> tuple:
    """``"auto"`` -> :func:`default_layers`; ``"3,11,19"`` -> (3, 11, 19).

    Raises:
        typer.BadParameter: not a comma-separated list of ints.
    """
    if text.strip() == "auto":
        from treadle.stair.controller import default_layers

        return default_layers(model)
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"layers must be 'auto' or comma-separated ints like 3,11,19, got {text!r}",
                                 param_hint="--layers") from None


def _levels(text: str) -> list:
    return list(parse_list(text, "--levels", example="1,2"))


def _check_normals(path, hint: str, kind: str) -> dict:
    """``path`` must be a STAIR weights file of ``kind`` (checked before any work); returns its config."""
    from treadle.stair.controller import NormalsFileError, read_normals_config

    try:
        cfg = read_normals_config(path)
    except (FileNotFoundError, NormalsFileError) as err:
        raise typer.BadParameter(str(err), param_hint=hint) from None
    if cfg.get("kind") != kind:
        raise typer.BadParameter(f"{path} holds kind={cfg.get('kind')!r} weights, expected {kind!r}", param_hint=hint)
    return cfg


def _check_model_choice(model_path, quick: bool) -> str | None:
    """The rule for the model of every ``stair`` command: ``--model``, else ``$TREADLE_MODEL`` (its default),
    else the embedded tiny model; ``--quick`` picks the quick tiny model instead of the embedded one and
    does nothing else here, so giving it with a checkpoint (either way) is an error (it would be ignored).
    Returns the checkpoint the run uses (recorded in the run folder's config), None for a tiny model."""
    env = os.environ.get("TREADLE_MODEL") or None
    if quick and model_path is not None:
        raise typer.BadParameter("ignored here: --quick picks the quick tiny model, and --model gives a checkpoint; "
                                 "drop --quick or --model", param_hint="--quick")
    if quick and env is not None:
        raise typer.BadParameter(f"ignored here: --quick picks the quick tiny model, and $TREADLE_MODEL gives a "
                                 f"checkpoint ({env!r}); unset TREADLE_MODEL or drop --quick", param_hint="--quick")
    return model_path if model_path is not None else env


def _layer_mismatch(layers: tuple, files: dict, hint: str = "--layers") -> None:
    """Every weights file (``{flag: (path, its layers)}``) must hold the ``layers`` the run uses."""
    for flag, (path, fl) in files.items():
        if fl is not None and tuple(fl) != tuple(layers):
            raise typer.BadParameter(f"layers {list(layers)} differ from the layers {list(fl)} the {flag} file {path} "
                                     f"was trained for; drop --layers (the file's layers are used) or give "
                                     f"--layers {','.join(map(str, fl))}", param_hint=hint)


def _check_fit(model, files: dict, layers: tuple, source: str) -> None:
    """Load each weights file (``{flag: (path, kind)}``) into a throw-away controller on ``model``, so that
    weights of another model or shape fail here (one line naming the flag), not midway through the run."""
    from treadle.stair.controller import attach

    for flag, (path, kind) in files.items():
        ctrl = attach(model, layers=layers, kind=kind)
        try:
            ctrl.load(path)
        except (ValueError, TypeError, OSError) as err:
            raise typer.BadParameter(f"{path} does not fit the model ({source}): {err}", param_hint=flag) from None
        finally:
            ctrl.detach()


def _resolve_layers(layers: str, model) -> tuple:
    """``--layers`` on the loaded model: 'auto' or the given ones, checked against the model (exit 2)."""
    from treadle.stair.arch import SUPPORTED, UnsupportedModelError, _supported_text, inspect_model

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED or not hasattr(getattr(model, "model", None), "layers"):
        raise typer.BadParameter(f"unsupported model: STAIR does not support model_type {model_type!r} "
                                 f"({type(model).__name__}); supported: {_supported_text()}", param_hint="--model")
    try:
        chosen = parse_layers(layers, model)
        inspect_model(model, chosen)
    except (UnsupportedModelError, TypeError) as err:
        raise typer.BadParameter(str(err), param_hint="--layers") from None
    return chosen


_TRAIN = "treadle.stair.training:StairTrainConfig"
_EVAL = "treadle.stair.evaluation:EvalConfig"
_OUT_ALIAS = typer.Option(None, "--run-dir", hidden=True, help="Old name of --out.")
_OVERWRITE = typer.Option(False, "--overwrite", help="Replace a run of another config in --out (deleting it).")


def _checkpoint_step(out: Path) -> int:
    """The step of the newest complete Trainer checkpoint in ``out`` (0: none)."""
    from treadle.trainer_support import latest_checkpoint

    ckpt = latest_checkpoint(out) if out.is_dir() else None
    return int(ckpt.name.split("-")[-1]) if ckpt is not None else 0


@app.command("train")
def train_cmd(
    model_path: str = typer.Option(None, "--model", help="Local HF checkpoint (default: $TREADLE_MODEL, else the "
                                                         "embedded tiny model)."),
    layers: str = typer.Option("auto", help="Controlled layers, e.g. 3,11,19 ('auto': those, or spread)."),
    kind: Literal["stair", "bank_free"] = typer.Option("stair", help="'stair' (normals) or 'bank_free' (the "
                                                                     "same-budget control)."),
    eps: float = typer.Option(0.0, callback=field_check(_TRAIN, "eps"), help="pi_ref uniform mixing weight in [0, 1)."),
    steps: int = typer.Option(60, min=1, help="Optimizer steps (more than a finished run's: it continues)."),
    sessions: int = typer.Option(96, min=1, help="Training sessions (each `turns` independent problems)."),
    turns: int = typer.Option(4, min=2, help="Problems per session (turn 1 builds the bank), >= 2."),
    levels: str = typer.Option("1,2", help="Difficulty level per turn (treadle.data levels), cycled."),
    batch_size: int = typer.Option(16, min=1, help="Sessions per micro-batch."),
    grad_accum: int = typer.Option(1, min=1, help="Micro-batches per optimizer step."),
    lr: float = typer.Option(2e-2, callback=field_check(_TRAIN, "lr"), help="AdamW learning rate, > 0."),
    lambda_kl: float = typer.Option(1.0, callback=field_check(_TRAIN, "lambda_kl"),
                                    help="Weight of KL(native || stair), >= 0."),
    responses: Literal["self", "gold"] = typer.Option("self", help="'self' (backbone's own greedy responses) or "
                                                                   "'gold'."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(None, "--out", help="Run folder (normals.safetensors, log.jsonl, the Trainer's "
                                                 "checkpoint-<step>/); default "
                                                 "runs/stair (--quick: runs/stair-quick)." + OUT_HELP_SUFFIX),
    run_dir: Path = _OUT_ALIAS,
    overwrite: bool = _OVERWRITE,
    resume: bool = typer.Option(True, help="Continue from the checkpoint of a same-config run in --out."),
    report_to: str = typer.Option("none", "--report-to", help="Log metrics to 'tensorboard', 'wandb' "
                                                              "(comma-separated), 'all' (those installed) or 'none'."),
    threads: int = typer.Option(None, min=0, max=MAX_THREADS, help=THREADS_HELP),
    quick: bool = typer.Option(False, help="Use the seconds-long quick tiny model (its own cache slot); not with "
                                           "--model or $TREADLE_MODEL."),
    parallel: Literal["ddp", "fsdp2"] = typer.Option(None, "--parallel", help="Data-parallel training on the "
                                                     "ranks torchrun or accelerate launch started (e.g. torchrun "
                                                     "--nproc-per-node 2 -m treadle stair train --parallel ddp): the "
                                                     "Trainer's DDP, or 'fsdp2' (accelerators only); --batch-size "
                                                     "is the global batch."),
) -> None:
    """Train STAIR normals: CE + lambda_kl * KL(native || stair) on teacher-forced turns 2..n (on
    transformers.Trainer; under torchrun / accelerate launch every rank trains its part of each batch)."""
    used_model = _check_model_choice(model_path, quick)
    from rich.console import Console

    from treadle.cli_models import load_model
    from treadle.reporting import parse_report_to
    from treadle.stair.training import StairTrainConfig, read_log, train
    from treadle.trainer_support import broadcast_from_main, check_launch

    try:
        check_launch(parallel)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--parallel") from None
    main, device = True, None
    if parallel is not None:  # join the process group the launcher set up (the Trainer's own state)
        from treadle.trainer_support import launched_state

        state = launched_state()
        main, device = state.is_main_process, state.device
    out = pick_out(out, run_dir, "runs/stair-quick" if quick else "runs/stair")
    lv = _levels(levels)
    if layers.strip() != "auto":
        parse_layers(layers, None)  # syntax only (ranges need the model)
    sinks = parse_report_to(report_to)
    cfg = build_config(StairTrainConfig, {}, kind=kind, eps=eps, steps=steps, sessions=sessions, turns=turns,
                       levels=lv, batch_size=batch_size, grad_accum=grad_accum, lr=lr, lambda_kl=lambda_kl,
                       responses=responses, seed=seed, save_every=max(1, min(25, steps)))
    run, done = None, False
    if main:  # the main process alone checks and records the run folder
        run = open_run(out, command="stair train", overwrite=overwrite, ignore=("steps", "save_every"),
                       config={**dataclasses.asdict(cfg), "layers": layers.strip(), "model": used_model,
                               "quick": quick, "steps": steps, "save_every": cfg.save_every,
                               **({"parallel": parallel} if parallel else {})})
        _refuse_no_resume(run, resume)
        done = run.finished and _checkpoint_step(out) >= steps
        if done:
            log = read_log(out)
            console.print(f"{out} already holds this finished run ({_checkpoint_step(out)} steps, same config); "
                          f"loss {log[0]['loss']:.4f} -> {log[-1]['loss']:.4f}. Give more --steps to continue it, "
                          f"--overwrite to train again.", markup=False)
    if broadcast_from_main(done):
        return
    model, tok = load_model(model_path, quick, console if main else Console(quiet=True), threads=threads)
    if device is not None:
        model = model.to(device)
    cfg = dataclasses.replace(cfg, layers=_resolve_layers(layers, model))
    if main:
        _check_checkpoint_layers(run, resume, cfg.layers)

    def saved() -> str:
        step = _checkpoint_step(out)
        return (f"the checkpoint of step {step} ({out}/checkpoint-{step}, normals.safetensors; log.jsonl keeps "
                f"steps 1-{step} on resume)" if step else f"no checkpoint yet (the first is at step {cfg.save_every})")

    ctx = recorded(run, console, saved=saved, resumable=True) if main else contextlib.nullcontext()
    with ctx:
        try:
            result = train(model, tok, cfg, out, resume=resume, console=console if main else None,
                           progress=main and progress_enabled(), report_to=sinks, parallel=parallel)
        except (ValueError, TypeError) as err:
            raise usage_error(str(err)) from None
    if main:
        log = read_log(out)
        ranks = f"{parallel} on {result['world_size']} ranks | " if parallel else ""
        console.print(f"{ranks}trainable parameters: {result['trainable']} | loss {log[0]['loss']:.4f} -> "
                      f"{log[-1]['loss']:.4f} (first/last step); fixed probe batch {result['probe_loss_before']:.4f} "
                      f"-> {result['probe_loss_after']:.4f} | saved {result['path']}", markup=False)


def _refuse_no_resume(run, resume: bool) -> None:
    """``--no-resume`` starts from step 0; in a folder holding a run that would replace it, which only
    ``--overwrite`` may do (the run rule): refused, before any work."""
    from treadle.run_dirs import RUN_RECORD

    if resume or run.overwrite or run.previous is None:
        return
    if any(c.name != RUN_RECORD for c in run.path.iterdir()):
        raise typer.BadParameter(f"--out {str(run.path)!r} holds a run ({run.previous.get('status')}); --no-resume "
                                 f"would train again from step 0 and replace it: add --overwrite to replace it, or "
                                 f"give another --out", param_hint="--no-resume")


def _check_checkpoint_layers(run, resume: bool, layers: tuple) -> None:
    """A checkpoint to resume must be of the layers the run resolved ('auto' may resolve otherwise)."""
    if not (resume and run.resumed):
        return
    try:
        old = read_stored_json(run.path / "config.json", what="run config").get("layers")
    except (OSError, ValueError, AttributeError):
        return
    if old is not None and (run.path / "normals.safetensors").exists() and tuple(old) != tuple(layers):
        raise typer.BadParameter(f"--out {str(run.path)!r} holds a checkpoint of layers {list(old)}, this run resolves "
                                 f"layers {list(layers)}; give --layers {','.join(map(str, old))} to resume it, or "
                                 f"add --overwrite to replace it", param_hint="--layers")


@app.command("eval")
def eval_cmd(
    ctx: typer.Context,
    model_path: str = typer.Option(None, "--model", help="Local HF checkpoint (default: $TREADLE_MODEL, else the "
                                                         "embedded tiny model)."),
    normals: Path = typer.Option(None, help="Trained normals (default: <stair train's default --out>/"
                                            "normals.safetensors when it exists, else the conditions that need "
                                            "them are skipped)."),
    bank_free: Path = typer.Option(None, "--bank-free", help="Trained bank-free control (train --kind bank_free)."),
    layers: str = typer.Option(None, help="Controlled layers (default: from the normals file, else 'auto')."),
    sessions: int = typer.Option(32, min=1, help="Held-out sessions (problems per turn)."),
    turns: int = typer.Option(4, min=2, help="Turns per session, >= 2."),
    levels: str = typer.Option("1,2", help="Difficulty level per turn (treadle.data levels), cycled."),
    k: int = typer.Option(4, min=1, help="Samples per problem (Avg@k, Pass@k)."),
    temperature: float = typer.Option(0.7, callback=field_check(_EVAL, "temperature"),
                                      help="Sampling temperature, >= 0."),
    max_new_tokens: int = typer.Option(10, min=1, help="Decoding budget."),
    conditions: str = typer.Option(",".join(("vanilla", "native", "stair", "random", "bank_free", "shuffled",
                                             "reflected")), help="Comma-separated conditions."),
    budgets: str = typer.Option("", help="Bank prefix budgets in tokens, e.g. 16,64."),
    seed: int = typer.Option(1234, help="Problems and sampling seed."),
    out: Path = typer.Option(None, "--out", help="Output folder (results.jsonl, results.json, avg.png); default "
                                                 "runs/stair-eval (--quick: runs/stair-eval-quick)."
                                                 + OUT_HELP_SUFFIX),
    run_dir: Path = _OUT_ALIAS,
    overwrite: bool = _OVERWRITE,
    threads: int = typer.Option(None, min=0, max=MAX_THREADS, help=THREADS_HELP),
    quick: bool = typer.Option(False, help="Use the quick tiny model (its own cache slot); not with --model or "
                                           "$TREADLE_MODEL."),
) -> None:
    """Evaluate Vanilla / Native / STAIR and the controls; table, JSONL and a PNG bar chart."""
    from treadle.cli_checks import given
    from treadle.cli_models import load_model, model_source
    from treadle.stair.evaluation import CONDITIONS, EvalConfig, evaluate, results_table

    used_model = _check_model_choice(model_path, quick)
    out = pick_out(out, run_dir, "runs/stair-eval-quick" if quick else "runs/stair-eval")
    lv = _levels(levels)
    given_layers = None
    if layers and layers.strip() != "auto":
        given_layers = parse_layers(layers, None)  # syntax only (ranges need the model)
    budget_list = parse_list(budgets, "--budgets", example="16,64", minimum=1, allow_empty=True)
    chosen = {c.strip() for c in conditions.split(",") if c.strip()}
    if not chosen:
        raise typer.BadParameter(f"no condition given; name at least one of {', '.join(CONDITIONS)}",
                                 param_hint="--conditions")
    refuse_ignored(ctx, [
        ("normals", "--normals", bool(chosen & {"stair", "shuffled", "reflected"}),
         "to the stair, shuffled and reflected conditions, none of which is in --conditions"),
        ("bank_free", "--bank-free", "bank_free" in chosen, "to the bank_free condition, not in --conditions"),
        ("budgets", "--budgets", "stair" in chosen, "to the stair condition (stair@N), not in --conditions")])
    if budget_list and "stair" in chosen and normals is None and not (
            model_path is None and bank_free is None
            and (Path("runs/stair-quick" if quick else "runs/stair") / "normals.safetensors").exists()):
        raise typer.BadParameter("ignored here: bank budgets apply to the stair condition, which needs --normals",
                                 param_hint="--budgets")
    picked = None  # said once every option is checked: an error is then the only line printed
    if normals is None and model_path is None and bank_free is None:
        default = Path("runs/stair-quick" if quick else "runs/stair") / "normals.safetensors"
        if default.exists():  # what `treadle stair train` (same --quick) wrote
            normals = default
            picked = f"normals: {default} (from `treadle stair train`{' --quick' if quick else ''})"
    if given(ctx, "conditions"):  # conditions asked for by name are run, never skipped (only the default list skips)
        need = sorted(chosen & {"stair", "shuffled", "reflected"}, key=CONDITIONS.index)
        if need and normals is None:
            raise typer.BadParameter(f"the condition(s) {', '.join(need)} in --conditions need trained normals: give "
                                     f"--normals PATH (written by `treadle stair train`) or drop them from --conditions",
                                     param_hint="--normals")
        if "bank_free" in chosen and bank_free is None:
            raise typer.BadParameter("the bank_free condition in --conditions needs its trained weights: give "
                                     "--bank-free PATH (`treadle stair train --kind bank_free`) or drop it from "
                                     "--conditions", param_hint="--bank-free")
    files = {}  # flag -> (path, the layers it was trained for)
    if normals is not None:
        files["--normals"] = (normals, _check_normals(normals, "--normals", "stair").get("layers"))
    if bank_free is not None:
        files["--bank-free"] = (bank_free, _check_normals(bank_free, "--bank-free", "bank_free").get("layers"))
    if given_layers is not None:
        _layer_mismatch(given_layers, files)
    elif not layers and len(files) == 2 and files["--normals"][1] != files["--bank-free"][1]:
        _layer_mismatch(tuple(files["--normals"][1] or ()), {"--bank-free": files["--bank-free"]},
                        hint="--bank-free")
    cfg = build_config(EvalConfig, {}, sessions=sessions, turns=turns, levels=lv, k=k, temperature=temperature,
                       max_new_tokens=max_new_tokens, seed=seed,
                       conditions=tuple(c.strip() for c in conditions.split(",") if c.strip()), budgets=budget_list)
    run = open_run(out, command="stair eval", overwrite=overwrite,
                   config={**dataclasses.asdict(cfg), "model": used_model, "quick": quick,
                           "normals": str(normals) if normals else None, "layers": layers,
                           "bank_free": str(bank_free) if bank_free else None})
    if picked:
        console.print(picked, markup=False)
    if run.finished and (out / "results.json").exists():
        res = read_stored_json(out / "results.json", what="evaluation results")
        console.print(results_table(res, cfg.k))
        console.print(f"{out} already holds this finished evaluation (same config); add --overwrite to run it "
                      f"again.", markup=False)
        return
    model, tok = load_model(model_path, quick, console, threads=threads)
    lay = _resolve_layers(layers, model) if layers else (None if normals or bank_free else
                                                          _resolve_layers("auto", model))
    if lay is not None:
        _layer_mismatch(lay, files)  # --layers auto resolved on the model
    run_layers = lay if lay is not None else next((fl for _, fl in files.values() if fl), None)
    used = {flag: (path, "stair" if flag == "--normals" else "bank_free") for flag, (path, _) in files.items()
            if chosen & ({"stair", "shuffled", "reflected"} if flag == "--normals" else {"bank_free"})}
    if run_layers and used:
        source = ("the quick tiny model" if quick else
                  f"{model_source(model_path)} {used_model}" if used_model else "the embedded tiny model")
        _check_fit(model, used, tuple(run_layers), source)
    with recorded(run, console, saved=lambda: "nothing (results are written at the end)"):
        try:
            res = evaluate(model, tok, cfg, normals=normals, bank_free=bank_free, layers=lay, console=console,
                           progress=progress_enabled())
        except (ValueError, TypeError) as err:
            raise usage_error(str(err)) from None
        report(res, cfg.k, out, console)


def report(res: dict, k: int, out: Path, console) -> None:
    """Print the table and cost line; write results.jsonl, results.json and avg.png under ``out``."""
    from treadle.stair.evaluation import bar_chart, results_table, write_jsonl

    console.print(results_table(res, k))
    if res["skipped"]:
        console.print(f"skipped (no weights given): {', '.join(res['skipped'])}")
    c = res["cost"]
    if c:
        peak = c.get("extra_peak_bytes")
        console.print(f"cost: prefill {c['prefill_s_native'] * 1e3:.1f} ms native vs {c['prefill_s_stair'] * 1e3:.1f} ms "
                      f"STAIR (extra {c['extra_prefill_s'] * 1e3:+.1f} ms); extra peak memory: "
                      f"{'n/a on CPU' if peak is None else f'{peak / 2**20:.1f} MiB'}")
    out = Path(out)
    write_jsonl(res, out / "results.jsonl")
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    png = bar_chart(res, out / "avg.png", k)
    console.print(f"wrote {out / 'results.jsonl'}, {png}")

"""``treadle stair ...``: train STAIR normals and evaluate Vanilla / Native / STAIR with controls.

    treadle stair train [--model PATH] [--layers 3,11,19|auto] [--steps N] [--out runs/stair]
    treadle stair eval  [--model PATH] --normals runs/stair/normals.safetensors [--bank-free ...]
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer
from rich.console import Console

from treadle.cli_lists import parse_list

app = typer.Typer(help="STAIR: reflected read-out of earlier responses' K/V (train the normals, evaluate).",
                  no_args_is_help=True, add_completion=False)
console = Console()


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


def _check_out(out: Path) -> None:
    """``--out`` must be a folder that exists or can be created (checked before any work, nothing left behind)."""
    from treadle.run_dirs import check_out_dir

    try:
        check_out_dir(out, "--out")
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--out") from None


def _check_normals(path, hint: str, kind: str) -> None:
    """``path`` must be a STAIR weights file of ``kind`` (checked before any work)."""
    from treadle.stair.controller import NormalsFileError, read_normals_config

    try:
        cfg = read_normals_config(path)
    except (FileNotFoundError, NormalsFileError) as err:
        raise typer.BadParameter(str(err), param_hint=hint) from None
    if cfg.get("kind") != kind:
        raise typer.BadParameter(f"{path} holds kind={cfg.get('kind')!r} weights, expected {kind!r}", param_hint=hint)


def _load(model_path, quick: bool):
    import torch

    from treadle.models.tiny import CheckpointError, TinyTrainConfig, load_default_model

    try:
        cfg = TinyTrainConfig.quick() if quick else None
        name = "tiny-qwen3-quick" if quick and model_path is None else "tiny-qwen3"
        model, tok = load_default_model(model_path, config=cfg, name=name, console=console, progress=False)
    except (CheckpointError, FileNotFoundError) as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2)
    if torch.cuda.is_available():
        model = model.cuda()
    return model, tok


@app.command("train")
def train_cmd(
    model_path: str = typer.Option(None, "--model", help="Local HF checkpoint (default: the embedded tiny model)."),
    layers: str = typer.Option("auto", help="Controlled layers, e.g. 3,11,19 ('auto': those, or spread)."),
    kind: str = typer.Option("stair", help="'stair' (normals) or 'bank_free' (the same-budget control)."),
    eps: float = typer.Option(0.0, help="pi_ref uniform mixing weight in [0, 1)."),
    steps: int = typer.Option(60, help="Optimizer steps."),
    sessions: int = typer.Option(96, help="Training sessions (each `turns` independent problems)."),
    turns: int = typer.Option(4, help="Problems per session (turn 1 builds the bank)."),
    levels: str = typer.Option("1,2", help="Difficulty level per turn (treadle.data levels), cycled."),
    batch_size: int = typer.Option(16, help="Sessions per micro-batch."),
    grad_accum: int = typer.Option(1, help="Micro-batches per optimizer step."),
    lr: float = typer.Option(2e-2, help="AdamW learning rate."),
    lambda_kl: float = typer.Option(1.0, help="Weight of KL(native || stair)."),
    responses: str = typer.Option("self", help="'self' (backbone's own greedy responses) or 'gold'."),
    seed: int = typer.Option(0, help="Seed."),
    out: Path = typer.Option(Path("runs/stair"), help="Run folder (normals.safetensors, optim.pt, log.jsonl)."),
    resume: bool = typer.Option(True, help="Continue from a checkpoint in --out."),
    threads: int = typer.Option(0, min=0, help="torch CPU threads (0: leave as is)."),
    quick: bool = typer.Option(False, help="Use the seconds-long quick tiny model when no --model is given."),
) -> None:
    """Train STAIR normals: CE + lambda_kl * KL(native || stair) on teacher-forced turns 2..n."""
    import torch

    from treadle.stair.arch import UnsupportedModelError
    from treadle.stair.controller import KINDS
    from treadle.stair.training import StairTrainConfig, read_log, train

    if kind not in KINDS:
        raise typer.BadParameter(f"kind must be one of {KINDS}, got {kind!r}", param_hint="--kind")
    if not 0.0 <= eps < 1.0:
        raise typer.BadParameter(f"eps must be a number in [0, 1), got {eps!r}", param_hint="--eps")
    _levels(levels)
    if layers.strip() != "auto":
        parse_layers(layers, None)  # syntax only (ranges need the model)
    _check_out(out)
    try:  # everything but the layers' range is checked before loading the model
        cfg = StairTrainConfig(layers=(), kind=kind, eps=eps, steps=steps, sessions=sessions, turns=turns,
                               levels=_levels(levels), batch_size=batch_size, grad_accum=grad_accum,
                               lr=lr, lambda_kl=lambda_kl, responses=responses, seed=seed,
                               save_every=max(1, min(25, steps)))
    except (ValueError, TypeError) as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2)
    if threads:
        torch.set_num_threads(threads)
    model, tok = _load(model_path, quick)
    try:
        cfg = dataclasses.replace(cfg, layers=parse_layers(layers, model))
        result = train(model, tok, cfg, out, resume=resume, console=console)
    except (ValueError, TypeError, UnsupportedModelError) as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2)
    log = read_log(out)
    console.print(f"trainable parameters: {result['trainable']} | loss {log[0]['loss']:.4f} -> {log[-1]['loss']:.4f} "
                  f"(first/last step); fixed probe batch {result['probe_loss_before']:.4f} -> "
                  f"{result['probe_loss_after']:.4f} | saved {result['path']}")


@app.command("eval")
def eval_cmd(
    model_path: str = typer.Option(None, "--model", help="Local HF checkpoint (default: the embedded tiny model)."),
    normals: Path = typer.Option(None, help="Trained normals (treadle stair train)."),
    bank_free: Path = typer.Option(None, "--bank-free", help="Trained bank-free control (train --kind bank_free)."),
    layers: str = typer.Option(None, help="Controlled layers (default: from the normals file)."),
    sessions: int = typer.Option(32, help="Held-out sessions (problems per turn)."),
    turns: int = typer.Option(4, help="Turns per session."),
    levels: str = typer.Option("1,2", help="Difficulty level per turn (treadle.data levels), cycled."),
    k: int = typer.Option(4, help="Samples per problem (Avg@k, Pass@k)."),
    temperature: float = typer.Option(0.7, help="Sampling temperature."),
    max_new_tokens: int = typer.Option(10, help="Decoding budget."),
    conditions: str = typer.Option(",".join(("vanilla", "native", "stair", "random", "bank_free", "shuffled",
                                             "reflected")), help="Comma-separated conditions."),
    budgets: str = typer.Option("", help="Bank prefix budgets in tokens, e.g. 16,64."),
    seed: int = typer.Option(1234, help="Problems and sampling seed."),
    out: Path = typer.Option(Path("runs/stair-eval"), help="Output folder (results.jsonl, results.json, avg.png)."),
    threads: int = typer.Option(0, min=0, help="torch CPU threads (0: leave as is)."),
    quick: bool = typer.Option(False, help="Use the quick tiny model when no --model is given."),
) -> None:
    """Evaluate Vanilla / Native / STAIR and the controls; table, JSONL and a PNG bar chart."""
    import torch

    from treadle.stair.evaluation import EvalConfig, evaluate

    _levels(levels)
    if layers and layers.strip() != "auto":
        parse_layers(layers, None)  # syntax only (ranges need the model)
    budget_list = parse_list(budgets, "--budgets", example="16,64", minimum=1, allow_empty=True)
    _check_out(out)
    if normals is not None:
        _check_normals(normals, "--normals", "stair")
    if bank_free is not None:
        _check_normals(bank_free, "--bank-free", "bank_free")
    try:
        cfg = EvalConfig(sessions=sessions, turns=turns, levels=_levels(levels), k=k,
                         temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                         conditions=tuple(c.strip() for c in conditions.split(",") if c.strip()),
                         budgets=budget_list)
    except ValueError as err:  # checked before loading the model
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2)
    if threads:
        torch.set_num_threads(threads)
    model, tok = _load(model_path, quick)
    try:
        lay = parse_layers(layers, model) if layers else None
        res = evaluate(model, tok, cfg, normals=normals, bank_free=bank_free, layers=lay, console=console)
    except (ValueError, TypeError) as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2)
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

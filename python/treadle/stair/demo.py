"""``treadle demo`` section "stair": a short STAIR train + evaluation on the embedded tiny model.

Trains the reflection normals and the bank-free control (same parameter budget) on generated
multi-problem sessions, then evaluates Vanilla / Native / STAIR and the controls (random reflection,
bank-free, K/V shuffled, direct reflected read, one bank prefix budget) on held-out sessions.
Writes ``run_dir/{train,train-bank-free}/log.jsonl``, ``run_dir/eval/{results.jsonl,avg.png}``.
"""
from __future__ import annotations

from pathlib import Path

import torch


def run(run_dir: Path, quick: bool, console) -> dict:
    """Run the section (``quick``: the seconds-long quick tiny model and a few steps).

    Returns:
        {"train": train result, "eval": evaluation result}.
    """
    from treadle.cli_output import progress_enabled
    from treadle.models.tiny import TinyTrainConfig, load_default_model
    from treadle.stair.cli import report
    from treadle.stair.controller import default_layers
    from treadle.stair.evaluation import EvalConfig, evaluate
    from treadle.stair.training import StairTrainConfig, read_log, train

    run_dir = Path(run_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: OpenMP spinning on a shared 2-core box costs more than it gives
    try:
        if quick:
            model, tok = load_default_model(config=TinyTrainConfig.quick(), name="tiny-qwen3-quick", console=console,
                                            progress=False)
        else:
            model, tok = load_default_model(console=console, progress=False)
        layers = default_layers(model)
        steps = 3 if quick else 40
        common = dict(layers=layers, steps=steps, sessions=8 if quick else 64, batch_size=4 if quick else 16,
                      save_every=steps, turns=3 if quick else 4, levels=[1, 2])
        console.print(f"controlled layers {layers} of a {len(model.model.layers)}-layer tiny Qwen3")
        tr = train(model, tok, StairTrainConfig(kind="stair", **common), run_dir / "train", resume=False,
                   console=console, progress=not quick and progress_enabled())
        log = read_log(run_dir / "train")
        k = max(1, len(log) // 4)
        first = sum(r["loss"] for r in log[:k]) / k
        last = sum(r["loss"] for r in log[-k:]) / k
        console.print(f"STAIR training loss (mean of first/last {k} steps): {first:.4f} -> {last:.4f}; on a fixed probe "
                      f"batch: {tr['probe_loss_before']:.4f} -> {tr['probe_loss_after']:.4f}")
        train(model, tok, StairTrainConfig(kind="bank_free", **common), run_dir / "train-bank-free", resume=False,
              console=console, progress=not quick and progress_enabled())
        cfg = EvalConfig(sessions=4 if quick else 24, turns=3 if quick else 4, levels=[1, 2], k=2 if quick else 4,
                         temperature=0.7, max_new_tokens=8 if quick else 10, budgets=(2,) if quick else (4,))
        res = evaluate(model, tok, cfg, normals=run_dir / "train" / "normals.safetensors",
                       bank_free=run_dir / "train-bank-free" / "normals.safetensors",
                       progress=not quick and progress_enabled(), console=console)
        report(res, cfg.k, run_dir / "eval", console)
        return {"train": tr, "eval": res}
    finally:
        torch.set_num_threads(threads)

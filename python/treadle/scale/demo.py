"""``treadle demo`` section "scale": a short SCALE Stage I + Stage II on the embedded tiny model.

1. Stage I (:func:`treadle.scale.sft`): LoRA SFT (r = 16, alpha = 16, all linear layers) of the tiny
   Qwen3 on worked problems; the adapter is saved with PEFT's ``save_pretrained``.
2. Stage II (:func:`treadle.scale.train`): zero-initialised gates on every LoRA Linear (lambda = 1:
   the Stage-I model), only the gates trained on the normalised top-k entropy of response positions.
3. A before/after table (objective, held-out entropy and greedy accuracy, lambda shares overall, per
   module type and per layer) and ``run_dir/stage2/lambda_hist.png``.

Writes ``run_dir/stage1/{adapter/,log.jsonl,summary.json}`` and ``run_dir/stage2/{config.json,
log.jsonl,summary.json,gates.safetensors,lambda_hist.png}``. Seeded: same settings, same numbers.
"""
from __future__ import annotations

from pathlib import Path


def run(run_dir: Path, quick: bool, console) -> dict:
    """Run the section (``quick``: the seconds-long quick tiny model and a few steps).

    Returns:
        ``{"sft": {probe_loss_before, probe_loss_after, adapter}, "train": the Stage-II summary}``.
    """
    import torch

    run_dir = Path(run_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: OpenMP spinning on a shared 2-core box costs more than it gives
    try:
        return _run(run_dir, quick, console)
    finally:
        torch.set_num_threads(threads)


def _run(run_dir: Path, quick: bool, console) -> dict:
    from treadle.models.tiny import TinyTrainConfig, load_default_model
    from treadle.scale.sft import SFTConfig, sft
    from treadle.scale.stage_two import train
    from treadle.scale.training import ScaleTrainConfig, summary_tables

    if quick:
        model, tok = load_default_model(config=TinyTrainConfig.quick(), name="tiny-qwen3-quick", console=console,
                                        progress=False)
        s1, s2 = SFTConfig.quick(), ScaleTrainConfig.quick()
    else:
        model, tok = load_default_model(console=console, progress=False)
        s1 = SFTConfig(steps=40)
        s2 = ScaleTrainConfig(train_size=192, epochs=2, eval_size=32)
    res = sft(model, tok, s1, run_dir / "stage1", console=console)
    console.print(f"Stage II: gates on every LoRA Linear, lambda in ({s2.L:g}, {s2.U:g}), tau {s2.tau:g}, "
                  f"top-k entropy k={s2.k} over response positions; no CE, no KL")
    summary = train(res.model, tok, s2, run_dir / "stage2", console=console)
    for t in summary_tables(summary):
        console.print(t)
    console.print(f"lambda histogram: {summary['histogram']} | gates: {summary['gates']}", markup=False)
    return {"sft": {"probe_loss_before": res.probe_loss_before, "probe_loss_after": res.probe_loss_after,
                    "adapter": str(res.adapter_path)}, "train": summary}

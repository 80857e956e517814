"""SCALE (per-token gated LoRA; SCALE sec. 3.3, 4.3, 5.3) on PEFT models.

- :mod:`treadle.scale.gates`: gates on PEFT LoRA layers (attach, freeze, save/load, remove, merge, lambda
  statistics).
- :mod:`treadle.scale.sft`: Stage I, ordinary LoRA SFT on TRL's SFTTrainer + PEFT (r = 16, alpha = 16, all linear).
- :mod:`treadle.scale.training`: Stage II, only the gates, on the normalised top-k entropy over
  response positions (no CE, no KL); ablations (no reverse, no extrapolate, CE calibration);
  held-out accuracy, entropy and the learned lambda distribution before/after.
- :mod:`treadle.scale.stage_two`: the Stage-II run around :mod:`treadle.scale.trainer` (a
  ``transformers.Trainer`` subclass: one process, DDP or FSDP under torchrun / accelerate launch);
  :mod:`treadle.scale.checkpoint`: what a resume checks (Trainer checkpoints, any world size).
- :mod:`treadle.scale.sweep`: (L, U) grids in parallel processes, with a heatmap.
- :mod:`treadle.scale.batches`: prompt + response batches (dataset answers or Stage-I samples).

The kernels live in :mod:`treadle.ops` (``gated_lora``, ``topk_entropy``, ``topk_entropy_from_hidden``);
this package knows PEFT. Command line: ``treadle scale sft | train | sweep``; ``treadle demo
--sections scale``.
"""
from treadle.scale.gates import (
    GateConfig,
    GateError,
    attach_gates,
    gated_layers,
    lambda_report,
    lambda_shares,
    load_gates,
    record_lambda,
    remove_gates,
    save_gates,
)
from treadle.scale.sft import SFTConfig, SFTResult, sft, stage_one_trainer
from treadle.scale.sweep import sweep
from treadle.scale.training import (
    ScaleTrainConfig,
    clamp_lambda,
    evaluate,
    gate_objective,
    load_stage_one,
)
from treadle.scale.stage_two import train

__all__ = ["GateConfig", "GateError", "attach_gates", "gated_layers", "lambda_report", "lambda_shares", "load_gates",
           "record_lambda", "remove_gates", "save_gates", "SFTConfig", "SFTResult", "sft", "stage_one_trainer",
           "ScaleTrainConfig", "clamp_lambda", "evaluate", "gate_objective", "load_stage_one", "train", "sweep"]

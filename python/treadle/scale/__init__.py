"""SCALE (per-token gated LoRA) integration: gates on PEFT LoRA layers, saving/loading, lambda statistics.

The kernels live in :mod:`treadle.ops` (``gated_lora``, ``topk_entropy``, ``topk_entropy_from_hidden``);
this package knows PEFT. Stage-II training and sweeps are not here yet (issue 6).
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
    save_gates,
)

__all__ = ["GateConfig", "GateError", "attach_gates", "gated_layers", "lambda_report", "lambda_shares", "load_gates",
           "record_lambda", "save_gates"]

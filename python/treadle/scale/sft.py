"""SCALE Stage I (SCALE sec. 4.3, "Stage I: learn"): ordinary LoRA SFT through PEFT.

The paper's Stage I is plain supervised LoRA fine-tuning (r = 16, alpha = 16, all linear layers) whose
result, the frozen LoRA delta, Stage II then re-weights per token (:mod:`treadle.scale.training`).
Nothing here is SCALE-specific, which is the point: any existing PEFT LoRA adapter can be used for
Stage II instead (``treadle scale train --adapter DIR``).

Data: worked problems from :class:`treadle.data.ProblemGenerator` (train split; the prompt as one user
turn, the verified answer + EOS as the assistant turn), cross-entropy on response tokens only.
The adapter is written with PEFT's ``save_pretrained`` (``adapter_config.json`` +
``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained``), next to the tokenizer.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from treadle.run_dirs import make_out_dir

__all__ = ["SFTConfig", "SFTResult", "sft", "response_loss", "linear_targets"]


@dataclass(frozen=True)
class SFTConfig:
    """Stage-I settings (SCALE sec. 4.3: r = 16, alpha = 16, all linear layers).

    Attributes:
        r, lora_alpha: LoRA rank and alpha (``scaling = alpha / r``).
        target_modules: PEFT ``target_modules``: ``"all-linear"`` or module names such as
            ``("q_proj", "v_proj")``. :func:`sft` resolves ``"all-linear"`` itself to the full names of
            the model's ``nn.Linear`` leaf modules except the output head (:func:`linear_targets`), so
            that every LoRA layer is one Stage II can gate; unlike PEFT's own ``"all-linear"`` it never
            wraps MoE routers or fused expert parameters (e.g. Qwen3-Next's ``mlp.gate`` /
            ``mlp.experts``, which PEFT would wrap in ``ParamWrapper`` layers that have no gate).
        lora_dropout: LoRA dropout during Stage I (Stage II runs without it).
        steps: optimizer steps; batch_size: problems per step (fresh problems each step).
        lr: AdamW learning rate (linear warm-up over the first 10% of steps, then constant);
            weight_decay, grad_clip: AdamW weight decay and gradient-norm clip.
        levels: difficulty levels of :mod:`treadle.data.arithmetic` drawn uniformly (train split).
        probe_size: held-out problems whose response loss is reported before/after.
        seed: seeds the LoRA initialisation and the problem stream.
    """

    r: int = 16
    lora_alpha: int = 16
    target_modules: str | tuple = "all-linear"
    lora_dropout: float = 0.0
    steps: int = 60
    batch_size: int = 32
    lr: float = 2e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    levels: tuple = (1, 2, 3)
    probe_size: int = 64
    seed: int = 0

    @classmethod
    def quick(cls, **overrides) -> "SFTConfig":
        """Seconds-long settings for tests and ``--quick`` runs."""
        kw = dict(steps=6, batch_size=8, probe_size=8)
        kw.update(overrides)
        return cls(**kw)

    def __post_init__(self) -> None:
        from treadle.data.arithmetic import difficulty

        for name in ("r", "steps", "batch_size", "probe_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SFTConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("lora_alpha", "lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
                raise ValueError(f"SFTConfig.{name} must be a finite number > 0, got {v!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"SFTConfig.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.weight_decay < 0 or not self.grad_clip > 0:
            raise ValueError(f"SFTConfig.weight_decay must be >= 0 and grad_clip > 0, got {self.weight_decay!r}, "
                             f"{self.grad_clip!r}")
        tm = self.target_modules
        if not (tm == "all-linear" or (isinstance(tm, (tuple, list)) and tm and all(isinstance(m, str) and m
                                                                                    for m in tm))):
            raise ValueError(f"SFTConfig.target_modules must be 'all-linear' or a non-empty tuple of module names, "
                             f"got {tm!r}")
        if not self.levels:
            raise ValueError("SFTConfig.levels must name at least one difficulty level")
        for lv in self.levels:
            difficulty(lv)


@dataclass
class SFTResult:
    """What :func:`sft` did.

    Attributes:
        model: the ``peft.PeftModel`` (in eval mode; the caller's base model is wrapped in place).
        adapter_path: folder written by ``save_pretrained`` (None if ``out_dir`` was None).
        probe_loss_before, probe_loss_after: mean response CE (nats/token) on the held-out probe.
        losses: training loss per step.
        seconds: wall time of the training loop.
        trainable: number of LoRA parameters trained.
    """

    model: nn.Module
    adapter_path: Path | None
    probe_loss_before: float
    probe_loss_after: float
    losses: list = field(default_factory=list)
    seconds: float = 0.0
    trainable: int = 0


def response_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy (nats per token, float32 scalar) of the response tokens of a
    :class:`treadle.scale.batches.ResponseBatch` under ``model`` (teacher forcing; prompt and padding
    excluded).

    Raises:
        ValueError: the batch has no response position.
    """
    if not bool(batch.response_mask.any()):
        raise ValueError("the batch has no response positions: response CE is undefined")
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    nxt = torch.roll(batch.input_ids, -1, dims=1)
    return nn.functional.cross_entropy(logits[batch.response_mask].float(), nxt[batch.response_mask])


def linear_targets(model: nn.Module) -> list[str]:
    """Full names of the ``nn.Linear`` leaf modules of ``model`` except its output head: what Stage I's
    ``target_modules="all-linear"`` means in treadle (every resulting LoRA layer can be gated in Stage II).

    Modules of other types (MoE routers such as Qwen3-Next's ``Qwen3NextTopKRouter``, fused expert
    parameters, convolutions, embeddings) are left out. So are, on MoE models whose PEFT config PEFT
    converts for transformers v5 (Qwen2-MoE / Qwen3-Next family ...), Linears named like the old
    per-expert projections (``gate_proj`` / ``up_proj`` / ``down_proj``, e.g. the shared expert's):
    PEFT maps any target with those names onto the fused expert parameters (``ParamWrapper``), which
    Stage II cannot gate.

    Raises:
        ValueError: the model has no such module.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    remapped = _peft_moe_remapped(model)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m is not head and n and n.rsplit(".", 1)[-1] not in {"lm_head", *remapped}]
    if not names:
        raise ValueError("the model has no nn.Linear module besides the output head: nothing for LoRA to target")
    return names


def _peft_moe_remapped(model: nn.Module) -> set:
    """Leaf module names that PEFT (transformers v5 MoE conversion) re-targets to fused expert parameters
    for this model type; empty when PEFT has no such conversion (or this PEFT has no such table)."""
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ImportError:
        return set()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base_type = getattr(conv, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    return set(getattr(conv, "_MOE_TARGET_MODULE_MAPPING", {}).get(base_type, {}) or ())


def _has_lora(model: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def sft(model: nn.Module, tokenizer, config: SFTConfig | None = None, out_dir: str | Path | None = None, *,
        console=None, progress: bool = False) -> SFTResult:
    """Stage I of SCALE (sec. 4.3): wrap ``model`` with a fresh PEFT LoRA adapter and fine-tune it.

    Args:
        model: a HF causal LM without LoRA layers (e.g. :func:`treadle.models.load_default_model`'s, or a
            tiny one from :func:`treadle.models.build_tiny_model`); it is wrapped in place by
            ``peft.get_peft_model``.
        tokenizer: its tokenizer (chat template, EOS and pad token).
        config: :class:`SFTConfig` (default: r = 16, alpha = 16, all linear layers).
        out_dir: run folder: ``adapter/`` (PEFT ``save_pretrained`` + tokenizer), ``log.jsonl`` (one line
            per step), ``summary.json``. None: nothing is written.
        console: a rich Console for messages (None: silent); progress: a tqdm bar.

    Returns:
        :class:`SFTResult` (probe loss before/after on held-out problems, per-step losses).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` already has LoRA layers; a tokenizer without chat template / EOS / pad;
            no linear module matches ``target_modules`` (PEFT's message); ``out_dir`` is a file, under a
            file, or not writable. Raised before training and (but for PEFT's message) before ``model``
            is changed.
    """
    import peft
    from tqdm.auto import tqdm

    from treadle.data.arithmetic import ProblemGenerator
    from treadle.scale.batches import collate, problem_pairs

    config = config or SFTConfig()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module (a HF causal LM), got {type(model).__name__}")
    if _has_lora(model):
        raise ValueError("model already has LoRA layers; Stage I starts from a base model (pass the adapter to "
                         "Stage II instead: treadle scale train --adapter DIR)")
    out = make_out_dir(out_dir) if out_dir is not None else None  # before the model is wrapped
    targets = (linear_targets(model) if config.target_modules == "all-linear" else list(config.target_modules))
    weights = {lv: 1.0 for lv in config.levels}
    probe = problem_pairs(tokenizer, ProblemGenerator(config.seed + 10_007).mixture(config.probe_size, weights,
                                                                                  split="heldout"))
    torch.manual_seed(config.seed)
    lcfg = peft.LoraConfig(r=config.r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                           target_modules=targets, task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, lcfg)
    device = next(pm.parameters()).device
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    warm = max(1, config.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    probe_batch = collate(probe, tokenizer.pad_token_id).to(device)

    def probe_loss() -> float:
        pm.eval()
        with torch.no_grad():
            return float(response_loss(pm, probe_batch))

    before = probe_loss()
    log = None
    if out is not None:
        log = open(out / "log.jsonl", "w")
    gen = ProblemGenerator(config.seed)
    losses = []
    t0 = time.perf_counter()
    try:
        pm.train()
        for step in tqdm(range(config.steps), disable=not progress, desc="scale sft"):
            batch = collate(problem_pairs(tokenizer, gen.mixture(config.batch_size, weights, split="train")),
                            tokenizer.pad_token_id).to(device)
            loss = response_loss(pm, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log is not None:
                log.write(json.dumps({"step": step, "loss": losses[-1], "lr": sched.get_last_lr()[0]}) + "\n")
    finally:
        if log is not None:
            log.close()
    seconds = time.perf_counter() - t0
    after = probe_loss()
    adapter = None
    if out is not None:
        adapter = out / "adapter"
        pm.save_pretrained(str(adapter))
        pm.scale_adapter_path = str(adapter)  # recorded by Stage II's summary
        tokenizer.save_pretrained(str(adapter))
        summary = {"config": dataclasses.asdict(config), "base_model": getattr(model, "name_or_path", "") or None,
                   "probe_loss_before": before, "probe_loss_after": after, "seconds": seconds,
                   "trainable": sum(p.numel() for p in params), "adapter": str(adapter)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if console is not None:
        console.print(f"Stage I (LoRA r={config.r}, alpha={config.lora_alpha}, {config.target_modules}): "
                      f"{sum(p.numel() for p in params)} trainable parameters, {config.steps} steps in {seconds:.1f}s; "
                      f"held-out response CE {before:.4f} -> {after:.4f}" + (f"; adapter {adapter}" if adapter else ""),
                      markup=False)
    return SFTResult(pm, adapter, before, after, losses, seconds, sum(p.numel() for p in params))

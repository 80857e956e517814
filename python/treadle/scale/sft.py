"""SCALE Stage I (SCALE sec. 4.3, "Stage I: learn"): ordinary LoRA SFT on TRL's ``SFTTrainer``.

The paper's Stage I is plain supervised LoRA fine-tuning (r = 16, alpha = 16, all linear layers) whose
result, the frozen LoRA delta, Stage II then re-weights per token (:mod:`treadle.scale.training`).
Nothing here is SCALE-specific, which is the point: :func:`sft` is a thin call of ``trl.SFTTrainer``
with a ``peft.LoraConfig`` (so bf16, gradient accumulation, ``report_to``, multi-GPU through
accelerate work as in any TRL run), and any existing PEFT LoRA adapter can be used for Stage II
instead (``treadle scale train --adapter DIR``).

Data: worked problems from :class:`treadle.data.ProblemGenerator` (train split, ``steps x batch_size``
fresh problems, each seen once) as a prompt-completion dataset: the prompt rendered with the
tokenizer's chat template (one user turn + the generation prompt), the verified answer as the
completion; TRL appends EOS and masks the prompt tokens (``completion_only_loss``), so the loss is the
cross-entropy on the answer and its EOS only. The adapter is written with PEFT's ``save_pretrained``
(``adapter_config.json`` + ``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained``),
next to the tokenizer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

import torch
from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from torch import nn

from treadle.run_dirs import make_out_dir, read_stored_json

__all__ = ["SFTConfig", "SFTResult", "sft", "stage_one_trainer", "sft_dataset", "response_loss", "linear_targets"]


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class SFTConfig:
    """Stage-I settings (SCALE sec. 4.3: r = 16, alpha = 16, all linear layers), a frozen pydantic
    dataclass: bad values raise :class:`pydantic.ValidationError` (a ``ValueError``) naming the field.

    Attributes:
        r, lora_alpha: LoRA rank and alpha (``scaling = alpha / r``).
        target_modules: PEFT ``target_modules``: ``"all-linear"`` or module names such as
            ``("q_proj", "v_proj")``. :func:`sft` resolves ``"all-linear"`` itself to the full names of
            the model's ``nn.Linear`` leaf modules except the output head (:func:`linear_targets`), so
            that every LoRA layer is one Stage II can gate; unlike PEFT's own ``"all-linear"`` it never
            wraps MoE routers or fused expert parameters (e.g. Qwen3-Next's ``mlp.gate`` /
            ``mlp.experts``, which PEFT would wrap in ``ParamWrapper`` layers that have no gate).
        lora_dropout: LoRA dropout during Stage I (Stage II runs without it).
        steps: optimizer steps (``max_steps``); batch_size: problems per step
            (``per_device_train_batch_size``; fresh problems each step).
        lr: AdamW learning rate (transformers' ``constant_with_warmup``: linear warm-up from 0 over the
            first ``steps // 10`` steps, none below 10 steps, then constant); weight_decay, grad_clip:
            AdamW weight decay and ``max_grad_norm``.
        levels: difficulty levels of :mod:`treadle.data.arithmetic` drawn uniformly (train split).
        probe_size: held-out problems whose response loss is reported before/after.
        seed: seeds the LoRA initialisation, the problem stream and the trainer.
        report_to: the trainer's ``report_to`` (``"none"``, ``"tensorboard"``, ``"wandb"``...).
        bf16: train under bf16 autocast (TRL's own default is True where supported; False here, so
            that Stage I is the float32 computation the rest of treadle's SCALE runs on, and the
            trained model's forward is not left wrapped in accelerate's autocast).
    """

    r: int = Field(16, ge=1, strict=True)
    lora_alpha: float = Field(16, gt=0, allow_inf_nan=False)
    target_modules: Union[Literal["all-linear"], tuple[str, ...]] = "all-linear"
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    steps: int = Field(60, ge=1, strict=True)
    batch_size: int = Field(32, ge=1, strict=True)
    lr: float = Field(2e-3, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    grad_clip: float = Field(1.0, gt=0, allow_inf_nan=False)
    levels: tuple[int, ...] = (1, 2, 3)
    probe_size: int = Field(64, ge=1, strict=True)
    seed: int = 0
    report_to: str = "none"
    bf16: bool = False

    @classmethod
    def quick(cls, **overrides) -> "SFTConfig":
        """Seconds-long settings for tests and ``--quick`` runs."""
        kw = dict(steps=6, batch_size=8, probe_size=8)
        kw.update(overrides)
        return cls(**kw)

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v):
        if v != "all-linear" and (not v or not all(m for m in v)):
            raise ValueError(f"target_modules must be 'all-linear' or a non-empty tuple of module names, got {v!r}")
        return v

    @field_validator("levels")
    @classmethod
    def _levels(cls, v):
        from treadle.data.arithmetic import difficulty

        if not v:
            raise ValueError("levels must name at least one difficulty level")
        for lv in v:
            difficulty(lv)
        return v


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


def sft_dataset(tokenizer, problems):
    """A TRL prompt-completion ``datasets.Dataset`` of worked problems: ``prompt`` is the chat-template
    rendering of the problem as one user turn plus the generation prompt, ``completion`` the verified
    answer (TRL appends EOS and masks the prompt).

    Raises:
        ValueError: empty ``problems``; a tokenizer without a chat template / EOS / pad token.
    """
    from datasets import Dataset

    from treadle.scale.batches import _check_tokenizer

    if not problems:
        raise ValueError("problems must be a non-empty list")
    _check_tokenizer(tokenizer)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False,
                                             add_generation_prompt=True) for p in problems]
    return Dataset.from_dict({"prompt": prompts, "completion": [p.answer for p in problems]})


@contextlib.contextmanager
def _quiet():
    """Silence the dataset-preparation progress bars, transformers' info/warning lines and the
    FutureWarnings of the trainer's setup (our own console line says what happened)."""
    import datasets
    import transformers

    bars = datasets.utils.logging.is_progress_bar_enabled()
    verbosity = transformers.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def _world() -> tuple[int, bool]:
    """``(world size, this process writes)`` as the HF Trainer sees them: torchrun's ``WORLD_SIZE`` and
    ``RANK`` (one process: ``(1, True)``)."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")) == 0


def _per_device_batch(config: SFTConfig) -> int:
    """``config.batch_size`` is the global batch: split evenly over torchrun's ranks (ValueError if it
    does not divide)."""
    world, _ = _world()
    if config.batch_size % world:
        raise ValueError(f"batch_size {config.batch_size} is the global batch and must divide evenly over the "
                         f"{world} ranks of this torchrun job (a multiple of {world})")
    return config.batch_size // world


def _trainer_args(config: SFTConfig, output_dir: str, progress: bool, checkpoint_every: int | None = None,
                  parallel: str | None = None, layer_classes=()):
    from trl import SFTConfig as TRLSFTConfig

    from treadle.trainer_support import fsdp_arguments

    saving = (dict(save_strategy="no") if checkpoint_every is None else
              dict(save_strategy="steps", save_steps=checkpoint_every, save_total_limit=2, save_only_model=False))
    return TRLSFTConfig(**saving,
        output_dir=output_dir, max_steps=config.steps, per_device_train_batch_size=_per_device_batch(config),
        gradient_accumulation_steps=1, learning_rate=config.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=config.steps // 10, weight_decay=config.weight_decay, max_grad_norm=config.grad_clip,
        optim="adamw_torch", seed=config.seed, data_seed=config.seed, logging_steps=1,
        report_to=config.report_to, disable_tqdm=not progress, completion_only_loss=True, packing=False,
        dataloader_num_workers=0, dataset_num_proc=None, use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False, **fsdp_arguments(parallel, layer_classes),
        remove_unused_columns=True, bf16=config.bf16, fp16=False)


def stage_one_trainer(model: nn.Module, tokenizer, config: SFTConfig, output_dir: str | Path, *,
                      targets: list[str] | None = None, callbacks=(), progress: bool = False,
                      checkpoint_every: int | None = None, parallel: str | None = None):
    """The ``trl.SFTTrainer`` that :func:`sft` runs (not yet trained): ``model`` wrapped with a fresh
    ``peft.LoraConfig`` (r, alpha, dropout of ``config``; ``targets`` or :func:`linear_targets`), on
    ``config.steps * config.batch_size`` fresh train-split problems (:func:`sft_dataset`).

    Use it to run Stage I with TRL features :func:`sft` does not expose (edit ``trainer.args``
    before ``trainer.train()``: bf16, gradient accumulation...). ``checkpoint_every``: the Trainer writes a
    step checkpoint (``output_dir/checkpoint-<step>``, the newest two kept) every that many steps and after
    the last (the Trainer's own); None: none. ``parallel="fsdp2"``: the Trainer's FSDP2 (accelerators only).
    """
    import peft
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTTrainer

    from treadle.data.arithmetic import ProblemGenerator

    targets = targets if targets is not None else (
        linear_targets(model) if config.target_modules == "all-linear" else list(config.target_modules))
    weights = {lv: 1.0 for lv in config.levels}
    train_set = sft_dataset(tokenizer, ProblemGenerator(config.seed).mixture(config.steps * config.batch_size,
                                                                             weights, split="train"))
    lcfg = peft.LoraConfig(r=config.r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                           target_modules=targets, task_type="CAUSAL_LM")
    with _quiet():
        from treadle.trainer_support import decoder_layer_classes

        args = _trainer_args(config, str(output_dir), progress, checkpoint_every, parallel,
                             decoder_layer_classes(model))
        torch.manual_seed(config.seed)  # the LoRA initialisation
        trainer = SFTTrainer(model=model, args=args, train_dataset=train_set, processing_class=tokenizer,
                             peft_config=lcfg, callbacks=list(callbacks))
        if not progress:
            trainer.remove_callback(PrinterCallback)  # per-step dicts on stdout: sft() writes log.jsonl
    return trainer


def _layout(pm: nn.Module, parallel: str | None) -> dict:
    """How the trained model was laid out: the ``parallel`` mode, the world size, how many parameters
    were stored sharded (FSDP2 DTensors; frozen ones counted apart) and whether every trainable one is a
    LoRA A/B (recorded in summary.json)."""
    from torch.distributed.tensor import DTensor

    params = list(pm.named_parameters())
    frozen = [p for _, p in params if not p.requires_grad]
    return {"mode": parallel, "world_size": _world()[0], "parameters": len(params),
            "sharded": sum(isinstance(p, DTensor) for _, p in params),
            "frozen_sharded": sum(isinstance(p, DTensor) for p in frozen), "frozen": len(frozen),
            "only_lora_trainable": all("lora_A" in n or "lora_B" in n for n, p in params if p.requires_grad)}


STAGE_ONE = "stage_one.json"  # the config of the checkpoints in <out_dir>/trainer


def _resumable(out: Path, config: SFTConfig) -> Path | None:
    """The newest complete step checkpoint under ``out/trainer`` (None: none), checked to be of ``config``.

    Raises:
        ValueError: the checkpoints there are of another config (or of an unknown one)."""
    from treadle.trainer_support import latest_checkpoint

    ckpt = latest_checkpoint(out / "trainer") if out.is_dir() else None
    if ckpt is None:
        return None
    try:
        saved = read_stored_json(out / "trainer" / STAGE_ONE, what="Stage-I run config")
    except (OSError, ValueError):
        saved = None
    mine = json.loads(json.dumps(dataclasses.asdict(config)))
    if saved != mine:
        diff = (sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k)) if isinstance(saved, dict)
                else f"no readable {STAGE_ONE}")
        raise ValueError(f"out_dir {str(out)!r} holds Stage I step checkpoints of another config (differs in {diff}); "
                         f"give another out_dir or remove {out / 'trainer'}")
    return ckpt


def _log_before(path: Path, first: int) -> list[str]:
    """The lines of a ``log.jsonl`` for the steps before ``first`` (a resumed run rewrites the rest)."""
    if first == 0 or not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < first:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            break  # a torn last line
    return kept


def sft(model: nn.Module, tokenizer, config: SFTConfig | None = None, out_dir: str | Path | None = None, *,
        console=None, progress: bool = False, parallel: str | None = None, checkpoint_every: int | None = None,
        callbacks=()) -> SFTResult:
    """Stage I of SCALE (sec. 4.3): fine-tune ``model`` with a fresh PEFT LoRA adapter on TRL's ``SFTTrainer``.

    Args:
        model: a HF causal LM without LoRA layers (e.g. :func:`treadle.models.load_default_model`'s, or a
            tiny one from :func:`treadle.models.build_tiny_model`); it is wrapped in place by PEFT
            (through the trainer's ``peft_config``).
        tokenizer: its tokenizer (chat template, EOS and pad token).
        config: :class:`SFTConfig` (default: r = 16, alpha = 16, all linear layers).
        out_dir: run folder: ``adapter/`` (PEFT ``save_pretrained`` + tokenizer), ``log.jsonl`` (one line
            per step: step, loss, lr), ``summary.json``, ``trainer/`` (the trainer's output_dir). None:
            nothing is kept (the trainer writes to a temporary folder).
        console: a rich Console for messages (None: silent); progress: the trainer's tqdm bar.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the trainer runs DDP (TRL / transformers' own): ``config.batch_size``
    stays the global batch (``batch_size / world`` problems per rank and step, the same problems as one
    process), and only rank 0 writes ``out_dir`` and prints. ``parallel="fsdp2"`` (under torchrun or
    ``accelerate launch``, on accelerators) asks the Trainer for FSDP2 (``fully_shard`` per decoder layer);
    the adapter is gathered into full tensors (a collective) before rank 0 writes it in PEFT's
    single-process format. ``parallel="ddp"`` or None: the trainer's default (DDP when launched on ranks).

    Step checkpoints and resume (``checkpoint_every``, needs ``out_dir``): a checkpoint every that many
    steps and after the last, in the HF Trainer's format under ``out_dir/trainer/checkpoint-<step>``
    (the newest two kept; written once, by rank 0). When
    ``out_dir/trainer`` already holds a complete checkpoint of the same config (``stage_one.json``), the
    run continues from the newest one (in one process or under DDP, on any world size, whatever
    wrote it) with the uninterrupted run's data order (the first ``k`` global batches are skipped) and
    ends with its LoRA weights (float tolerance); ``log.jsonl`` keeps the steps before ``k``.
    ``callbacks``: extra ``transformers.TrainerCallback`` objects.

    Returns:
        :class:`SFTResult` (probe loss before/after on held-out problems, per-step losses).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` already has LoRA layers; a tokenizer without chat template / EOS / pad;
            no linear module matches ``target_modules`` (PEFT's message); ``out_dir`` is a file, under a
            file, or not writable; under torchrun, ``batch_size`` not a multiple of the world size; an
            unknown ``parallel``, or ``"fsdp2"`` without an initialised process group; ``checkpoint_every``
            < 1 or without ``out_dir``; ``out_dir/trainer`` holds checkpoints of another config. Raised
            before training and (but for PEFT's message) before ``model`` is changed.
    """
    from transformers import TrainerCallback

    from treadle.data.arithmetic import ProblemGenerator
    from treadle.scale.batches import collate, problem_pairs

    config = config or SFTConfig()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module (a HF causal LM), got {type(model).__name__}")
    if _has_lora(model):
        raise ValueError("model already has LoRA layers; Stage I starts from a base model (pass the adapter to "
                         "Stage II instead: treadle scale train --adapter DIR)")
    _per_device_batch(config)  # the global batch must split over torchrun's ranks (before any change)
    if parallel is not None:
        from treadle.trainer_support import check_launch

        check_launch(parallel, flag="parallel")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be an int >= 1 (steps between checkpoints), got {checkpoint_every!r}")
    if checkpoint_every is not None and out_dir is None:
        raise ValueError("checkpoint_every needs an out_dir (the checkpoints are written under out_dir/trainer)")
    _, writer = _world()
    resume_from = _resumable(Path(out_dir), config) if out_dir is not None else None  # raises before any change
    # before the model is wrapped; rank 0 alone checks and creates it (check_out_dir probes by creating and
    # removing folders, which would race with rank 0's creation on the other torchrun ranks)
    out = None if out_dir is None else make_out_dir(out_dir) if writer else Path(out_dir).expanduser()
    first = 0
    if resume_from is not None:
        first = int(resume_from.name.split("-")[-1])
    targets = (linear_targets(model) if config.target_modules == "all-linear" else list(config.target_modules))
    weights = {lv: 1.0 for lv in config.levels}
    probe = problem_pairs(tokenizer, ProblemGenerator(config.seed + 10_007).mixture(config.probe_size, weights,
                                                                                  split="heldout"))
    kept = _log_before(out / "log.jsonl", first) if out is not None else []
    losses: list[float] = [json.loads(line)["loss"] for line in kept]  # a resumed run's earlier steps
    log = None
    if out is not None and writer:
        (out / "trainer").mkdir(exist_ok=True)
        (out / "trainer" / STAGE_ONE).write_text(json.dumps(dataclasses.asdict(config), indent=1))
        log = open(out / "log.jsonl", "w")  # noqa: SIM115
        log.writelines(kept)
        log.flush()

    def _log_step(step: int, loss: float, lr) -> None:
        losses.append(float(loss))
        if log is not None:
            log.write(json.dumps({"step": step, "loss": losses[-1], "lr": lr}) + "\n")
            log.flush()

    class _Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                _log_step(state.global_step - 1, logs["loss"], logs.get("learning_rate"))

    tmp = None
    try:
        if out is None:
            tmp = tempfile.TemporaryDirectory(prefix="treadle-sft-")
        trainer = stage_one_trainer(model, tokenizer, config, str(out / "trainer") if out is not None else tmp.name,
                                    targets=targets, callbacks=[_Log(), *callbacks], progress=progress,
                                    checkpoint_every=checkpoint_every, parallel=parallel)
        pm = trainer.model
        device = next(pm.parameters()).device
        probe_batch = collate(probe, tokenizer.pad_token_id).to(device)

        def probe_loss() -> float:
            pm.eval()
            with torch.no_grad():
                return float(response_loss(pm, probe_batch))

        before = probe_loss()
        if console is not None and writer and resume_from is not None:
            console.print(f"Stage I resumed at step {first} of {config.steps} from {resume_from}", markup=False)
        t0 = time.perf_counter()
        with _quiet():
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
        seconds = time.perf_counter() - t0
    finally:
        if log is not None:
            log.close()
        if tmp is not None:
            tmp.cleanup()
    after = probe_loss()
    pm.eval()
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    adapter = None
    if out is not None:
        adapter = out / "adapter"
    full = None
    if parallel == "fsdp2" and out is not None:  # every rank gathers the shards (a collective), rank 0 writes
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in pm.state_dict().items() if "lora_" in k}
    if out is not None and writer:
        pm.save_pretrained(str(adapter), state_dict=full)
        pm.scale_adapter_path = str(adapter)  # recorded by Stage II's summary
        tokenizer.save_pretrained(str(adapter))
        summary = {"config": dataclasses.asdict(config), "base_model": getattr(model, "name_or_path", "") or None,
                   "probe_loss_before": before, "probe_loss_after": after, "seconds": seconds,
                   "trainable": trainable, "adapter": str(adapter), "trainer": "trl.SFTTrainer",
                   "parallel": _layout(pm, parallel), "resumed_from_step": first if resume_from is not None else None}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if console is not None and writer:
        console.print(f"Stage I (TRL SFTTrainer, LoRA r={config.r}, alpha={config.lora_alpha}, "
                      f"{config.target_modules}): {trainable} trainable parameters, {config.steps} steps in "
                      f"{seconds:.1f}s; held-out response CE {before:.4f} -> {after:.4f}"
                      + (f"; adapter {adapter}" if adapter else ""), markup=False)
    return SFTResult(pm, adapter, before, after, losses, seconds, trainable)

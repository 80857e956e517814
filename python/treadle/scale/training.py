"""SCALE Stage II (SCALE sec. 4.3, "Stage II: calibrate"): train only the per-token gates.

Starting from a Stage-I PEFT LoRA model (:mod:`treadle.scale.sft`, or any adapter loaded with
:func:`load_stage_one`), :func:`train` attaches zero-initialised gates to every LoRA Linear
(:func:`treadle.scale.attach_gates`: lambda = 1, exactly the Stage-I model), freezes everything else
and minimises the mean normalised top-k entropy (k = 100, divided by log k) of the next-token
distributions over response positions (:func:`treadle.ops.topk_entropy_from_hidden`; the full logits
are never materialised). No CE, no KL, no budget term (sec. 4.3). Responses are the dataset's
answers or completions sampled from the Stage-I model (Stage II needs no labels).

Ablations (SCALE sec. 5.3, mechanism ablation):

- ``no_reverse``: lambda -> max(lambda, 0) (the paper's "w/o reverse": no token can flip the sign of
  the LoRA delta).
- ``no_extrapolate``: lambda -> min(lambda, 1) ("w/o extrapolate": the delta is at most kept).
- ``objective="ce"``: CE on the dataset's responses instead of the entropy ("CE calibration").

The clamps act on lambda itself, after the gate's piecewise-linear map, as in the paper; the
gate keeps its (L, U) (which :class:`treadle.scale.GateConfig` requires to satisfy L < 0 < 1 < U) and a
clamped side gets zero gradient where it is active. Clamped layers run a plain-PyTorch forward with
the fused op's maths (:class:`ClampedGatedLoraLinear`); unclamped training uses the fused op.

Reports (sec. 5.3): entropy and held-out greedy accuracy before/after, and the learned lambda
distribution on generated tokens: shares with lambda < 0 (reverse), in [0, 1) (suppress), exactly 1
(keep: the Stage-I delta unchanged), > 1 (extrapolate), overall, per module type (``q_proj`` ...
``down_proj``) and per layer, plus a histogram.
"Generated tokens": for each token of the model's own greedy held-out completions, the lambdas applied
at the position that produced it (the same response positions as the objective's).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator, ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from torch import nn

from treadle.data.arithmetic import known_levels
from treadle.figures import png_figure
from treadle.reference.scale import gate_lambda_reference

__all__ = ["ScaleTrainConfig", "OBJECTIVES", "RESPONSES", "gate_objective", "clamp_lambda", "load_stage_one",
           "evaluate", "train", "per_layer_shares", "lambda_histogram", "summary_tables"]

OBJECTIVES = ("entropy", "ce")
RESPONSES = ("dataset", "sampled")


Levels = Annotated[tuple[Annotated[int, Field(strict=True)], ...], AfterValidator(known_levels)]
PosInt = Annotated[int, Field(ge=1, strict=True)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ScaleTrainConfig:
    """Stage-II settings (SCALE sec. 3.3 / 4.3), a pydantic dataclass: every field is validated
    (ranges with ``Field``, choices with ``Literal``) when the config is made, and a bad value raises
    :class:`pydantic.ValidationError` (a ``ValueError``) naming the field.

    Attributes:
        L, U: lambda's range (L, U), ``L < 0 < 1 < U`` (the paper sweeps L in [-6, 0], U in [1, 6]
            and picks per task; treadle's default (-2, 2) is a middle point, not a paper value).
        tau: gate temperature ``v = tanh(g / tau)``, > 0.
        k: top-k of the entropy objective (paper: 100), >= 2. :func:`train` uses ``min(k, vocab)``
            on models with a smaller vocabulary (then the normaliser is log vocab) and says so.
        lr: Adam learning rate of the gates (> 0); epochs: passes over the training responses;
            batch_size: rows per step (each >= 1).
        train_size: training prompts (train split), drawn uniformly over ``levels``.
        responses: ``"dataset"`` (the verified answers) or ``"sampled"`` (completions of the Stage-I
            model at ``temperature`` > 0, at most ``max_new_tokens``).
        objective: ``"entropy"`` (SCALE) or ``"ce"`` (the CE-calibration ablation; needs
            ``responses="dataset"``).
        no_reverse / no_extrapolate: ablations, lambda -> max(lambda, 0) / min(lambda, 1).
        eval_levels, eval_size: held-out problems per level for accuracy (greedy) and lambda shares.
        max_new_tokens: completion budget for sampling and evaluation.
        seed: seeds data, sampling and shuffling.
    """

    L: Annotated[float, Field(lt=0, allow_inf_nan=False)] = -2.0
    U: Annotated[float, Field(gt=1, allow_inf_nan=False)] = 2.0
    tau: PosFloat = 1.0
    k: Annotated[int, Field(ge=2, strict=True)] = 100
    lr: PosFloat = 1e-3
    epochs: PosInt = 2
    batch_size: PosInt = 32
    train_size: PosInt = 256
    levels: Levels = (1, 2, 3)
    responses: Literal["dataset", "sampled"] = "dataset"
    temperature: PosFloat = 1.0
    objective: Literal["entropy", "ce"] = "entropy"
    no_reverse: bool = False
    no_extrapolate: bool = False
    eval_levels: Levels = (1, 2, 3)
    eval_size: PosInt = 32
    max_new_tokens: PosInt = 10
    seed: int = 0

    @field_validator("objective")
    @classmethod
    def _ce_needs_dataset(cls, objective, info):
        if objective == "ce" and info.data.get("responses") != "dataset":
            raise ValueError("objective 'ce' (the CE-calibration ablation) trains on the dataset's responses; "
                             "use responses 'dataset'")
        return objective

    @classmethod
    def quick(cls, **overrides) -> "ScaleTrainConfig":
        """Seconds-long settings for tests and ``--quick`` runs."""
        kw = dict(epochs=1, batch_size=8, train_size=16, eval_size=4, eval_levels=(1,), max_new_tokens=6)
        kw.update(overrides)
        return cls(**kw)

    @property
    def lambda_bounds(self) -> tuple:
        """``(lo, hi)`` clamp of the ablations (None = no clamp)."""
        return (0.0 if self.no_reverse else None, 1.0 if self.no_extrapolate else None)


# ---------------------------------------------------------------- ablation clamps
_CLAMPED_CLASS = None


def _clamped_class():
    global _CLAMPED_CLASS
    if _CLAMPED_CLASS is not None:
        return _CLAMPED_CLASS
    from treadle.scale.gates import _gated_class

    base = _gated_class()

    class ClampedGatedLoraLinear(base):
        """A gated LoRA Linear whose lambda is clamped to ``scale_lambda_bounds = (lo, hi)`` (SCALE sec. 5.3
        ablations: ``lo = 0`` removes reverse, ``hi = 1`` removes extrapolate).

        ``lambda = clamp(1 + (1 - L) min(v, 0) + (U - 1) max(v, 0), lo, hi)``, ``v = tanh((w . sg(h) + b) / tau)``,
        ``y = W h + lambda * scaling * B (A h)``: the fused op's maths in plain PyTorch (autograd gives
        ``dw, db`` and ``dh``; no gradient through the gate's input; zero gradient where the clamp binds).
        """

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            cfg = self.scale_config
            if (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None
                    or cfg.adapter not in self.active_adapters):
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            lo, hi = self.scale_lambda_bounds
            result = self.base_layer(x, *args, **kwargs)
            lora_A = self.lora_A[cfg.adapter].weight
            lora_B = self.lora_B[cfg.adapter].weight
            xa = self._cast_input_dtype(x, lora_A.dtype)
            acc = torch.float64 if xa.dtype == torch.float64 else torch.float32
            g = xa.detach().to(acc) @ self.scale_gate_weight.to(acc) + self.scale_gate_bias.to(acc).reshape(())
            v = torch.tanh(g / cfg.tau)
            lam = gate_lambda_reference(v, cfg.L, cfg.U)  # slope (U - L) / 2 at v = 0, as the fused op
            lam = lam.clamp(min=lo, max=hi)
            delta = (xa @ lora_A.t()).to(acc) * (float(self.scaling[cfg.adapter]) * lam).unsqueeze(-1)
            y = result + (delta.to(lora_A.dtype) @ lora_B.t()).to(result.dtype)
            if self.scale_record_lambda:
                self.scale_last_lambda = lam.detach()
            return y

    _CLAMPED_CLASS = ClampedGatedLoraLinear
    return ClampedGatedLoraLinear


def clamp_lambda(peft_model: nn.Module, lo: float | None = None, hi: float | None = None) -> int:
    """Clamp every gate's lambda to ``[lo, hi]`` (SCALE sec. 5.3 ablations; None = that side open).

    ``lo = 0`` is "w/o reverse" (lambda = max(lambda, 0)), ``hi = 1`` is "w/o extrapolate"
    (lambda = min(lambda, 1)). With both None the layers go back to the fused op. Gate parameters,
    names and :func:`treadle.scale.save_gates` files are unchanged (the clamp is not stored there:
    :func:`train` writes it in its ``config.json``).

    Returns:
        The number of gated layers changed.

    Raises:
        GateError: the model has no gates (call :func:`treadle.scale.attach_gates` first).
        ValueError: ``lo``/``hi`` not finite, or ``lo >= hi``; raised before any change.
    """
    from treadle.scale.gates import GateError, _gated_class, gated_layers

    for name, b in (("lo", lo), ("hi", hi)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)):
            raise ValueError(f"{name} must be a finite number, got {b!r}")
    if lo is not None and hi is not None and not lo < hi:
        raise ValueError(f"lo must be < hi, got lo={lo}, hi={hi}")
    layers = gated_layers(peft_model)
    if not layers:
        raise GateError("the model has no gates; call attach_gates() first")
    clamped, plain = _clamped_class(), _gated_class()
    for m in layers.values():
        if lo is None and hi is None:
            m.__class__ = plain
            if hasattr(m, "scale_lambda_bounds"):
                del m.scale_lambda_bounds
        else:
            m.__class__ = clamped
            m.scale_lambda_bounds = (None if lo is None else float(lo), None if hi is None else float(hi))
    return len(layers)


# ---------------------------------------------------------------- objective
def _decoder_and_head(model: nn.Module):
    """``(decoder, head weight)`` when the logits are exactly ``decoder(...) @ head.weight^T``, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_dec, get_head = getattr(base, "get_decoder", None), getattr(base, "get_output_embeddings", None)
    if get_dec is None or get_head is None:
        return None
    try:
        dec, head = get_dec(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    cfg = getattr(base, "config", None)
    scaled = any(getattr(cfg, a, None) not in (None, 1, 1.0) for a in ("final_logit_softcapping", "logit_scale",
                                                                       "output_multiplier_scale"))
    if dec is None or dec is base or type(head) is not nn.Linear or head.bias is not None or scaled:
        return None
    return dec, head.weight


def gate_objective(model: nn.Module, batch, *, k: int = 100, objective: str = "entropy") -> torch.Tensor:
    """The Stage-II loss of one batch (SCALE sec. 4.3), a float32 scalar.

    ``objective="entropy"``: mean over response positions of the top-k entropy of the next-token
    distribution renormalised over its k largest logits, divided by log k (in [0, 1]); computed from the
    final hidden states and the output head chunk by chunk (:func:`treadle.ops.topk_entropy_from_hidden`)
    when the model's logits are a plain bias-free linear head, else from the logits
    (:func:`treadle.ops.topk_entropy`). ``objective="ce"``: mean response-token cross-entropy (nats),
    the CE-calibration ablation.

    Args:
        model: a causal LM (PEFT-wrapped or not).
        batch: a :class:`treadle.scale.batches.ResponseBatch` ``(B, T)`` on the model's device.
        k: ``2 <= k <= vocab`` (the ops refuse other values).

    Raises:
        ValueError: no response position in the batch; unknown objective; k out of range (from the op).
    """
    from treadle.ops import topk_entropy, topk_entropy_from_hidden
    from treadle.scale.sft import response_loss

    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not bool(batch.response_mask.any()):
        raise ValueError("the batch has no response positions: the Stage-II objective is a mean over them")
    if objective == "ce":
        return response_loss(model, batch)
    parts = _decoder_and_head(model)
    if parts is not None:
        dec, weight = parts
        hidden = dec(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        return topk_entropy_from_hidden(hidden, weight.to(hidden.dtype), k, batch.response_mask)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return topk_entropy(logits, k, batch.response_mask)


def _vocab(model: nn.Module) -> int:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(base.config.vocab_size)


# ---------------------------------------------------------------- loading
def load_stage_one(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Wrap a base model with a Stage-I LoRA adapter saved by PEFT (``PeftModel.from_pretrained``).

    Args:
        model: the base causal LM the adapter was trained on.
        adapter_dir: folder with ``adapter_config.json`` and the adapter weights.

    Returns:
        The ``peft.PeftModel`` (adapter frozen; :func:`train` adds the gates).

    Raises:
        FileNotFoundError: ``adapter_dir`` does not exist.
        ValueError: not a folder, no ``adapter_config.json``, not a LoRA adapter, unreadable (e.g.
            truncated) weights, or weights that do not fit the model (one line: the first size
            mismatch and how many more).
    """
    import peft

    p = Path(adapter_dir).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"adapter path {str(p)!r} does not exist; give a PEFT LoRA adapter folder "
                                f"(treadle scale sft writes one to <out>/adapter)")
    if not p.is_dir() or not (p / "adapter_config.json").exists():
        raise ValueError(f"{p} is not a PEFT adapter folder (no adapter_config.json)")
    try:
        kind = json.loads((p / "adapter_config.json").read_text()).get("peft_type")
    except json.JSONDecodeError as err:
        raise ValueError(f"{p / 'adapter_config.json'} is not valid JSON: {err}") from None
    if kind != "LORA":
        raise ValueError(f"{p} holds a {kind!r} adapter; SCALE gates need a LoRA adapter")
    from safetensors import SafetensorError

    trained_on = _recorded_base(p)
    try:
        pm = peft.PeftModel.from_pretrained(model, str(p), is_trainable=False)
    except SafetensorError as err:
        files = sorted(str(f) for f in p.glob("*.safetensors")) or [str(p)]
        raise ValueError(f"could not read the adapter weights {', '.join(files)} (truncated or not a safetensors "
                         f"file?): {err}") from None
    except (RuntimeError, KeyError, OSError, ValueError) as err:
        here = getattr(model, "name_or_path", None)
        raise ValueError(f"could not load the adapter {p} (trained on {trained_on or 'an unrecorded base model'}) "
                         f"onto this model{f' ({here})' if here else ''}: {_short_load_error(err)}") from None
    pm.scale_adapter_path = str(p)  # recorded by Stage II's summary
    return pm


def _recorded_base(adapter: Path) -> str | None:
    """``base_model_name_or_path`` of a PEFT adapter folder (None when absent or unreadable)."""
    try:
        return json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError, AttributeError):
        return None


def _short_load_error(err: Exception) -> str:
    """One line for PEFT's load errors: the first size mismatch and how many more (not dozens of lines)."""
    text = str(err)
    missing = re.search(r"Target modules \{([^}]*)\} not found in the base model", text)
    if missing:
        names = sorted(n.strip().strip("'\"") for n in missing.group(1).split(",") if n.strip())
        return (f"the base model has none of the adapter's {len(names)} target modules (e.g. "
                f"{', '.join(names[:2])}): it is not the model the adapter was trained on")
    mism = re.findall(r"size mismatch for (\S+?): copying a param with shape (torch\.Size\(\[[^\]]*\]\)) from "
                      r"checkpoint, the shape in current model is (torch\.Size\(\[[^\]]*\]\))", text)
    if not mism:
        return text.strip().splitlines()[0] if text.strip() else type(err).__name__
    name, ckpt, cur = mism[0]
    more = f" (and {len(mism) - 1} more)" if len(mism) > 1 else ""
    return (f"the adapter's weights have other shapes than this model's: {name} is {ckpt[len('torch.Size('):-1]} in "
            f"the adapter, {cur[len('torch.Size('):-1]} in the model{more}")


# ---------------------------------------------------------------- evaluation
def _heldout(config: ScaleTrainConfig) -> dict:
    from treadle.data.arithmetic import ProblemGenerator

    gen = ProblemGenerator(config.seed + 10_007)
    return {lv: gen.batch(lv, config.eval_size, split="heldout") for lv in config.eval_levels}


@torch.no_grad()
def evaluate(model: nn.Module, tokenizer, problems_by_level: dict, *, k: int = 100, max_new_tokens: int = 10,
             batch_size: int = 64, keep_lambdas: bool = False) -> dict:
    """Greedy held-out accuracy, entropy of the model's own completions and, on a gated model, the lambda
    distribution on the generated tokens (SCALE sec. 5.3).

    Args:
        problems_by_level: level -> list of :class:`treadle.data.Problem`.
        k: top-k of the entropy (``2 <= k <= vocab``).
        keep_lambdas: also return the raw lambdas (``"lambdas"``: a float32 1-D tensor over all gated
            modules and generated tokens) for a histogram.

    Returns:
        ``{"accuracy": {level: fraction}, "accuracy_mean": mean over problems, "entropy": mean
        normalised top-k entropy over generated tokens, "lambda": lambda_report-like dict with
        "overall", "per_type", "per_layer" (None on a model without gates), ["lambdas"]}``.
        Lambda recording (:func:`treadle.scale.record_lambda`) is left off afterwards.

    Raises:
        ValueError: no problems, or a level with none.
    """
    from treadle.scale.gates import gated_layers

    if not problems_by_level or any(len(v) == 0 for v in problems_by_level.values()):
        raise ValueError("problems_by_level must map each level to a non-empty list of problems")
    gated = bool(gated_layers(model))
    acc, right, total = {}, 0, 0
    ent_sum, ent_n = 0.0, 0
    per_module: dict = {}
    for level, problems in problems_by_level.items():
        r = 0
        for i in range(0, len(problems), batch_size):
            c, e, n, lams = evaluate_chunk(model, tokenizer, problems[i:i + batch_size], k=k,
                                           max_new_tokens=max_new_tokens, gated=gated)
            r += c
            ent_sum += e
            ent_n += n
            for name, lam in lams.items():
                per_module.setdefault(name, []).append(lam)
        acc[level] = r / max(len(problems), 1)
        right += r
        total += len(problems)
    return evaluation_report(acc, right, total, ent_sum, ent_n, per_module if gated else None,
                             keep_lambdas=keep_lambdas)


def evaluate_chunk(model: nn.Module, tokenizer, chunk: list, *, k: int, max_new_tokens: int,
                   gated: bool) -> tuple[int, float, int, dict]:
    """One batch of :func:`evaluate`: greedy completions of ``chunk`` (problems), then one forward over
    them. Returns ``(correct answers, entropy sum over generated tokens, generated tokens, {gated module
    name: float32 CPU lambdas at those tokens})`` (the last empty when ``gated`` is False)."""
    from treadle.data.verify import is_correct
    from treadle.models.generation import generate
    from treadle.scale.batches import collate
    from treadle.scale.gates import gated_layers, record_lambda

    device = next(model.parameters()).device
    gen = generate(model, tokenizer, [p.prompt for p in chunk], max_new_tokens=max_new_tokens)
    right = sum(is_correct(t, p.answer) for t, p in zip(gen.texts, chunk))
    pairs = []
    for j in range(len(chunk)):
        prompt = gen.prompt_ids[j][gen.prompt_mask[j].bool()].tolist()
        pairs.append((prompt, gen.completion_ids[j][gen.completion_mask[j].bool()].tolist() or
                      [tokenizer.eos_token_id]))
    batch = collate(pairs, tokenizer.pad_token_id).to(device)
    n = int(batch.response_mask.sum())
    lams = {}
    if gated:
        record_lambda(model, True)
    try:
        ent = float(gate_objective(model, batch, k=k)) * n
        if gated:
            lams = {name: m.scale_last_lambda[batch.response_mask].float().cpu()
                    for name, m in gated_layers(model).items()}
    finally:
        if gated:
            record_lambda(model, False)
    return right, ent, n, lams


def evaluation_report(acc: dict, right: int, total: int, ent_sum: float, ent_n: int, per_module: dict | None, *,
                      keep_lambdas: bool = False) -> dict:
    """:func:`evaluate`'s result from its sums: accuracy per level and over all ``total`` problems, the
    position-weighted entropy, and (``per_module``: module name -> list of lambda tensors; None on a model
    without gates) the lambda shares overall, per module type and per layer."""
    out = {"accuracy": acc, "accuracy_mean": right / max(total, 1), "entropy": ent_sum / max(ent_n, 1),
           "lambda": None}
    if per_module is not None:
        from treadle.scale.gates import lambda_shares

        mods = {n: torch.cat(v) for n, v in per_module.items()}
        per_type: dict = {}
        for name, lam in mods.items():
            per_type.setdefault(name.rsplit(".", 1)[-1], []).append(lam)
        all_l = torch.cat(list(mods.values()))
        out["lambda"] = {"overall": lambda_shares(all_l), "mean": float(all_l.mean()),
                         "per_type": {t: lambda_shares(torch.cat(v)) for t, v in per_type.items()},
                         "per_layer": per_layer_shares(mods), "tokens": int(next(iter(mods.values())).numel())}
        if keep_lambdas:
            out["lambdas"] = all_l
    return out


def per_layer_shares(lambdas_by_module: dict) -> dict:
    """Pool per-module lambdas by decoder layer (the ``layers.<i>.`` part of the module name).

    Args:
        lambdas_by_module: module name -> 1-D lambda tensor (selected tokens).

    Returns:
        ``{layer index (int): shares}`` as :func:`treadle.scale.lambda_shares`; modules outside a
        ``layers.<i>`` block are pooled under -1.
    """
    from treadle.scale.gates import lambda_shares

    pooled: dict = {}
    for name, lam in lambdas_by_module.items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        pooled.setdefault(int(m.group(1)) if m else -1, []).append(lam.reshape(-1))
    return {lay: lambda_shares(torch.cat(v)) for lay, v in sorted(pooled.items())}


def lambda_histogram(lambdas: torch.Tensor, path: str | Path, *, L: float, U: float, title: str = "") -> Path:
    """Save a PNG histogram of lambda values with the reverse / suppress / extrapolate regions marked
    (SCALE sec. 5.3). ``lambdas``: any-shape float tensor; ``(L, U)`` the gate range."""

    vals = lambdas.detach().reshape(-1).float().cpu().numpy()
    with png_figure(path, figsize=(6.4, 3.6)) as (fig, ax):
        ax.axvspan(L, 0, color="tab:red", alpha=0.08, label="reverse (lambda < 0)")
        ax.axvspan(0, 1, color="tab:gray", alpha=0.08, label="suppress [0, 1)")
        ax.axvspan(1, U, color="tab:green", alpha=0.08, label="extrapolate (lambda > 1)")
        ax.hist(vals, bins=60, range=(L, U), color="tab:blue")
        ax.set_xlabel("lambda (per token x module)")
        ax.set_ylabel("count")
        ax.set_title(title or f"learned lambda on generated tokens, n = {vals.size}")
        ax.legend(fontsize=7, loc="upper left")
    return Path(path)


# ---------------------------------------------------------------- training
def _objective_over(model, pairs, pad_id, *, k, objective, batch_size) -> float:
    from treadle.scale.batches import iterate_batches

    device = next(model.parameters()).device
    tot, n = 0.0, 0
    with torch.no_grad():
        for batch in iterate_batches(pairs, batch_size, pad_id):
            m = int(batch.response_mask.sum())
            tot += float(gate_objective(model, batch.to(device), k=k, objective=objective)) * m
            n += m
    return tot / max(n, 1)


def _base_name(peft_model: nn.Module) -> str | None:
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    return getattr(base, "name_or_path", None) or None


_SHARE_COLUMNS = (("reverse", "reverse (<0)"), ("suppress", "suppress [0, 1)"), ("keep", "keep (= 1)"),
                  ("extrapolate", "extrapolate (>1)"))


def summary_tables(summary: dict) -> list:
    """Rich tables of a :func:`train` summary: before/after (objective, held-out entropy and accuracy, lambda
    shares) and the lambda shares per module type and per layer (SCALE sec. 5.3)."""
    from rich.table import Table

    b, a = summary.get("before"), summary.get("after")
    name = "top-k entropy" if summary["objective"] == "entropy" else "response CE"
    t = Table(title=f"SCALE Stage II: {summary['gate_params']} gate parameters, {summary['steps']} steps, "
                    f"{summary['seconds']:.1f}s")
    t.add_column("metric")
    t.add_column("before (Stage I)", justify="right")
    t.add_column("after (gated)", justify="right")
    t.add_row(f"train {name} (objective)", f"{summary['objective_before']:.4f}", f"{summary['objective_after']:.4f}")
    tables = [t]
    if b and a:
        t.add_row(f"held-out top-k entropy (own completions, k={summary['k']})", f"{b['entropy']:.4f}",
                  f"{a['entropy']:.4f}")
        for lv in a["accuracy"]:
            t.add_row(f"held-out accuracy, level {lv}", f"{b['accuracy'][lv]:.1%}", f"{a['accuracy'][lv]:.1%}")
        t.add_row("held-out accuracy, all", f"{b['accuracy_mean']:.1%}", f"{a['accuracy_mean']:.1%}")
        for key, label in _SHARE_COLUMNS:
            t.add_row(f"lambda share: {label}", f"{b['lambda']['overall'].get(key, 0.0):.1%}",
                      f"{a['lambda']['overall'].get(key, 0.0):.1%}")
        lam = a["lambda"]
        d = Table(title="learned lambda on generated tokens: share reverse / suppress / keep / extrapolate")
        d.add_column("group")
        for _, label in _SHARE_COLUMNS:
            d.add_column(label, justify="right")

        def row(s):
            return [f"{s.get(key, 0.0):.1%}" for key, _ in _SHARE_COLUMNS]

        for typ, s in lam["per_type"].items():
            d.add_row(typ, *row(s))
        for lay, s in lam["per_layer"].items():
            d.add_row(f"layer {lay}", *row(s))
        d.add_row("all", *row(lam["overall"]))
        tables.append(d)
    return tables

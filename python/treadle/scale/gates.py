"""Per-token gates on a PEFT LoRA model (SCALE Stage II, sec. 3.3): attach, freeze, save, load.

:func:`attach_gates` turns every PEFT LoRA ``Linear`` of the active adapter into a :class:`GatedLoraLinear`
(a subclass of PEFT's ``lora.Linear``: the instance's class is swapped in place, so PEFT's own
bookkeeping, names and state dict stay as they are) whose forward is
``y = base_layer(x) + lambda * scaling * B (A x)`` through :func:`treadle.ops.gated_lora_linear` (base
GEMM fused in; used when base weight, adapter and input share a dtype and the base is frozen) or
:func:`treadle.ops.gated_lora` (base layer run on its own), with one gate ``(w (d_in,), b (1,))`` in
float32 per module. Everything else is frozen, including ``lora_A``
and ``lora_B`` (PEFT marks ``lora_*`` trainable). Zero-initialised gates give lambda = 1: exactly
the Stage-I model.

What is not supported is refused with an error naming the layer, before any change to the model:
merged adapters, DoRA and other LoRA variants, LoRA biases, quantised or non-``nn.Linear`` base
layers (bitsandbytes, GPTQ, ...), LoRA on embeddings/convolutions, several active adapters, and
active LoRA dropout (pass ``disable_dropout=True`` to replace it by identity for Stage II). When
PEFT's adapters are disabled (``with model.disable_adapter():``) or per-request ``adapter_names``
are passed, PEFT's own forward runs (no gates), as PEFT documents for those paths.

Merging: lambda depends on the token, so a trained gate cannot be folded into the base weight. PEFT's
``merge_and_unload()`` / ``merge_adapter()`` / a layer's ``merge()`` on a gated model therefore fold
the gates only when every gate to merge is constant (``w = 0``: lambda = ``lambda(tanh(b / tau))`` for
every token, e.g. freshly attached gates, lambda = 1), giving ``W + lambda * scaling * B A``, and
otherwise refuse with a :class:`GateError` naming the layers, before any weight changes (PEFT alone
would merge the Stage-I delta and silently drop the gates). :func:`remove_gates` takes the gates off
(returning them), leaving the plain Stage-I LoRA model that PEFT merges as usual.

Gradient on an untrained LoRA: ``d y / d lambda = scaling * B (A h)``, so gates on a LoRA whose ``B``
is zero (PEFT's initialisation, before Stage I) get exactly zero gradient by construction and never
move; :func:`attach_gates` warns in that case. Train Stage I first (:func:`treadle.scale.sft`).
"""
from __future__ import annotations

import inspect
import json
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import torch
from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from torch import nn

from treadle.ops.gated_lora import gated_lora, gated_lora_linear
from treadle.reference.scale import gate_lambda_reference

FORMAT = "treadle.scale.gates/1"


class GateError(ValueError):
    """A model or gate file that :func:`attach_gates` / :func:`load_gates` cannot work with."""


FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class GateConfig:
    """Gate hyper-parameters (SCALE sec. 3.3): lambda in (L, U), L < 0 < 1 < U; temperature tau > 0.

    A pydantic dataclass: ``GateConfig.make(...)`` raises :class:`GateError` (a ValueError) naming the
    field on bad values (not finite, ``L >= 0``, ``U <= 1``, ``tau <= 0``, unknown fields).
    """

    L: FiniteFloat
    U: FiniteFloat
    tau: FiniteFloat
    adapter: str

    @field_validator("L", "U", "tau")
    @classmethod
    def _in_range(cls, v: float, info) -> float:
        ok, rule = {"L": (v < 0, "< 0 (lambda's lower end, L < 0 < 1 < U)"),
                    "U": (v > 1, "> 1 (lambda's upper end, L < 0 < 1 < U)"),
                    "tau": (v > 0, "> 0 (the gate temperature)")}[info.field_name]
        if not ok:
            raise ValueError(f"{info.field_name} must be {rule}, got {v}")
        return v

    @classmethod
    def make(cls, **kw) -> "GateConfig":
        """Validated construction; the first problem as one :class:`GateError` line."""
        try:
            return cls(**kw)
        except ValidationError as err:
            e = err.errors()[0]
            loc = ".".join(str(x) for x in e["loc"]) or "config"
            msg = e["msg"].removeprefix("Value error, ")
            raise GateError(msg if msg.startswith(loc + " ") else f"{loc}: {msg} (got {e.get('input')!r})") from None


def _peft_lora():
    try:
        from peft.tuners.lora import layer as lora_layer
    except ImportError as err:  # pragma: no cover - peft is a dependency of this area
        raise ImportError("treadle.scale needs peft (pip install peft)") from err
    return lora_layer


_GATED_CLASS = None


def _gated_class():
    """The subclass of PEFT's ``lora.Linear`` (built lazily so that importing treadle needs no peft)."""
    global _GATED_CLASS
    if _GATED_CLASS is not None:
        return _GATED_CLASS
    base = _peft_lora().Linear

    class GatedLoraLinear(base):
        """PEFT ``lora.Linear`` with a SCALE gate on its active adapter (see :mod:`treadle.scale.gates`).

        Extra attributes: ``scale_gate_weight (d_in,)`` and ``scale_gate_bias (1,)`` float32 parameters,
        ``scale_config`` (:class:`GateConfig`), ``scale_record_lambda`` (bool) and ``scale_last_lambda``
        (the detached ``lambda`` of the last forward, shape ``x.shape[:-1]``, when recording).
        """

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            cfg: GateConfig = self.scale_config
            if (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None
                    or cfg.adapter not in self.active_adapters):
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            base = self.base_layer
            lora_A = self.lora_A[cfg.adapter].weight
            lora_B = self.lora_B[cfg.adapter].weight
            gate = dict(scaling=float(self.scaling[cfg.adapter]), L=cfg.L, U=cfg.U, tau=cfg.tau,
                        return_lambda=self.scale_record_lambda)
            frozen_base = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
            if frozen_base and not args and not kwargs and base.weight.dtype == lora_A.dtype == x.dtype:
                # base GEMM fused with the gated LoRA (expand and dx added in place)
                y = gated_lora_linear(x, base.weight, base.bias, lora_A, lora_B, self.scale_gate_weight,
                                      self.scale_gate_bias, **gate)
                result_dtype = x.dtype
            else:  # base layer run on its own (e.g. adapters kept in fp32 over a bf16 base, or a trainable base)
                result = base(x, *args, **kwargs)
                result_dtype = result.dtype
                xa = self._cast_input_dtype(x, lora_A.dtype)
                y = gated_lora(xa, result.to(lora_A.dtype), lora_A, lora_B, self.scale_gate_weight,
                               self.scale_gate_bias, **gate)
            if self.scale_record_lambda:
                y, self.scale_last_lambda = y
            return y.to(result_dtype)

        def scale_constant_lambda(self) -> float | None:
            """The gate's lambda when it is the same for every token (gate weight all zero), else None."""
            if bool(self.scale_gate_weight.detach().any()):
                return None
            cfg: GateConfig = self.scale_config
            v = torch.tanh(self.scale_gate_bias.detach().double().reshape(()) / cfg.tau)
            return float(gate_lambda_reference(v, cfg.L, cfg.U))

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            """PEFT's merge, with the gate folded in when it is constant; GateError (before any change) when
            the gated adapter is to be merged and its gate depends on the token."""
            adapter = self.scale_config.adapter
            names = list(self.active_adapters) if adapter_names is None else list(adapter_names)
            if adapter in names and adapter not in self.merged_adapters:
                lam = self.scale_constant_lambda()
                if lam is None:
                    raise GateError(_unfoldable_message([self.scale_name]))
                self.scale_fold = lam
            super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

        def unmerge(self) -> None:
            super().unmerge()
            if self.scale_config.adapter not in self.merged_adapters:
                self.scale_fold = None

        def get_delta_weight(self, adapter) -> torch.Tensor:
            delta = super().get_delta_weight(adapter)
            if adapter != self.scale_config.adapter:
                return delta
            if self.scale_fold is None:
                raise GateError(f"layer {self.scale_name!r}: the gated adapter's delta weight depends on the "
                                f"token (lambda B A); merge() folds constant gates, remove_gates() drops them")
            return delta * self.scale_fold

    _GATED_CLASS = GatedLoraLinear
    return GatedLoraLinear


def _unfoldable_message(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"cannot merge a gated SCALE adapter: the gates of {len(names)} layer(s) ({shown}) depend on the token "
            f"(lambda = lambda(w . h + b) with w != 0), so no single weight matrix equals the gated model. Keep the "
            f"model unmerged, or call treadle.scale.remove_gates(model) first to merge the Stage-I LoRA without "
            f"gates (lambda = 1); nothing was changed")


_GATED_TUNERS: dict = {}


def _gated_tuner_class(base: type) -> type:
    """A subclass of the PEFT tuner class ``base`` (e.g. ``LoraModel``) whose model-wide merges
    (``merge_and_unload``, ``merge_adapter``) check every gated layer before merging any."""
    if base in _GATED_TUNERS:
        return _GATED_TUNERS[base]

    def _names(method, args, kwargs):
        bound = inspect.signature(method).bind(None, *args, **kwargs)
        return bound.arguments.get("adapter_names"), bound.arguments.get("merge", True)

    class GatedTuner(base):
        def _scale_check_foldable(self, adapter_names) -> None:
            bad = []
            for name, m in gated_layers(self.model).items():
                names = list(m.active_adapters) if adapter_names is None else list(adapter_names)
                if m.scale_config.adapter in names and m.scale_config.adapter not in m.merged_adapters \
                        and m.scale_constant_lambda() is None:
                    bad.append(name)
            if bad:
                raise GateError(_unfoldable_message(bad))

        def _unload_and_optionally_merge(self, *args, **kwargs):
            adapter_names, merge = _names(base._unload_and_optionally_merge, args, kwargs)
            if merge:
                self._scale_check_foldable(adapter_names)
            return super()._unload_and_optionally_merge(*args, **kwargs)

        def merge_adapter(self, *args, **kwargs):
            adapter_names, _ = _names(base.merge_adapter, args, kwargs)
            self._scale_check_foldable(adapter_names)
            return super().merge_adapter(*args, **kwargs)

    GatedTuner.__name__ = GatedTuner.__qualname__ = f"Gated{base.__name__}"
    _GATED_TUNERS[base] = GatedTuner
    return GatedTuner


def _tuner(peft_model: nn.Module):
    """The PEFT tuner (``LoraModel``) of a ``PeftModel`` or the tuner itself; None for other modules."""
    from peft.tuners.tuners_utils import BaseTuner

    for cand in (peft_model, getattr(peft_model, "base_model", None)):
        if isinstance(cand, BaseTuner):
            return cand
    return None


def _carries(module, adapter: str) -> bool:
    """Whether a PEFT LoRA layer has weights for ``adapter`` (lora_A/B, or lora_embedding_A/B)."""
    names = getattr(module, "adapter_layer_names", ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"))
    return any(adapter in getattr(module, n, {}) for n in names)


def _active_adapter(peft_model) -> str:
    """The single active LoRA adapter of the model's LoRA layers; GateError otherwise."""
    if not isinstance(peft_model, nn.Module):
        raise GateError(f"expected a PEFT model (an nn.Module with LoRA layers), got {type(peft_model).__name__}")
    lora_layer = _peft_lora()
    active: list[str] = []
    for module in peft_model.modules():
        if isinstance(module, lora_layer.LoraLayer):
            active += [a for a in module.active_adapters if a not in active and _carries(module, a)]
    if not active:
        raise GateError(f"the model ({type(peft_model).__name__}) has no PEFT LoRA layers with an active adapter")
    if len(active) != 1:
        raise GateError(f"gates attach to exactly one active adapter, but {len(active)} are active: {active}; "
                        f"call set_adapter(name) first")
    return active[0]


def _lora_layers(peft_model, adapter: str, *, disable_dropout: bool, expect_gated: bool | None):
    """``[(name, layer)]`` of the LoRA layers carrying ``adapter``; raises GateError naming a bad layer."""
    lora_layer = _peft_lora()
    gated_cls = _gated_class()
    found = []
    for name, module in peft_model.named_modules():
        if not isinstance(module, lora_layer.LoraLayer):
            continue
        if not _carries(module, adapter):
            continue
        if not isinstance(module, lora_layer.Linear):
            raise GateError(f"layer {name!r} is a {type(module).__module__}.{type(module).__name__}; SCALE gates "
                            f"support PEFT LoRA Linear layers over nn.Linear only (no embeddings, convolutions, "
                            f"or quantised layers)")
        if type(module.get_base_layer()) is not nn.Linear:
            raise GateError(f"layer {name!r} has base layer {type(module.get_base_layer()).__name__}; SCALE gates "
                            f"need a plain nn.Linear base (quantised bases are not supported)")
        if module.merged:
            raise GateError(f"layer {name!r} has merged adapters {module.merged_adapters}; unmerge them first "
                            f"(peft_model.unmerge_adapter())")
        if adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False):
            variant = type(module.lora_variant.get(adapter)).__name__ if adapter in module.lora_variant else "DoRA"
            raise GateError(f"layer {name!r} uses a LoRA variant ({variant}) for adapter {adapter!r}; SCALE gates "
                            f"support vanilla LoRA only")
        if getattr(module, "lora_bias", {}).get(adapter, False) or module.lora_B[adapter].bias is not None:
            raise GateError(f"layer {name!r} has a LoRA bias (lora_bias=True); not supported by SCALE gates")
        dropout = module.lora_dropout[adapter]
        if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0.0) > 0 and not disable_dropout:
            raise GateError(f"layer {name!r} has LoRA dropout p={dropout.p}; the fused gated LoRA has no dropout. "
                            f"Pass disable_dropout=True to run Stage II without it")
        is_gated = isinstance(module, gated_cls)
        if expect_gated is False and is_gated:
            raise GateError(f"layer {name!r} already has gates; load_gates() or a fresh model to start over")
        if expect_gated is True and not is_gated:
            raise GateError(f"layer {name!r} has no gates; call attach_gates() first")
        found.append((name, module))
    if not found:
        raise GateError(f"the model has no PEFT LoRA layers for adapter {adapter!r}")
    return found


def attach_gates(peft_model: nn.Module, L: float, U: float, tau: float, *,
                 disable_dropout: bool = False) -> list[nn.Parameter]:
    """Add a zero-initialised SCALE gate to every LoRA Linear of the active adapter; freeze everything else.

    Args:
        peft_model: a ``peft.PeftModel`` (or its ``base_model``) with exactly one active LoRA adapter.
        L: lambda's lower end, ``L < 0`` (reverse the LoRA delta down to ``L`` times).
        U: lambda's upper end, ``U > 1`` (extrapolate up to ``U`` times).
        tau: gate temperature, ``tau > 0``: ``v = tanh((w . h + b) / tau)``.
        disable_dropout: replace active LoRA dropout by identity (otherwise such layers are refused).

    Returns:
        The gate parameters, two per module (``weight (d_in,)``, ``bias (1,)``, float32, on the module's
        device), in module order; their total size is ``sum over modules of (d_in + 1)``. Only these
        require grad afterwards.

    Warns:
        UserWarning: every ``lora_B`` is zero (an untrained LoRA): the gates then get exactly zero
            gradient by construction (``d y / d lambda = scaling * B A h``), so Stage II cannot move them.

    Raises:
        GateError (a ValueError): bad L/U/tau, not a PEFT model, several active adapters, no LoRA
            layer, or a layer that is merged / DoRA or another variant / biased / quantised / not a
            Linear / with active dropout / already gated; raised before anything is changed, and the
            message names the layer.
    """
    adapter = _active_adapter(peft_model)
    cfg = GateConfig.make(L=L, U=U, tau=tau, adapter=adapter)
    layers = _lora_layers(peft_model, adapter, disable_dropout=disable_dropout, expect_gated=False)
    gated_cls = _gated_class()
    for p in peft_model.parameters():
        p.requires_grad_(False)
    params: list[nn.Parameter] = []
    for name, module in layers:
        if disable_dropout:
            module.lora_dropout[adapter] = nn.Identity()
        d_in = module.lora_A[adapter].weight.shape[1]
        device = module.lora_A[adapter].weight.device
        module.__class__ = gated_cls
        module.scale_gate_weight = nn.Parameter(torch.zeros(d_in, dtype=torch.float32, device=device))
        module.scale_gate_bias = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device))
        module.scale_config = cfg
        module.scale_record_lambda = False
        module.scale_last_lambda = None
        module.scale_fold = None
        module.scale_name = name
        params += [module.scale_gate_weight, module.scale_gate_bias]
    tuner = _tuner(peft_model)
    if tuner is not None and type(tuner) not in _GATED_TUNERS.values():
        tuner.__class__ = _gated_tuner_class(type(tuner))
    if all(not bool(m.lora_B[adapter].weight.detach().any()) for _, m in layers):
        warnings.warn(f"every lora_B of adapter {adapter!r} is zero (an untrained LoRA): the gates get exactly zero "
                      f"gradient (d y / d lambda = scaling * B A h = 0) and will not move; train Stage I first "
                      f"(treadle.scale.sft)", UserWarning, stacklevel=2)
    return params


def remove_gates(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """Take the SCALE gates off: every gated layer becomes PEFT's plain ``lora.Linear`` again (the Stage-I
    LoRA, lambda = 1), which PEFT merges (``merge_and_unload()``) and saves as usual.

    Parameters keep their ``requires_grad`` (everything frozen by :func:`attach_gates` stays frozen).

    Returns:
        The removed gates, ``{"<module name>.weight": (d_in,), "<module name>.bias": (1,)}`` float32
        (the tensors :func:`save_gates` writes), so that nothing is lost.

    Raises:
        GateError: the model has no gates, or a gated layer is merged (unmerge first:
            ``peft_model.unmerge_adapter()``); raised before anything is changed.
    """
    layers = gated_layers(peft_model)
    if not layers:
        raise GateError("the model has no gates to remove")
    merged = [n for n, m in layers.items() if m.scale_config.adapter in m.merged_adapters]
    if merged:
        raise GateError(f"{len(merged)} gated layer(s) are merged (e.g. {merged[0]!r}): their weights hold the folded "
                        f"gate; call peft_model.unmerge_adapter() before remove_gates()")
    base_cls = _peft_lora().Linear
    removed = {}
    for name, m in layers.items():
        removed[f"{name}.weight"] = m.scale_gate_weight.detach()
        removed[f"{name}.bias"] = m.scale_gate_bias.detach()
        del m.scale_gate_weight, m.scale_gate_bias  # registered parameters: nn.Module.__delattr__ unregisters
        for attr in ("scale_config", "scale_record_lambda", "scale_last_lambda", "scale_fold", "scale_name"):
            m.__dict__.pop(attr, None)
        m.__class__ = base_cls
    tuner = _tuner(peft_model)
    if tuner is not None and type(tuner) in _GATED_TUNERS.values():
        tuner.__class__ = type(tuner).__mro__[1]
    return removed


def gated_layers(peft_model: nn.Module) -> dict[str, nn.Module]:
    """``{module name: GatedLoraLinear}`` of a model with gates attached (empty if none)."""
    cls = _gated_class()
    return {name: m for name, m in peft_model.named_modules() if isinstance(m, cls)}


def record_lambda(peft_model: nn.Module, on: bool = True) -> None:
    """Make every gated layer keep the (detached) lambda of its last forward in ``scale_last_lambda``."""
    for m in gated_layers(peft_model).values():
        m.scale_record_lambda = on
        if not on:
            m.scale_last_lambda = None


def _layout(layers) -> dict[str, list[int]]:
    out = {}
    for name, m in layers.items():
        a = m.lora_A[m.scale_config.adapter].weight
        b = m.lora_B[m.scale_config.adapter].weight
        out[name] = [int(a.shape[1]), int(b.shape[0]), int(a.shape[0])]  # d_in, d_out, r
    return out


def save_gates(peft_model: nn.Module, path: str | Path) -> Path:
    """Write the gates and their config to a safetensors file.

    Tensors ``"<module name>.weight" (d_in,)`` and ``"<module name>.bias" (1,)``; metadata ``format``,
    ``config`` (JSON: L, U, tau, adapter) and ``layout`` (JSON: module name -> [d_in, d_out, r]).

    Raises:
        GateError: the model has no gates.
    """
    from safetensors.torch import save_file

    layers = gated_layers(peft_model)
    if not layers:
        raise GateError("the model has no gates to save; call attach_gates() first")
    cfg = next(iter(layers.values())).scale_config
    tensors = {}
    for name, m in layers.items():
        tensors[f"{name}.weight"] = m.scale_gate_weight.detach().cpu().contiguous()
        tensors[f"{name}.bias"] = m.scale_gate_bias.detach().cpu().contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": FORMAT, "config": json.dumps(asdict(cfg)),
                                            "layout": json.dumps(_layout(layers))})
    return path


def load_gates(peft_model: nn.Module, path: str | Path, *, disable_dropout: bool = False) -> list[nn.Parameter]:
    """Load gates saved by :func:`save_gates` onto a model with the same adapter layout.

    Attaches gates with the file's (L, U, tau) when the model has none; if it has gates, their config
    must match the file's. Returns the gate parameters as :func:`attach_gates` does.

    Raises:
        GateError: a missing, unreadable or truncated file, not a treadle gate file, a different config, or a
            different adapter layout (module names, d_in, d_out or rank), named in the message; raised before
            the model is changed.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise GateError(f"{path} is not a treadle gate file (format {meta.get('format')!r}, "
                                f"expected {FORMAT!r})")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise GateError(f"could not read the gate file {path} (not a safetensors file written by save_gates, or "
                        f"truncated): {err}") from None
    cfg = GateConfig.make(**json.loads(meta["config"]))
    layout = json.loads(meta["layout"])
    existing = gated_layers(peft_model)
    if existing:
        have = next(iter(existing.values())).scale_config
        if have != cfg:
            raise GateError(f"the model's gates have config {have}, the file {path} has {cfg}")
        current = _layout(existing)
    else:
        adapter = _active_adapter(peft_model)
        if adapter != cfg.adapter:
            raise GateError(f"the file's gates belong to adapter {cfg.adapter!r}, the active adapter is {adapter!r}")
        layers = _lora_layers(peft_model, adapter, disable_dropout=disable_dropout, expect_gated=False)
        current = {}
        for name, m in layers:
            a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight
            current[name] = [int(a.shape[1]), int(b.shape[0]), int(a.shape[0])]
    if current != layout:
        missing = sorted(set(layout) - set(current))
        extra = sorted(set(current) - set(layout))
        differ = sorted(n for n in set(layout) & set(current) if layout[n] != current[n])
        raise GateError(f"adapter layout differs from the file {path}: modules only in the file {missing[:5]}, "
                        f"only in the model {extra[:5]}, with other [d_in, d_out, r] "
                        f"{[(n, layout[n], current[n]) for n in differ[:5]]}")
    params = (attach_gates(peft_model, cfg.L, cfg.U, cfg.tau, disable_dropout=disable_dropout) if not existing
              else [p for m in existing.values() for p in (m.scale_gate_weight, m.scale_gate_bias)])
    with torch.no_grad():
        for name, m in gated_layers(peft_model).items():
            m.scale_gate_weight.copy_(tensors[f"{name}.weight"])
            m.scale_gate_bias.copy_(tensors[f"{name}.bias"])
    return params


def lambda_shares(lam: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """Shares of tokens with lambda < 0 (reverse), in [0, 1) (suppress), exactly 1 (keep: the Stage-I
    delta unchanged, e.g. every token of freshly attached gates) and > 1 (extrapolate) (SCALE sec. 5).
    The four shares sum to 1.

    Args:
        lam: lambda values of any shape (e.g. ``scale_last_lambda`` of a gated layer).
        mask: optional bool of the same shape selecting the tokens to count (e.g. generated ones).

    Raises:
        ValueError: no tokens selected, or a mask of another shape.
    """
    if mask is not None:
        if mask.shape != lam.shape:
            raise ValueError(f"mask must have lambda's shape {tuple(lam.shape)}, got {tuple(mask.shape)}")
        lam = lam[mask]
    lam = lam.reshape(-1).float()
    if lam.numel() == 0:
        raise ValueError("no tokens selected: shares are undefined")
    n = lam.numel()
    return {"reverse": float((lam < 0).sum()) / n, "suppress": float(((lam >= 0) & (lam < 1)).sum()) / n,
            "keep": float((lam == 1).sum()) / n, "extrapolate": float((lam > 1).sum()) / n}


def lambda_report(peft_model: nn.Module, mask: torch.Tensor | None = None) -> dict[str, dict]:
    """Reverse / suppress / keep / extrapolate shares of the lambdas recorded by the last forward (SCALE sec. 5).

    Call :func:`record_lambda` before the forward. ``mask`` (bool, the forward's ``(batch, seq)``
    token shape) selects the tokens to count, e.g. generated ones.

    Returns:
        ``{"overall": shares, "per_type": {module type (e.g. "q_proj"): shares}, "per_module":
        {module name: shares}}`` with shares as in :func:`lambda_shares`; types pool all layers.

    Raises:
        GateError: the model has no gates, or no lambda was recorded.
        ValueError: as :func:`lambda_shares` (a mask of another shape, no selected token).
    """
    layers = gated_layers(peft_model)
    if not layers:
        raise GateError("the model has no gates; call attach_gates() first")
    recorded = {n: m.scale_last_lambda for n, m in layers.items() if m.scale_last_lambda is not None}
    if not recorded:
        raise GateError("no lambda recorded: call record_lambda(model) and run a forward first")
    per_module = {n: lambda_shares(lam, mask) for n, lam in recorded.items()}
    pooled: dict[str, list[torch.Tensor]] = {}
    for n, lam in recorded.items():
        pooled.setdefault(n.rsplit(".", 1)[-1], []).append(lam[mask] if mask is not None else lam.reshape(-1))
    per_type = {t: lambda_shares(torch.cat(v)) for t, v in pooled.items()}
    overall = lambda_shares(torch.cat([torch.cat(v) for v in pooled.values()]))
    return {"overall": overall, "per_type": per_type, "per_module": per_module}

"""Shared cases of the kernel-contract tests (tests/contracts): one builder per public op, the
backends available here, a float64 expectation through the reference (the literal spec, never
the kernels), and the tolerance rule.

Each ``make_*`` returns a :class:`Case`: ``inputs`` (tensors and options, in the dtypes under
test), ``grad_names`` (the inputs that require grad) and ``call(backend, **inputs)`` running the
public op. :func:`expect64` evaluates the reference on float64 copies of the inputs; :func:`plain`
on the inputs as given (plain PyTorch in the same dtypes: the rule's yardstick).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from treadle import dispatch, ops
from treadle.reference import (gated_lora_reference, grpo_advantages_reference, stair_readout_reference,
                               topk_entropy_reference)
from treadle.reference.scale import topk_entropy_rows_reference
from treadle.testing import max_error

OPS = ("grpo_advantages", "stair_readout", "gated_lora", "gated_lora_linear", "topk_entropy",
       "topk_entropy_from_hidden")
GRAD_OPS = OPS[1:]  # grpo_advantages has no gradient
TOPK = ("topk_entropy", "topk_entropy_from_hidden")  # one PyTorch path (backend None)


def backends(op: str, device: str = "cpu") -> list[str | None]:
    """Every backend that can run ``op`` on ``device`` tensors here (None: the op has one path)."""
    if op in TOPK:
        return [None]
    out: list[str | None] = ["reference"] if device == "cpu" else []
    for name in ("cpp", "triton", "cuda"):
        try:
            dispatch.choose(op, device, name)
        except dispatch.BackendUnavailableError:
            continue
        out.append(name)
    return out


def op_backend_params(op_names=OPS, device: str = "cpu") -> list:
    return [pytest.param(op, b, id=f"{op}-{b or 'torch'}") for op in op_names for b in backends(op, device)]


@dataclass
class Case:
    op: str
    inputs: dict
    grad_names: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)  # non-tensor keyword options passed as given

    def clone(self, dtype: torch.dtype | None = None, requires_grad: bool = True, device: str = "cpu") -> dict:
        """Detached copies (cast to ``dtype`` when given; int/bool tensors unchanged), grads enabled."""
        out = {}
        for k, v in self.inputs.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().clone().to(device)
                if dtype is not None and v.is_floating_point():
                    v = v.to(dtype)
                if requires_grad and k in self.grad_names:
                    v.requires_grad_(True)
            out[k] = v
        return out


def call(case: Case, inputs: dict, backend: str | None) -> torch.Tensor:
    """The public op on ``inputs``; returns its (first) output."""
    kw = dict(case.options)
    op = case.op
    if op == "grpo_advantages":
        return ops.grpo_advantages(inputs["rewards"], inputs["group_ids"], valid=inputs.get("valid"),
                                   flags=inputs.get("flags"), backend=backend, **kw)
    if op == "stair_readout":
        return ops.stair_readout(inputs["q"], inputs["k_bank"], inputs["v_bank"], inputs["normals"],
                                 bank_lengths=inputs.get("bank_lengths"), backend=backend, **kw)
    if op == "gated_lora":
        return ops.gated_lora(inputs["x"], inputs["base_out"], inputs["lora_A"], inputs["lora_B"],
                              inputs["gate_weight"], inputs["gate_bias"], backend=backend, **kw)
    if op == "gated_lora_linear":
        return ops.gated_lora_linear(inputs["x"], inputs["weight"], inputs.get("bias"), inputs["lora_A"],
                                     inputs["lora_B"], inputs["gate_weight"], inputs["gate_bias"], backend=backend,
                                     **kw)
    if op == "topk_entropy":
        return ops.topk_entropy(inputs["logits"], mask=inputs.get("mask"), **kw)
    if op == "topk_entropy_from_hidden":
        return ops.topk_entropy_from_hidden(inputs["hidden"], inputs["lm_head_weight"], mask=inputs.get("mask"),
                                            **kw)
    raise KeyError(op)


def reference(case: Case, inputs: dict) -> torch.Tensor:
    """The spec (treadle.reference) on ``inputs`` as given: float64 inputs give the expectation."""
    kw = dict(case.options)
    op = case.op
    if op == "grpo_advantages":
        std = kw.pop("std", "unbiased")
        eps_placement = kw.pop("eps_placement", "std")
        nonfinite = kw.pop("nonfinite", "raise")
        kw.pop("check_finite", None)
        scale = kw.pop("scale_rewards", None) or "group"
        return grpo_advantages_reference(inputs["rewards"], inputs["group_ids"], inputs.get("valid"),
                                         inputs.get("flags"), unbiased=std == "unbiased",
                                         eps_in_sqrt=eps_placement == "var", skip_nonfinite=nonfinite == "skip",
                                         scale_rewards=scale, **kw)
    if op == "stair_readout":
        return stair_readout_reference(inputs["q"], inputs["k_bank"], inputs["v_bank"], inputs["normals"],
                                       bank_lengths=inputs.get("bank_lengths"), **kw)
    if op == "gated_lora":
        return gated_lora_reference(inputs["x"], inputs["base_out"], inputs["lora_A"], inputs["lora_B"],
                                    inputs["gate_weight"], inputs["gate_bias"], **kw)
    if op == "gated_lora_linear":
        base = torch.nn.functional.linear(inputs["x"], inputs["weight"], inputs.get("bias"))
        return gated_lora_reference(inputs["x"], base, inputs["lora_A"], inputs["lora_B"], inputs["gate_weight"],
                                    inputs["gate_bias"], **kw)
    if op == "topk_entropy":
        k = kw.get("k", 100)
        if kw.get("reduction") == "none":
            return topk_entropy_rows_reference(inputs["logits"], k)
        return topk_entropy_reference(inputs["logits"], k, inputs.get("mask"))
    if op == "topk_entropy_from_hidden":
        logits = inputs["hidden"] @ inputs["lm_head_weight"].t()
        return topk_entropy_reference(logits, kw.get("k", 100), inputs.get("mask"))
    raise KeyError(op)


def grads(out: torch.Tensor, inputs: dict, names, seed: int = 1) -> dict:
    """Gradients of ``<out, w>`` (w a fixed random weight) with respect to ``inputs[names]``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device=out.device, dtype=out.dtype)
    tensors = [inputs[n] for n in names]
    gs = torch.autograd.grad((out * w).sum(), tensors, allow_unused=True)
    return {n: (torch.zeros_like(t) if gi is None else gi) for n, t, gi in zip(names, tensors, gs)}


def run_with_grads(case: Case, backend, dtype=None, ref: bool = False, device: str = "cpu"):
    """(output, {name: grad}) of the op (``ref``: of the spec) on copies of the case's inputs."""
    inputs = case.clone(dtype, device=device)
    out = reference(case, inputs) if ref else call(case, inputs, backend)
    names = case.grad_names if out.requires_grad else ()
    return out, grads(out, inputs, names) if names else {}


def rule_floor(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """Small absolute floor of the rule: a few ulps of the result's magnitude in ``dtype`` (exact cases)."""
    scale = ref.detach().abs().max().item() if ref.numel() else 0.0
    return 4 * torch.finfo(dtype).eps * max(scale, 1e-30)


def assert_rule(kernel: torch.Tensor, plain_out: torch.Tensor, ref64: torch.Tensor, *, factor: float, dtype,
                name: str, floor: float | None = None) -> None:
    """The project's tolerance rule, with the floor of :func:`rule_floor` (or ``floor`` when given);
    NaN/inf never pass."""
    assert kernel.shape == ref64.shape, f"{name}: shape {tuple(kernel.shape)} != {tuple(ref64.shape)}"
    assert bool(torch.isfinite(kernel).all()), f"{name}: non-finite values in the kernel's result"
    ek, ep = max_error(kernel, ref64), max_error(plain_out, ref64)
    floor = rule_floor(dtype, ref64) if floor is None else floor
    assert ek <= factor * ep + floor, (f"{name}: error {ek:.3g} vs float64 > {factor} x plain PyTorch's "
                                       f"{ep:.3g} (+ floor {floor:.2g})")


# ---------------------------------------------------------------- case builders
def make_grpo(n_groups=5, size=4, dtype=torch.float32, **options) -> Case:
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(n_groups * size, generator=g, dtype=torch.float64) * 3).to(dtype)
    ids = torch.arange(n_groups).repeat_interleave(size)[torch.randperm(n_groups * size, generator=g)]
    valid = torch.rand(n_groups * size, generator=g) > 0.2
    flags = torch.rand(n_groups * size, generator=g) > 0.7
    return Case("grpo_advantages", {"rewards": rewards, "group_ids": ids, "valid": valid, "flags": flags},
                options=options)


def make_stair(B=2, Hq=4, Hkv=2, T=5, M=8, D=24, Dv=20, dtype=torch.float32, lengths=(5, 3), **options) -> Case:
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
    inputs = {"q": r(B, Hq, T, D), "k_bank": r(B, Hkv, M, D), "v_bank": r(B, Hkv, M, Dv),
              "normals": torch.randn(Hq, D, generator=g, dtype=torch.float64).to(dtype) + 0.1}
    if lengths is not None:
        inputs["bank_lengths"] = torch.tensor(lengths[:B], dtype=torch.int64)
    options.setdefault("eps", 0.1)
    options.setdefault("mode", "diff")
    return Case("stair_readout", inputs, ("q", "normals"), options)


def _gate_options(options):
    for k, v in (("scaling", 2.0), ("L", -2.0), ("U", 3.0), ("tau", 0.7)):
        options.setdefault(k, v)
    return options


def make_gated_lora(lead=(3, 7), d_in=40, d_out=24, r=6, dtype=torch.float32, gate_dtype=None, **options) -> Case:
    g = torch.Generator().manual_seed(0)
    gate_dtype = gate_dtype or dtype

    def r_(*s, scale=1.0, dt=dtype):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dt)
    inputs = {"x": r_(*lead, d_in), "base_out": r_(*lead, d_out), "lora_A": r_(r, d_in, scale=max(d_in, 1) ** -0.5),
              "lora_B": r_(d_out, r, scale=0.5), "gate_weight": r_(d_in, scale=0.25, dt=gate_dtype),
              "gate_bias": torch.tensor([0.1], dtype=gate_dtype)}
    return Case("gated_lora", inputs, ("x", "base_out", "gate_weight", "gate_bias"), _gate_options(options))


def make_gated_lora_linear(lead=(3, 7), d_in=40, d_out=24, r=6, dtype=torch.float32, gate_dtype=None,
                           bias=True, **options) -> Case:
    base = make_gated_lora(lead, d_in, d_out, r, dtype, gate_dtype)
    g = torch.Generator().manual_seed(1)
    inputs = dict(base.inputs)
    del inputs["base_out"]
    inputs["weight"] = (torch.randn(d_out, d_in, generator=g, dtype=torch.float64) * max(d_in, 1) ** -0.5).to(dtype)
    inputs["bias"] = torch.randn(d_out, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return Case("gated_lora_linear", inputs, ("x", "gate_weight", "gate_bias"), _gate_options(options))


def make_topk(lead=(3, 5), V=50, k=8, dtype=torch.float32, mask=True, **options) -> Case:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(*lead, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    inputs = {"logits": logits}
    if mask:
        m = torch.rand(*lead, generator=g) > 0.3
        m.view(-1)[0] = True
        inputs["mask"] = m
    options["k"] = k
    return Case("topk_entropy", inputs, ("logits",), options)


def make_topk_hidden(lead=(3, 5), d=12, V=50, k=8, dtype=torch.float32, mask=True, **options) -> Case:
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden": torch.randn(*lead, d, generator=g, dtype=torch.float64).to(dtype),
              "lm_head_weight": (torch.randn(V, d, generator=g, dtype=torch.float64) * 0.7).to(dtype)}
    if mask:
        m = torch.rand(*lead, generator=g) > 0.3
        m.view(-1)[0] = True
        inputs["mask"] = m
    options["k"] = k
    options.setdefault("chunk_size", 4)
    return Case("topk_entropy_from_hidden", inputs, ("hidden", "lm_head_weight"), options)


MAKERS: dict[str, Callable[..., Case]] = {
    "grpo_advantages": make_grpo, "stair_readout": make_stair, "gated_lora": make_gated_lora,
    "gated_lora_linear": make_gated_lora_linear, "topk_entropy": make_topk,
    "topk_entropy_from_hidden": make_topk_hidden,
}


def make(op: str, **kw) -> Case:
    return MAKERS[op](**kw)

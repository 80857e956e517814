"""Every argument check of the public ops, with the exact exception type and message.

The ops' own test files check that bad input raises and that the message names the argument; these
tests pin each message word for word (so a check that fires for the wrong reason, or a message that
loses the expected value, fails) and the boundary values that must NOT raise. One table per op:
``(call, exception type, exact message)``.
"""
from __future__ import annotations

import math

import pytest
import torch

from treadle.ops.gated_lora import gated_lora, gated_lora_linear
from treadle.ops.grpo_advantages import grpo_advantages
from treadle.ops.stair_readout import stair_readout
from treadle.ops.topk_entropy import topk_entropy, topk_entropy_from_hidden
from treadle.testing import require_backend

FLOATS = "(torch.float16, torch.bfloat16, torch.float32, torch.float64)"
I64 = torch.int64


def raises_exactly(exc, message, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    assert str(info.value) == message


# ---------------------------------------------------------------- grpo_advantages
R3, G3 = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 0, 1])
META = torch.device("meta")

GRPO_BAD = [
    (([1.0], G3), {}, TypeError, "rewards must be a torch.Tensor, got list"),
    ((R3, [0, 0, 1]), {}, TypeError, "group_ids must be a torch.Tensor of integers, got list"),
    ((R3.long(), G3), {}, TypeError, f"rewards must be a floating tensor (one of {FLOATS}), got torch.int64"),
    ((R3, G3.float()), {}, TypeError, "group_ids must be an integer tensor (e.g. torch.int64), got torch.float32"),
    ((R3, G3.bool()), {}, TypeError, "group_ids must be an integer tensor (e.g. torch.int64), got torch.bool"),
    ((R3.reshape(3, 1), G3), {}, ValueError, "rewards must be 1-D (N,), got shape (3, 1)"),
    ((torch.tensor(1.0), G3), {}, ValueError, "rewards must be 1-D (N,), got shape ()"),
    ((R3, G3[:2]), {}, ValueError, "group_ids must have shape (3,) like rewards, got (2,)"),
    ((R3, G3.reshape(3, 1)), {}, ValueError, "group_ids must have shape (3,) like rewards, got (3, 1)"),
    ((R3, G3.to(META)), {}, ValueError, "group_ids is on meta but rewards is on cpu"),
    ((R3, G3), {"estimator": "ppo"}, ValueError,
     "estimator must be one of ('grpo', 'dr_grpo', 'rloo', 'reinforce_baseline'), got 'ppo'"),
    ((R3, G3), {"std": "sample"}, ValueError, "std must be 'unbiased' or 'biased', got 'sample'"),
    ((R3, G3), {"eps_placement": "mean"}, ValueError, "eps_placement must be 'std' or 'var', got 'mean'"),
    ((R3, G3), {"singleton": "one"}, ValueError, "singleton must be one of ('zero', 'raw'), got 'one'"),
    ((R3, G3), {"estimator": "rloo", "scale_rewards": "group"}, ValueError,
     "scale_rewards applies to estimator='grpo' only, got estimator='rloo'"),
    ((R3, G3), {"scale_rewards": "token"}, ValueError,
     "scale_rewards must be one of ('group', 'batch', 'none'), got 'token'"),
    ((R3, G3), {"nonfinite": "ignore"}, ValueError, "nonfinite must be 'raise' or 'skip', got 'ignore'"),
    ((R3, G3), {"eps": -1e-9}, ValueError, "eps must be a finite number >= 0, got -1e-09"),
    ((R3, G3), {"eps": math.inf}, ValueError, "eps must be a finite number >= 0, got inf"),
    ((R3, G3), {"eps": math.nan}, ValueError, "eps must be a finite number >= 0, got nan"),
]
for _mask in ("valid", "flags"):
    GRPO_BAD += [
        ((R3, G3), {_mask: [True] * 3}, TypeError, f"{_mask} must be a torch.Tensor of dtype bool, got list"),
        ((R3, G3), {_mask: torch.ones(3, dtype=I64)}, TypeError,
         f"{_mask} must have dtype torch.bool, got torch.int64"),
        ((R3, G3), {_mask: torch.ones(2, dtype=torch.bool)}, ValueError,
         f"{_mask} must have shape (3,) like rewards, got (2,)"),
        ((R3, G3), {_mask: torch.ones(3, 1, dtype=torch.bool)}, ValueError,
         f"{_mask} must have shape (3,) like rewards, got (3, 1)"),
        ((R3, G3), {_mask: torch.ones(3, dtype=torch.bool, device=META)}, ValueError,
         f"{_mask} is on meta but rewards is on cpu; put them on one device"),
    ]


GRPO_BAD += [
    ((R3, G3), {"eps": "1e-6"}, TypeError, "eps must be a float, got str '1e-6'"),
    ((R3, G3), {"eps": True}, TypeError, "eps must be a float, got bool True"),
    ((R3, G3), {"eps": None}, TypeError, "eps must be a float, got NoneType None"),
    ((R3, G3), {"check_finite": "no"}, TypeError, "check_finite must be True, False or None, got 'no'"),
]


@pytest.mark.parametrize("args,kwargs,exc,message", GRPO_BAD)
def test_grpo_advantages_bad_arguments(args, kwargs, exc, message):
    raises_exactly(exc, message, grpo_advantages, *args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_grpo_advantages_nonfinite_message(dtype, bad):
    r = torch.tensor([0.0, 1.0, bad, bad, 2.0], dtype=dtype)
    g = torch.zeros(5, dtype=I64)
    raises_exactly(ValueError, f"rewards has 2 NaN/inf value(s) in considered rows (first at index 2: {bad}); pass "
                   "nonfinite='skip' to leave such rows out, or valid=False for them", grpo_advantages, r, g)
    # the first rejected one is left out of the count and the index
    valid = torch.tensor([True, True, False, True, True])
    raises_exactly(ValueError, f"rewards has 1 NaN/inf value(s) in considered rows (first at index 3: {bad}); pass "
                   "nonfinite='skip' to leave such rows out, or valid=False for them", grpo_advantages, r, g,
                   valid=valid)
    # one row is checked too
    raises_exactly(ValueError, f"rewards has 1 NaN/inf value(s) in considered rows (first at index 0: {bad}); pass "
                   "nonfinite='skip' to leave such rows out, or valid=False for them", grpo_advantages,
                   torch.tensor([bad], dtype=dtype), torch.zeros(1, dtype=I64))


@require_backend("grpo_advantages")
def test_grpo_advantages_boundaries_that_do_not_raise():
    r, g = torch.tensor([0.0, 1.0, 3.0, 5.0]), torch.tensor([7, 7, -2, -2])
    # eps = 0 is allowed; the group (0, 1) has mean 0.5 and unbiased std sqrt(0.5)
    a = grpo_advantages(r, g, eps=0.0, backend="cpp")
    s = math.sqrt(0.5)
    assert a.tolist() == pytest.approx([-0.5 / s, 0.5 / s, -1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-6)
    # an int eps is read as a float
    assert torch.equal(grpo_advantages(r, g, eps=0, backend="cpp"), a)
    # every estimator accepts scale_rewards=None, grpo every scale
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        assert grpo_advantages(r, g, estimator=est, backend="cpp").shape == (4,)
    assert grpo_advantages(r, g, scale_rewards="none", backend="cpp").tolist() == [-0.5, 0.5, -1.0, 1.0]
    # NaN/inf rewards with the check off, or in rejected rows, or skipped, do not raise
    rn = torch.tensor([0.0, math.nan, 1.0, 3.0])
    assert grpo_advantages(rn, g, valid=torch.tensor([True, False, True, True]), backend="cpp")[1].item() == 0.0
    assert grpo_advantages(rn, g, nonfinite="skip", backend="cpp")[1].item() == 0.0
    grpo_advantages(rn, g, check_finite=False, backend="cpp")  # no check, no error (the value is unspecified)
    # finite rewards whose sum overflows are not NaN/inf
    big = torch.tensor([3e38, 3e38, -3e38, -3e38], dtype=torch.float32)
    assert grpo_advantages(big, torch.tensor([0, 0, 1, 1]), backend="cpp").tolist() == [0.0, 0.0, 0.0, 0.0]
    # integer ids of every width
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        assert grpo_advantages(r, torch.tensor([7, 7, 2, 2], dtype=dt), backend="cpp").tolist() == pytest.approx(
            [-0.5 / (s + 1e-6), 0.5 / (s + 1e-6), -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)], rel=1e-6)


# ---------------------------------------------------------------- gated_lora / gated_lora_linear
def _lora(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(x=t(4, 8), base_out=t(4, 6), lora_A=t(2, 8), lora_B=t(6, 2), gate_weight=t(8),
                gate_bias=torch.zeros(1, dtype=dtype))


OK = dict(scaling=1.0, L=-1.0, U=2.0, tau=1.0)
LORA_NAMES = ("x", "base_out", "lora_A", "lora_B", "gate_weight", "gate_bias")


def _gl(**over):
    a = _lora()
    kw = dict(OK)
    for k, v in over.items():
        (a if k in LORA_NAMES else kw)[k] = v
    kw.setdefault("backend", "cpp")
    return gated_lora(*(a[n] for n in LORA_NAMES), **kw)


def _frozen_grad(t):
    return t.clone().requires_grad_(True)


GL_BAD = [
    ({"scaling": "1"}, TypeError, "scaling must be a Python float, got str"),
    ({"scaling": True}, TypeError, "scaling must be a Python float, got bool"),
    ({"scaling": None}, TypeError, "scaling must be a Python float, got NoneType"),
    ({"scaling": math.inf}, ValueError, "scaling must be a finite number, got inf"),
    ({"scaling": math.nan}, ValueError, "scaling must be a finite number, got nan"),
    ({"L": 0.0}, ValueError, "L must be a finite number < 0 (lambda's lower end; L < 0 < 1 < U), got 0.0"),
    ({"L": 0.5}, ValueError, "L must be a finite number < 0 (lambda's lower end; L < 0 < 1 < U), got 0.5"),
    ({"L": -math.inf}, ValueError, "L must be a finite number < 0 (lambda's lower end; L < 0 < 1 < U), got -inf"),
    ({"L": True}, TypeError, "L must be a Python float, got bool"),
    ({"U": 1.0}, ValueError, "U must be a finite number > 1 (lambda's upper end; L < 0 < 1 < U), got 1.0"),
    ({"U": math.inf}, ValueError, "U must be a finite number > 1 (lambda's upper end; L < 0 < 1 < U), got inf"),
    ({"U": "2"}, TypeError, "U must be a Python float, got str"),
    ({"tau": 0.0}, ValueError, "tau must be a finite number > 0 (the gate temperature), got 0.0"),
    ({"tau": -1}, ValueError, "tau must be a finite number > 0 (the gate temperature), got -1.0"),
    ({"tau": math.nan}, ValueError, "tau must be a finite number > 0 (the gate temperature), got nan"),
    ({"tau": [1.0]}, TypeError, "tau must be a Python float, got list"),
    ({"x": torch.tensor(1.0), "base_out": torch.zeros(6)}, ValueError, "x must have shape (..., d_in), got a scalar"),
    ({"base_out": torch.tensor(1.0)}, ValueError, "base_out must have shape (..., d_out), got a scalar"),
    ({"base_out": torch.zeros(3, 6)}, ValueError,
     "base_out must have shape (4,) + (d_out,) like x's leading dims, got (3, 6)"),
    ({"base_out": torch.zeros(1, 4, 6)}, ValueError,
     "base_out must have shape (4,) + (d_out,) like x's leading dims, got (1, 4, 6)"),
    ({"base_out": torch.zeros(4, 6, dtype=torch.float64)}, TypeError,
     "base_out must have x's dtype torch.float32, got torch.float64"),
    ({"base_out": torch.zeros(4, 6, device="meta")}, ValueError,
     "base_out is on meta but x is on cpu; put them on one device"),
    ({"lora_A": torch.zeros(2, 7)}, ValueError, "lora_A must have shape (r, d_in=8), got (2, 7)"),
    ({"lora_A": torch.zeros(8)}, ValueError, "lora_A must have shape (r, d_in=8), got (8,)"),
    ({"lora_B": torch.zeros(6, 3)}, ValueError, "lora_B must have shape (d_out=6, r=2), got (6, 3)"),
    ({"lora_B": torch.zeros(5, 2)}, ValueError, "lora_B must have shape (d_out=6, r=2), got (5, 2)"),
    ({"lora_B": torch.zeros(1, 6, 2)}, ValueError, "lora_B must have shape (d_out=6, r=2), got (1, 6, 2)"),
    ({"gate_weight": torch.zeros(7)}, ValueError, "gate_weight must have shape (d_in=8,), got (7,)"),
    ({"gate_weight": torch.zeros(1, 8)}, ValueError, "gate_weight must have shape (d_in=8,), got (1, 8)"),
    ({"gate_bias": torch.zeros(2)}, ValueError, "gate_bias must have shape () or (1,), got (2,)"),
    ({"gate_bias": torch.zeros(1, 1)}, ValueError, "gate_bias must have shape () or (1,), got (1, 1)"),
    ({"gate_bias": torch.zeros(0)}, ValueError, "gate_bias must have shape () or (1,), got (0,)"),
]
for _n in ("x", "base_out", "lora_A", "lora_B", "gate_weight", "gate_bias"):
    GL_BAD += [({_n: [1.0]}, TypeError, f"{_n} must be a torch.Tensor, got list"),
               ({_n: torch.zeros(2, dtype=I64)}, TypeError,
                f"{_n} must have a floating dtype (one of {FLOATS}), got torch.int64")]
for _n, _shape in (("lora_A", (2, 8)), ("lora_B", (6, 2))):
    GL_BAD += [({_n: torch.zeros(_shape, dtype=torch.float64)}, TypeError,
                f"{_n} must have x's dtype torch.float32, got torch.float64"),
               ({_n: _frozen_grad(torch.zeros(_shape))}, ValueError,
                f"{_n} requires grad, but gated LoRA treats it as frozen (SCALE Stage II) and gives it no gradient; "
                f"call {_n}.requires_grad_(False) first")]
for _n, _shape in (("lora_A", (2, 8)), ("lora_B", (6, 2)), ("gate_weight", (8,)), ("gate_bias", (1,))):
    GL_BAD += [({_n: torch.zeros(_shape, device="meta")}, ValueError,
                f"{_n} is on meta but x is on cpu; put them on one device")]
for _n, _shape in (("gate_weight", (8,)), ("gate_bias", (1,))):
    GL_BAD += [({_n: torch.zeros(_shape, dtype=torch.float64)}, TypeError,
                f"{_n} must have x's dtype torch.float32, got torch.float64")]


GL_BAD += [({"return_lambda": "no"}, TypeError, "return_lambda must be True or False, got 'no'")]


@pytest.mark.parametrize("over,exc,message", GL_BAD)
def test_gated_lora_bad_arguments(over, exc, message):
    raises_exactly(exc, message, _gl, **over)


def test_gated_lora_gate_dtype_on_half_x():
    a = _lora(torch.float16)
    names = [n for n in LORA_NAMES]
    for gate in ("gate_weight", "gate_bias"):
        bad = dict(a, **{gate: a[gate].to(torch.bfloat16)})
        raises_exactly(TypeError, f"{gate} must have x's dtype torch.float16 or torch.float32, got torch.bfloat16",
                       gated_lora, *(bad[n] for n in names), **OK)
    # a float32 gate on float16 x is allowed and gives the float32-gate result: lambda from the fp32 gate
    a["gate_weight"] = torch.full((8,), 0.25)
    a["gate_bias"] = torch.full((1,), -0.5)
    y, lam = gated_lora(*(a[n] for n in names), **OK, return_lambda=True, backend="reference")
    assert y.dtype == torch.float16 and lam.dtype == torch.float32
    g = a["x"].float() @ a["gate_weight"] - 0.5
    v = torch.tanh(g)
    expect = 1 + 2 * torch.clamp(v, max=0) + 1 * torch.clamp(v, min=0)
    torch.testing.assert_close(lam, expect, atol=1e-3, rtol=1e-3)


@require_backend("gated_lora")
def test_gated_lora_boundaries_that_do_not_raise():
    a = _lora()
    args = [a[n] for n in LORA_NAMES]
    # int scalars are read as floats; gate_bias may be 0-d; L, U, tau just inside their ranges
    y_int = gated_lora(*args, scaling=1, L=-1, U=2, tau=1, backend="cpp")
    y_float = gated_lora(*args, **OK, backend="cpp")
    assert torch.equal(y_int, y_float)
    y0 = gated_lora(*args[:5], a["gate_bias"].reshape(()), **OK, backend="cpp")
    assert torch.equal(y0, y_float)
    # w = 0, b = 0: lambda = 1 exactly, y = base_out + scaling (x A^T) B^T
    expect = a["base_out"] + 0.5 * (a["x"] @ a["lora_A"].t()) @ a["lora_B"].t()
    y, lam = gated_lora(a["x"], a["base_out"], a["lora_A"], a["lora_B"], torch.zeros(8), torch.zeros(()),
                        scaling=0.5, L=-1e-9, U=1 + 1e-9, tau=1e-9, return_lambda=True, backend="cpp")
    assert torch.equal(lam, torch.ones(4))
    torch.testing.assert_close(y, expect)
    # frozen tensors that require grad are fine while grad is disabled
    with torch.no_grad():
        gated_lora(args[0], args[1], _frozen_grad(args[2]), _frozen_grad(args[3]), *args[4:], **OK, backend="cpp")


def _gll(**over):
    a = _lora()
    a["weight"], a["bias"] = torch.randn(6, 8), torch.randn(6)
    kw = dict(OK)
    for k, v in over.items():
        (a if k in LORA_NAMES + ("weight", "bias") else kw)[k] = v
    kw.setdefault("backend", "cpp")
    return gated_lora_linear(a["x"], a["weight"], a["bias"], a["lora_A"], a["lora_B"], a["gate_weight"],
                             a["gate_bias"], **kw)


GLL_BAD = [
    ({"x": [1.0]}, TypeError, "x must be a torch.Tensor, got list"),
    ({"x": torch.zeros(4, 8, dtype=I64)}, TypeError,
     f"x must have a floating dtype (one of {FLOATS}), got torch.int64"),
    ({"weight": [1.0]}, TypeError, "weight must be a torch.Tensor, got list"),
    ({"weight": torch.zeros(6, 8, dtype=I64)}, TypeError, f"weight must have a floating dtype (one of {FLOATS}), "
     "got torch.int64"),
    ({"bias": [1.0]}, TypeError, "bias must be a torch.Tensor, got list"),
    ({"bias": torch.zeros(6, dtype=I64)}, TypeError,
     f"bias must have a floating dtype (one of {FLOATS}), got torch.int64"),
    ({"weight": torch.zeros(6, 8, dtype=torch.float64)}, TypeError,
     "weight must have x's dtype torch.float32, got torch.float64"),
    ({"bias": torch.zeros(6, dtype=torch.float64)}, TypeError,
     "bias must have x's dtype torch.float32, got torch.float64"),
    ({"weight": torch.zeros(6, 7)}, ValueError, "weight must have shape (d_out, d_in=8), got (6, 7)"),
    ({"weight": torch.zeros(8)}, ValueError, "weight must have shape (d_out, d_in=8), got (8,)"),
    ({"x": torch.tensor(1.0)}, ValueError, "weight must have shape (d_out, d_in=?), got (6, 8)"),
    ({"bias": torch.zeros(5)}, ValueError, "bias must have shape (d_out=6,) or be None, got (5,)"),
    ({"bias": torch.zeros(1, 6)}, ValueError, "bias must have shape (d_out=6,) or be None, got (1, 6)"),
    ({"weight": torch.zeros(6, 8, device="meta")}, ValueError,
     "weight is on meta but x is on cpu; put them on one device"),
    ({"bias": torch.zeros(6, device="meta")}, ValueError, "bias is on meta but x is on cpu; put them on one device"),
    ({"lora_B": torch.zeros(5, 2)}, ValueError, "lora_B must have shape (d_out=6, r=2), got (5, 2)"),
    ({"tau": 0.0}, ValueError, "tau must be a finite number > 0 (the gate temperature), got 0.0"),
]
for _n, _shape in (("weight", (6, 8)), ("bias", (6,)), ("lora_A", (2, 8))):
    GLL_BAD += [({_n: _frozen_grad(torch.zeros(_shape))}, ValueError,
                 f"{_n} requires grad, but gated LoRA treats it as frozen (SCALE Stage II) and gives it no gradient; "
                 f"call {_n}.requires_grad_(False) first")]


GLL_BAD += [({"return_lambda": 1}, TypeError, "return_lambda must be True or False, got 1")]


@pytest.mark.parametrize("over,exc,message", GLL_BAD)
def test_gated_lora_linear_bad_arguments(over, exc, message):
    raises_exactly(exc, message, _gll, **over)


@require_backend("gated_lora_linear")
def test_gated_lora_linear_without_bias_is_the_unfused_op():
    a = _lora()
    w = torch.randn(6, 8)
    for bias in (None, torch.randn(6)):
        y = gated_lora_linear(a["x"], w, bias, a["lora_A"], a["lora_B"],
                              a["gate_weight"], a["gate_bias"], **OK, backend="cpp")
        base = a["x"] @ w.t() + (0 if bias is None else bias)
        expect = gated_lora(a["x"], base, a["lora_A"], a["lora_B"], a["gate_weight"], a["gate_bias"], **OK,
                            backend="reference")
        torch.testing.assert_close(y, expect)
    with torch.no_grad():  # a frozen base that requires grad is fine without grad
        gated_lora_linear(a["x"], _frozen_grad(w), _frozen_grad(torch.zeros(6)), a["lora_A"], a["lora_B"],
                          a["gate_weight"], a["gate_bias"], **OK, backend="cpp")


# ---------------------------------------------------------------- stair_readout
def _stair(**over):
    g = torch.Generator().manual_seed(1)
    a = dict(q=torch.randn(2, 4, 3, 8, generator=g), k_bank=torch.randn(2, 2, 5, 8, generator=g),
             v_bank=torch.randn(2, 2, 5, 6, generator=g), normals=torch.randn(4, 8, generator=g))
    a.update(over)
    return a


def _sr(**over):
    a = _stair(**over)
    return stair_readout(a.pop("q"), a.pop("k_bank"), a.pop("v_bank"), a.pop("normals"), **a)


def _nan_at(t, idx):
    t = t.clone()
    t[idx] = math.nan
    return t


SR_BAD = [
    ({"k_bank": torch.zeros(2, 2, 5, 8, dtype=torch.float64)}, TypeError,
     "q, k_bank and v_bank must share one dtype, got q torch.float32, k_bank torch.float64, v_bank torch.float32"),
    ({"v_bank": torch.zeros(2, 2, 5, 6, dtype=torch.float16)}, TypeError,
     "q, k_bank and v_bank must share one dtype, got q torch.float32, k_bank torch.float32, v_bank torch.float16"),
    ({"q": torch.zeros(4, 3, 8)}, ValueError, "q must be 4-D (B, Hq, T, D), got shape (4, 3, 8)"),
    ({"k_bank": torch.zeros(2, 5, 8)}, ValueError, "k_bank must be 4-D (B, Hkv, M, D), got shape (2, 5, 8)"),
    ({"v_bank": torch.zeros(1, 2, 2, 5, 6)}, ValueError,
     "v_bank must be 4-D (B, Hkv, M, Dv), got shape (1, 2, 2, 5, 6)"),
    ({"k_bank": torch.zeros(2, 2, 5, 7)}, ValueError,
     "k_bank must have shape (B=2, Hkv, M, D=8) to match q (2, 4, 3, 8), got (2, 2, 5, 7)"),
    ({"k_bank": torch.zeros(3, 2, 5, 8)}, ValueError,
     "k_bank must have shape (B=2, Hkv, M, D=8) to match q (2, 4, 3, 8), got (3, 2, 5, 8)"),
    ({"k_bank": torch.zeros(2, 3, 5, 8), "v_bank": torch.zeros(2, 3, 5, 6)}, ValueError,
     "Hq (q.shape[1] = 4) must be a multiple of Hkv (k_bank.shape[1] = 3)"),
    ({"k_bank": torch.zeros(2, 0, 5, 8), "v_bank": torch.zeros(2, 0, 5, 6)}, ValueError,
     "Hq (q.shape[1] = 4) must be a multiple of Hkv (k_bank.shape[1] = 0)"),
    ({"v_bank": torch.zeros(2, 2, 4, 6)}, ValueError,
     "v_bank must have shape (B=2, Hkv=2, M=5, Dv) like k_bank, got (2, 2, 4, 6)"),
    ({"v_bank": torch.zeros(2, 1, 5, 6)}, ValueError,
     "v_bank must have shape (B=2, Hkv=2, M=5, Dv) like k_bank, got (2, 1, 5, 6)"),
    ({"v_bank": torch.zeros(1, 2, 5, 6)}, ValueError,
     "v_bank must have shape (B=2, Hkv=2, M=5, Dv) like k_bank, got (1, 2, 5, 6)"),
    ({"normals": torch.ones(4, 7)}, ValueError, "normals must have shape (Hq=4, D=8), got (4, 7)"),
    ({"normals": torch.ones(2, 8)}, ValueError, "normals must have shape (Hq=4, D=8), got (2, 8)"),
    ({"normals": torch.ones(32)}, ValueError, "normals must have shape (Hq=4, D=8), got (32,)"),
    ({"normals": torch.ones(1, 4, 8)}, ValueError, "normals must have shape (Hq=4, D=8), got (1, 4, 8)"),
    ({"mode": "both"}, ValueError, "mode must be one of ('diff', 'reflected', 'reference'), got 'both'"),
    ({"eps": 1.0}, ValueError, "eps must be in [0, 1), got 1.0"),
    ({"eps": -0.1}, ValueError, "eps must be in [0, 1), got -0.1"),
    ({"eps": math.nan}, ValueError, "eps must be in [0, 1), got nan"),
    ({"scale": 0.0}, ValueError, "scale must be a finite number > 0, got 0.0"),
    ({"scale": -1}, ValueError, "scale must be a finite number > 0, got -1.0"),
    ({"scale": math.inf}, ValueError, "scale must be a finite number > 0, got inf"),
    ({"scale": math.nan}, ValueError, "scale must be a finite number > 0, got nan"),
    ({"bank_lengths": [1, 2]}, TypeError, "bank_lengths must be a torch.Tensor of integers, got list"),
    ({"bank_lengths": torch.tensor([1.0, 2.0])}, TypeError,
     "bank_lengths must be an integer tensor (e.g. torch.int64), got torch.float32"),
    ({"bank_lengths": torch.tensor([True, True])}, TypeError,
     "bank_lengths must be an integer tensor (e.g. torch.int64), got torch.bool"),
    ({"bank_lengths": torch.tensor([1, 2, 3])}, ValueError, "bank_lengths must have shape (B=2,), got (3,)"),
    ({"bank_lengths": torch.tensor([[1, 2]])}, ValueError, "bank_lengths must have shape (B=2,), got (1, 2)"),
    ({"bank_lengths": torch.tensor([1, 2], device="meta")}, ValueError, "bank_lengths is on meta but q is on cpu"),
    ({"bank_lengths": torch.tensor([1, 6])}, ValueError, "bank_lengths must lie in [0, M=5], got values in [1, 6]"),
    ({"bank_lengths": torch.tensor([-1, 2])}, ValueError, "bank_lengths must lie in [0, M=5], got values in [-1, 2]"),
    ({"bank_lengths": torch.tensor([6, 5], dtype=torch.int8)}, ValueError,
     "bank_lengths must lie in [0, M=5], got values in [5, 6]"),
    ({"normals": torch.ones(4, 8).index_fill_(0, torch.tensor([2, 3]), 0.0)}, ValueError,
     "normals[2] (query head 2) has zero length: a zero normal has no reflection direction"),
    ({"normals": torch.ones(4, 8, dtype=torch.float64).index_fill_(0, torch.tensor([0]), 0.0)}, ValueError,
     "normals[0] (query head 0) has zero length: a zero normal has no reflection direction"),
]
for _n, _shape in (("q", (2, 4, 3, 8)), ("k_bank", (2, 2, 5, 8)), ("v_bank", (2, 2, 5, 6)), ("normals", (4, 8))):
    SR_BAD += [({_n: [1.0]}, TypeError, f"{_n} must be a torch.Tensor, got list"),
               ({_n: torch.zeros(_shape, dtype=I64)}, TypeError,
                f"{_n} must be a floating tensor (one of {FLOATS}), got torch.int64")]
for _n, _shape in (("k_bank", (2, 2, 5, 8)), ("v_bank", (2, 2, 5, 6)), ("normals", (4, 8))):
    SR_BAD += [({_n: torch.ones(_shape, device="meta")}, ValueError,
                f"{_n} is on meta but q is on cpu; put all inputs on one device")]
for _n, _shape in (("k_bank", (2, 2, 5, 8)), ("v_bank", (2, 2, 5, 6))):
    SR_BAD += [({_n: torch.zeros(_shape).requires_grad_(True)}, ValueError,
                f"{_n} requires grad, but the STAIR bank is detached by design and gets no gradient; "
                f"pass {_n}.detach()")]
_S = _stair()
for _n, _idx in (("q", (1, 3, 2, 7)), ("k_bank", (0, 1, 4, 0)), ("v_bank", (1, 0, 0, 5))):
    SR_BAD += [({_n: _nan_at(_S[_n], _idx), "debug": True}, ValueError,
         f"{_n} contains NaN or inf values (debug=True)")]
# the normals are checked for NaN/inf on CPU always (like their length: (Hq, D) is tiny), naming the head
for _debug in (True, False):
    SR_BAD += [({"normals": _nan_at(_S["normals"], (3, 3)), "debug": _debug}, ValueError,
                "normals[3] (query head 3) contains NaN or inf values: a reflection normal must be finite")]
# wrong types of scalar and flag arguments: a string or a bool is never read as a number, a string never as a bool
SR_BAD += [({"eps": "0.1"}, TypeError, "eps must be a float, got str '0.1'"),
           ({"eps": True}, TypeError, "eps must be a float, got bool True"),
           ({"scale": "1"}, TypeError, "scale must be a float, got str '1'"),
           ({"debug": "yes"}, TypeError, "debug must be True or False, got 'yes'")]


@pytest.mark.parametrize("over,exc,message", SR_BAD)
def test_stair_readout_bad_arguments(over, exc, message):
    raises_exactly(exc, message, _sr, **over)


def test_stair_readout_boundaries_that_do_not_raise():
    base = _sr(backend="reference")
    # bank_lengths at both ends of [0, M]; eps = 0 and just below 1; the default scale is D ** -0.5
    out = _sr(bank_lengths=torch.tensor([0, 5]), backend="reference")
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1], base[1])
    _sr(eps=0.999, backend="reference")
    torch.testing.assert_close(_sr(scale=8 ** -0.5, backend="reference"), base)
    assert not torch.allclose(_sr(scale=1.0, backend="reference"), base)
    # NaN without debug is not looked at; NaN past bank_lengths with debug is padding, not an error
    a = _stair()
    _sr(q=_nan_at(a["q"], (0, 0, 0, 0)), backend="reference")
    lens = torch.tensor([3, 5])
    out = _sr(k_bank=_nan_at(a["k_bank"], (0, 1, 4, 0)), v_bank=_nan_at(a["v_bank"], (0, 0, 3, 1)), bank_lengths=lens,
              debug=True, backend="reference")
    torch.testing.assert_close(out, _sr(bank_lengths=lens, backend="reference"))
    # Hq = Hkv = 0 is a zero-size call, not a "multiple of Hkv" error
    out = stair_readout(torch.zeros(2, 0, 3, 8), torch.zeros(2, 0, 5, 8), torch.zeros(2, 0, 5, 6), torch.zeros(0, 8))
    assert out.shape == (2, 0, 3, 6)


# ---------------------------------------------------------------- topk_entropy / topk_entropy_from_hidden
LOGITS = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(2))
MASK = torch.tensor([[True, False, True], [False, False, True]])

TE_BAD = [
    (([1.0],), {}, TypeError, "logits must be a torch.Tensor, got list"),
    ((LOGITS.long(),), {}, TypeError, f"logits must have a floating dtype (one of {FLOATS}), got torch.int64"),
    ((torch.tensor(1.0),), {}, ValueError, "logits must have shape (..., V), got a scalar"),
    ((LOGITS, 4.0), {}, TypeError, "k must be a Python int, got float"),
    ((LOGITS, True), {}, TypeError, "k must be a Python int, got bool"),
    ((LOGITS, 1), {}, ValueError, "k must be >= 2 (the entropy is divided by log k, and log 1 = 0), got 1"),
    ((LOGITS, 11), {}, ValueError,
     "k=11 is larger than the vocabulary size 10; pass k <= 10 (treadle does not clamp k: "
     "that would change the log k normaliser)"),
    ((LOGITS, 4), {"reduction": "sum"}, ValueError, "reduction must be 'mean' or 'none', got 'sum'"),
    ((LOGITS, 4, MASK), {"reduction": "none"}, ValueError,
     "mask applies to reduction='mean' only; with reduction='none' index the result instead"),
    ((LOGITS, 4, [True]), {}, TypeError, "mask must be a torch.Tensor of dtype bool, got list"),
    ((LOGITS, 4, MASK.long()), {}, TypeError,
     "mask must have dtype torch.bool (True at response positions), got torch.int64"),
    ((LOGITS, 4, MASK.reshape(6)), {}, ValueError, "mask must have shape (2, 3) (the positions), got (6,)"),
    ((LOGITS, 4, MASK.to("meta")), {}, ValueError, "mask is on meta but the logits/hidden states are on cpu"),
    ((LOGITS, 4, torch.zeros(2, 3, dtype=torch.bool)), {}, ValueError,
     "mask has no True (response) positions: the mean top-k entropy over them is undefined"),
    ((torch.zeros(0, 10), 4), {}, ValueError, "logits has no positions (shape (0, 10)): the mean is undefined"),
]


@pytest.mark.parametrize("args,kwargs,exc,message", TE_BAD)
def test_topk_entropy_bad_arguments(args, kwargs, exc, message):
    raises_exactly(exc, message, topk_entropy, *args, **kwargs)


HIDDEN, HEAD = LOGITS[..., :4].contiguous(), torch.randn(10, 4, generator=torch.Generator().manual_seed(3))

TEH_BAD = [
    (([1.0], HEAD), {}, TypeError, "hidden must be a torch.Tensor, got list"),
    ((HIDDEN, [1.0]), {}, TypeError, "lm_head_weight must be a torch.Tensor, got list"),
    ((HIDDEN.long(), HEAD), {}, TypeError, f"hidden must have a floating dtype (one of {FLOATS}), got torch.int64"),
    ((HIDDEN, HEAD.double()), {}, TypeError,
     "lm_head_weight must have hidden's dtype torch.float32, got torch.float64"),
    ((torch.tensor(1.0), HEAD), {}, ValueError, "hidden must have shape (..., d), got a scalar"),
    ((HIDDEN, HEAD[:, :3]), {}, ValueError, "lm_head_weight must have shape (V, d=4), got (10, 3)"),
    ((HIDDEN, HEAD.reshape(40)), {}, ValueError, "lm_head_weight must have shape (V, d=4), got (40,)"),
    ((HIDDEN, HEAD.to("meta")), {}, ValueError, "lm_head_weight is on meta but hidden is on cpu"),
    ((HIDDEN, HEAD, 11), {}, ValueError, "k=11 is larger than the vocabulary size 10; pass k <= 10 (treadle does not "
     "clamp k: that would change the log k normaliser)"),
    ((HIDDEN, HEAD, 1), {}, ValueError, "k must be >= 2 (the entropy is divided by log k, and log 1 = 0), got 1"),
    ((HIDDEN, HEAD, 4), {"chunk_size": 0}, ValueError, "chunk_size must be a positive int, got 0"),
    ((HIDDEN, HEAD, 4), {"chunk_size": True}, ValueError, "chunk_size must be a positive int, got True"),
    ((HIDDEN, HEAD, 4), {"chunk_size": 1.5}, ValueError, "chunk_size must be a positive int, got 1.5"),
    ((HIDDEN, HEAD, 4, MASK[0]), {}, ValueError, "mask must have shape (2, 3) (the positions), got (3,)"),
    ((HIDDEN, HEAD, 4, ~MASK & MASK), {}, ValueError,
     "mask has no True (response) positions: the mean top-k entropy over them is undefined"),
    ((torch.zeros(0, 4), HEAD, 4), {}, ValueError, "hidden has no positions (shape (0, 4)): the mean is undefined"),
]


@pytest.mark.parametrize("args,kwargs,exc,message", TEH_BAD)
def test_topk_entropy_from_hidden_bad_arguments(args, kwargs, exc, message):
    raises_exactly(exc, message, topk_entropy_from_hidden, *args, **kwargs)


def test_topk_entropy_boundaries_that_do_not_raise():
    # k = 2 and k = V are allowed; k = V on a uniform row is entropy exactly log V / log V = 1
    assert topk_entropy(torch.zeros(3, 10), 10).item() == pytest.approx(1.0, abs=1e-6)
    assert topk_entropy(torch.zeros(3, 10), 2).item() == pytest.approx(1.0, abs=1e-6)
    # reduction="none" on zero positions is an empty result, not an error
    assert topk_entropy(torch.zeros(0, 10), 4, reduction="none").shape == (0,)
    # the masked mean: rows outside the mask are never read
    h = topk_entropy(LOGITS, 4, reduction="none")
    assert topk_entropy(LOGITS, 4, MASK).item() == pytest.approx(h[MASK].mean().item(), rel=1e-6)
    z = HIDDEN @ HEAD.t()
    for chunk in (None, 1, 2, 6, 100):
        got = topk_entropy_from_hidden(HIDDEN, HEAD, 4, MASK, chunk_size=chunk)
        assert got.item() == pytest.approx(topk_entropy(z, 4, MASK).item(), rel=1e-6)
    assert topk_entropy_from_hidden(HIDDEN, HEAD, 10).item() == pytest.approx(topk_entropy(z, 10).item(), rel=1e-6)


@pytest.mark.parametrize("op", ["grpo_advantages", "stair_readout", "gated_lora_linear"])
def test_an_unknown_backend_name_is_a_value_error(op):
    """``backend="nope"`` is a bad argument value (ValueError, naming the choices), and still a
    BackendUnavailableError for code that catches that; a known backend that cannot run stays a plain one."""
    from treadle.dispatch import BACKENDS, BackendUnavailableError, UnknownBackendError

    call = {"grpo_advantages": lambda b: grpo_advantages(R3, G3, backend=b),
            "stair_readout": lambda b: _sr(backend=b),
            "gated_lora_linear": lambda b: _gll(backend=b)}[op]
    with pytest.raises(ValueError) as info:
        call("nope")
    assert type(info.value) is UnknownBackendError and isinstance(info.value, BackendUnavailableError)
    assert str(info.value) == f"backend 'nope' cannot run {op} on cpu: unknown backend 'nope'; expected one of {BACKENDS}"
    with pytest.raises(BackendUnavailableError) as info:
        call("cuda")  # a real backend, not for CPU tensors: not a ValueError
    assert not isinstance(info.value, ValueError)


def test_grpo_scale_rewards_takes_trls_booleans():
    """The README lists TRL's ``scale_rewards=True / False`` among grpo_advantages' options: True is
    "group", False is "none" (TRL's reading); they were refused with a ValueError."""
    r, g = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5]), torch.tensor([17, 4, 17, 4, 99])
    assert torch.equal(grpo_advantages(r, g, scale_rewards=True), grpo_advantages(r, g, scale_rewards="group"))
    assert grpo_advantages(r, g, scale_rewards=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0]
    raises_exactly(ValueError, "scale_rewards applies to estimator='grpo' only, got estimator='rloo'",
                   grpo_advantages, r, g, estimator="rloo", scale_rewards=False)
    raises_exactly(ValueError, "scale_rewards must be one of ('group', 'batch', 'none'), got 1",
                   grpo_advantages, r, g, scale_rewards=1)

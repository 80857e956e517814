"""The fused GEMM path of ``gated_lora_linear`` on the Triton backend (triton_kernels/scale_gemm.py)
against the float64 reference: outputs and gradients, shapes that leave partial tiles, several
work items per row block, the persistent loop, the LoRA-off base GEMM, and the fallback."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from treadle.ops import gated_lora_linear
from treadle.reference.scale import gated_lora_reference
from treadle.testing import assert_close_verbose, assert_within_rule

pytestmark = pytest.mark.triton
GATE = dict(scaling=2.0, L=-2.0, U=3.0, tau=0.7)
sf = pytest.importorskip("treadle.triton_kernels.scale_fused")
gl = importlib.import_module("treadle.ops.gated_lora")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(lead, d_in, d_out, r, *, bias=True, gate_scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=g, dtype=torch.float64)
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5
    A = torch.randn(r, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5
    B = torch.randn(d_out, r, generator=g, dtype=torch.float64) / r ** 0.5
    w = gate_scale * torch.randn(d_in, generator=g, dtype=torch.float64) / d_in ** 0.5
    b = torch.tensor([0.1], dtype=torch.float64)
    bias_t = torch.randn(d_out, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(*lead, d_out, generator=g, dtype=torch.float64)
    return x, W, A, B, w, b, bias_t, dy


def _run(fn, dtype, x, W, A, B, w, b, bias, dy, gate_dtype=None):
    gd = gate_dtype or dtype
    xx = x.to(dtype).clone().requires_grad_()
    ww = w.to(gd).clone().requires_grad_()
    bb = b.to(gd).clone().requires_grad_()
    bias_d = None if bias is None else bias.to(dtype)
    if fn is None:
        y = gated_lora_reference(xx, torch.nn.functional.linear(xx, W.to(dtype), bias_d), A.to(dtype),
                                 B.to(dtype), ww, bb, **GATE)
    else:
        y = fn(xx, W.to(dtype), bias_d, A.to(dtype), B.to(dtype), ww, bb, **GATE, backend="triton")
    y.backward(dy.to(dtype))
    return [y.detach(), xx.grad, torch.cat([ww.grad.double(), bb.grad.double()])]


SHAPES = [  # (lead, d_in, d_out, r): aligned rows, partial tiles, several runs per row block
    ((37,), 72, 104, 5),
    ((2, 25), 64, 136, 16),    # r + 3 > 16: padded rank 32
    ((3,), 8, 8, 1),           # everything smaller than a tile
    ((19,), 96, 40, 30),       # padded rank 32, K over several tiles
    ((5,), 48, 24, 32),        # the largest rank the fused path takes (padded rank 64 forward)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}->{s[2]}r{s[3]}")
def test_fused_linear_matches_reference_rule(dtype, shape):
    lead, d_in, d_out, r = shape
    x, W, A, B, w, b, bias, dy = _inputs(lead, d_in, d_out, r, bias=r % 2 == 1)
    assert sf.applies(x.to(dtype), W.to(dtype), r)
    ref = _run(None, torch.float64, x, W, A, B, w, b, bias, dy)
    plain = _run(None, dtype, x, W, A, B, w, b, bias, dy)
    got = _run(gated_lora_linear, dtype, x, W, A, B, w, b, bias, dy)
    assert got[0].dtype == dtype and got[0].shape == (*lead, d_out) and got[1].dtype == dtype
    for name, k, p, e, factor in zip(("y", "dx", "d gate"), got, plain, ref, (2, 3, 3)):
        assert_within_rule(k, p, e, factor=factor, floor=1e-6 * float(e.abs().max()), name=f"fused/{name}")


def test_fused_float32_gate_on_bfloat16_keeps_the_gate_precise():
    """A float32 gate on bf16 x: the logit comes from w's high and low bf16 halves, so lambda is as
    close to the float64 one as a float32 gate on the bf16-rounded x gives (not bf16-rounded w)."""
    x, W, A, B, w, b, bias, dy = _inputs((64,), 256, 64, 16, gate_scale=20.0)
    xb = x.bfloat16()
    _, lam = gated_lora_linear(xb, W.bfloat16(), None, A.bfloat16(), B.bfloat16(), w.float(), b.float(), **GATE,
                               return_lambda=True, backend="triton")
    _, lam_ref = gated_lora_reference(xb.double(), xb.double() @ W.t(), A, B, w, b, **GATE, return_lambda=True)
    assert_close_verbose(lam.double(), lam_ref, atol=2e-4, rtol=2e-4, name="lambda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_loop_equals_one_program_per_item(dtype):
    """The GPU's persistent loop (a few programs striding over the work items, each running its run
    of output tiles to the end, also as one flattened (tile, k) loop) gives exactly what one program
    per item gives."""
    x, W, A, B, w, b, bias, dy = _inputs((45,), 72, 168, 7)
    args = [t.to(dtype) for t in (x, W, bias, A, B)] + [w.float(), b.float()]
    xs, Ws, bs, As, Bs, ws, bbs = args
    flat = dataclasses.replace(sf.INTERP_CONFIG, flat=True)
    one = sf.linear_fwd(xs, Ws, bs, As, Bs, ws, bbs, *GATE.values())
    for programs, cfg in ((1, None), (3, None), (7, None), (3, flat), (5, flat)):
        many = sf.linear_fwd(xs, Ws, bs, As, Bs, ws, bbs, *GATE.values(), programs=programs, config=cfg)
        for a, c in zip(one, many):
            assert torch.equal(a, c)
    y, z, v = one
    d1 = sf.linear_dx(dy.to(dtype), xs, Ws, As, Bs, z, v, *GATE.values(), True)
    for cfg in (None, flat):
        d3 = sf.linear_dx(dy.to(dtype), xs, Ws, As, Bs, z, v, *GATE.values(), True, programs=3, config=cfg)
        for a, c in zip(d1, d3):
            assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_base_gemm_with_the_lora_off(dtype, with_bias):
    x, W, *_, bias, _ = _inputs((2, 21), 72, 104, 4)
    bias = bias if with_bias else None
    got = gl.triton_base_linear(x.to(dtype), W.to(dtype), None if bias is None else bias.to(dtype))
    ref = torch.nn.functional.linear(x, W, bias)
    plain = torch.nn.functional.linear(x.to(dtype), W.to(dtype), None if bias is None else bias.to(dtype))
    assert got.shape == (2, 21, 104) and got.dtype == dtype and not got.requires_grad
    assert_within_rule(got, plain, ref, factor=2, floor=1e-6 * float(ref.abs().max()), name="base gemm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_gemm_with_the_lora_off(dtype):
    """The dx kernel with the LoRA off is ``dy W``: the yardstick of the fused backward's GEMM."""
    x, W, *_, dy = _inputs((37,), 72, 104, 4)
    got = sf.base_dx(dy.to(dtype), W.to(dtype))
    ref = dy.double() @ W.double()
    plain = dy.to(dtype) @ W.to(dtype)
    assert got.shape == (37, 72)
    assert_within_rule(got.to(dtype), plain, ref, factor=2, floor=1e-6 * float(ref.abs().max()), name="base dx")


def test_base_gemm_refuses_what_it_cannot_take():
    x, W = torch.randn(4, 60), torch.randn(16, 60)
    with pytest.raises(ValueError, match="cannot take"):
        gl.triton_base_linear(x.double(), W.double())
    with pytest.raises(ValueError, match="cannot take"):
        gl.triton_base_linear(x[:, :59].contiguous(), W[:, :59].contiguous())
    with pytest.raises(ValueError, match="weight must have shape"):
        gl.triton_base_linear(x[:, :56], W)
    with pytest.raises(TypeError, match="x's dtype"):
        gl.triton_base_linear(x, W.half())


def test_zero_gate_is_exactly_lambda_one_on_the_fused_path():
    x, W, A, B, w, b, bias, dy = _inputs((33,), 64, 48, 8)
    xx = x.float().requires_grad_()
    zw = torch.zeros(64, requires_grad=True)
    zb = torch.zeros(1, requires_grad=True)
    y, lam = gated_lora_linear(xx, W.float(), None, A.float(), B.float(), zw, zb, **GATE, return_lambda=True,
                               backend="triton")
    assert torch.equal(lam, torch.ones_like(lam))
    y.backward(dy.float())
    ref = _run(None, torch.float64, x, W, A, B, torch.zeros(64, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
               None, dy)
    # at v = 0 the slope is the midpoint (U - L) / 2: zero-initialised gates get a gradient
    assert_close_verbose(zw.grad.double(), ref[2][:-1], atol=1e-3, rtol=1e-4, name="dw at v = 0")


def test_gate_only_gradient_and_frozen_weights():
    """x not requiring grad (only the gate learns): no dx is formed, the gate's gradients still match;
    W, bias, A and B get no gradient."""
    x, W, A, B, w, b, bias, dy = _inputs((29,), 64, 40, 4)
    Wf, biasf, Af, Bf = W.float(), bias.float(), A.float(), B.float()
    ww = w.float().requires_grad_()
    bb = b.float().requires_grad_()
    y = gated_lora_linear(x.float(), Wf, biasf, Af, Bf, ww, bb, **GATE, backend="triton")
    y.backward(dy.float())
    ref = _run(None, torch.float64, x, W, A, B, w, b, bias, dy)
    assert_close_verbose(torch.cat([ww.grad, bb.grad]).double(), ref[2], atol=1e-4, rtol=1e-4, name="d gate")
    assert all(t.grad is None for t in (Wf, biasf, Af, Bf))


@pytest.mark.parametrize("d_in,r", [(59, 4), (64, 33)])
def test_what_the_fused_gemm_cannot_take_falls_back_and_matches(d_in, r):
    """d_in = 59 cannot be a TMA row, r = 33 is over the fused path's rank: the op runs the base GEMM
    and the unfused kernels instead."""
    x, W, A, B, w, b, bias, dy = _inputs((11,), d_in, 40, r)
    assert not sf.applies(x.float(), W.float(), r)
    got = _run(gated_lora_linear, torch.float32, x, W, A, B, w, b, bias, dy)
    ref = _run(None, torch.float64, x, W, A, B, w, b, bias, dy)
    for name, k, e in zip(("y", "dx", "d gate"), got, ref):
        assert_close_verbose(k.double(), e, atol=1e-4, rtol=1e-4, name=name)


def test_torch_compile_runs_the_fused_path():
    x, W, A, B, w, b, bias, dy = _inputs((2, 9), 32, 24, 4)
    x, W, A, B, bias = x.float(), W.float(), A.float(), B.float(), bias.float()
    wp = w.float().requires_grad_()
    bp = b.float().requires_grad_()

    def f(x, w, b):
        return gated_lora_linear(x, W, bias, A, B, w, b, **GATE, backend="triton").square().mean()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(x, wp, bp)
    loss.backward()
    g = (wp.grad.clone(), bp.grad.clone())
    wp.grad = bp.grad = None
    expect = f(x, wp, bp)
    expect.backward()
    assert_close_verbose(loss, expect, atol=1e-6, rtol=1e-6, name="loss")
    assert_close_verbose(g[0], wp.grad, atol=1e-6, rtol=1e-5, name="dw")
    assert_close_verbose(g[1], bp.grad, atol=1e-6, rtol=1e-5, name="db")


def test_aot_specs_cover_the_pinned_configs():
    """Every config the fused op launches on a GPU is in ``aot_specs`` (the sm_90a structure check),
    with the signature the JIT gives it: the fused GEMMs' shape arguments are never specialised (one
    compile, and so one AOT result, for every shape), so they are not marked divisible."""
    from treadle.triton_kernels import scale_gemm as sg
    from treadle.triton_kernels.scale import aot_specs

    specs = aot_specs()
    labels = {(s.kernel, s.config) for s in specs}
    assert ("scale_gemm_fwd", sf.FWD_CONFIG.label) in labels
    assert ("scale_gemm_dx", sf.DX_CONFIG.label) in labels
    assert any(k == "scale_base_gemm" for k, _ in labels)
    for s in specs:
        names = s.fn.arg_names
        assert list(s.signature) == names, s.kernel
        assert set(s.constexprs) <= set(names) and set(s.divisible_by_16) <= set(names)
        assert all(s.signature[k] == "constexpr" for k in s.constexprs), s.kernel
        if s.kernel.startswith("scale_gemm") or s.kernel == "scale_base_gemm":
            unspecialised = set(sg.SHAPE_ARGS)
            assert {"M", "N", "K", "R"} <= unspecialised
            assert not unspecialised & set(s.divisible_by_16), s.kernel
            assert all(s.signature[k] == "i32" for k in unspecialised), s.kernel
            assert s.expect_wgmma and s.expect_tma
            assert s.constexprs["PERSISTENT"] and not s.constexprs["UPCAST"]

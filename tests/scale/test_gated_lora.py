"""treadle.ops.gated_lora against the float64 reference (outputs and gradients), on every backend."""
from __future__ import annotations

import pytest
import torch

from treadle import _extension
from treadle.ops.gated_lora import gated_lora
from treadle.reference.scale import gate_lambda_reference, gated_lora_reference
from treadle.testing import assert_close_verbose, assert_within_rule, require_backend, skip_or_fail

BACKENDS = [
    "reference",
    pytest.param("cpp", marks=require_backend("gated_lora", "cpp")),  # skips locally, fails under CI
    "triton",
]
GATE = dict(scaling=2.0, L=-2.0, U=3.0, tau=0.7)


def _inputs(lead, d_in, d_out, r, *, gate_scale=1.0, seed=0):
    """float64 inputs: x (*lead, d_in), W (d_out, d_in), A, B, w, b; gates large enough that lambda
    covers reverse (< 0), suppress (0..1) and extrapolate (> 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=g, dtype=torch.float64)
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5
    A = torch.randn(r, d_in, generator=g, dtype=torch.float64) / d_in ** 0.5
    B = torch.randn(d_out, r, generator=g, dtype=torch.float64) / r ** 0.5
    w = gate_scale * torch.randn(d_in, generator=g, dtype=torch.float64) / d_in ** 0.5
    b = torch.tensor([0.1], dtype=torch.float64)
    return x, W, A, B, w, b


def _run(fn, dtype, x, W, A, B, w, b, dy, **kw):
    """y and the grads of (x, w, b) in ``dtype``; base_out = x W^T built inside the graph."""
    xx = x.to(dtype).clone().requires_grad_()
    ww = w.to(dtype).clone().requires_grad_()
    bb = b.to(dtype).clone().requires_grad_()
    base = xx @ W.to(dtype).t()
    y = fn(xx, base, A.to(dtype), B.to(dtype), ww, bb, **GATE, **kw)
    y.backward(dy.to(dtype))
    return y.detach(), xx.grad, ww.grad, bb.grad


SHAPES = [  # (lead, d_in, d_out, r)
    ((37,), 59, 111, 5),        # odd everything
    ((1,), 33, 17, 16),         # a single token
    ((2, 9), 48, 40, 8),        # 3-D input
    ((3, 5, 7), 23, 70, 3),     # 4-D input, rank not a power of 2
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}->{s[2]}r{s[3]}")
def test_matches_reference_rule(backend, dtype, shape):
    lead, d_in, d_out, r = shape
    x, W, A, B, w, b = _inputs(lead, d_in, d_out, r)
    dy = torch.randn(*lead, d_out, dtype=torch.float64)
    ref = _run(gated_lora_reference, torch.float64, x, W, A, B, w, b, dy)
    plain = _run(gated_lora_reference, dtype, x, W, A, B, w, b, dy)
    got = _run(gated_lora, dtype, x, W, A, B, w, b, dy, backend=backend)
    assert got[0].dtype == dtype and got[0].shape == (*lead, d_out)
    assert got[2].dtype == dtype and got[3].shape == (1,)
    _assert_rule(got, plain, ref, backend)


def _assert_rule(got, plain, ref, backend):
    """Tolerance rule on y, dx and the gate's gradient taken as one (d_in + 1)-vector [dw, db] (the bias
    is the weight of a constant input; a lone scalar would make the rule hinge on one rounding)."""
    got, plain, ref = ([t[0], t[1], torch.cat([t[2].double(), t[3].double()])] for t in (got, plain, ref))
    for name, k, p, e, factor in zip(("y", "dx", "d gate"), got, plain, ref, (2, 3, 3)):
        assert_within_rule(k, p, e, factor=factor, floor=1e-6 * float(e.abs().max()), name=f"{backend}/{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_matches_reference(backend):
    x, W, A, B, w, b = _inputs((2, 13), 59, 37, 7)
    dy = torch.randn(2, 13, 37, dtype=torch.float64)
    ref = _run(gated_lora_reference, torch.float64, x, W, A, B, w, b, dy)
    got = _run(gated_lora, torch.float64, x, W, A, B, w, b, dy, backend=backend)
    for name, k, e in zip(("y", "dx", "dw", "db"), got, ref):
        assert_close_verbose(k, e, atol=1e-10, rtol=1e-10, name=f"{backend}/{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lambda_covers_all_regimes_and_matches(backend):
    x, W, A, B, w, b = _inputs((200,), 32, 24, 4, gate_scale=6.0)
    y, lam = gated_lora(x.float(), (x @ W.t()).float(), A.float(), B.float(), w.float(), b.float(), **GATE,
                        return_lambda=True, backend=backend)
    v = torch.tanh(((x * w).sum(-1) + b) / GATE["tau"])
    expect = gate_lambda_reference(v, GATE["L"], GATE["U"])
    assert lam.shape == (200,) and not lam.requires_grad
    assert_close_verbose(lam, expect, atol=1e-5, rtol=1e-5, name="lambda")
    # (L, U) in exact arithmetic; tanh saturates to +-1 in float32, so the float range is closed
    assert bool((lam >= GATE["L"]).all()) and bool((lam <= GATE["U"]).all())
    assert bool((lam < 0).any()) and bool(((lam > 0) & (lam < 1)).any()) and bool((lam > 1).any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_inputs(backend):
    x, W, A, B, w, b = _inputs((11, 6), 29, 19, 4)
    xt = x.float().transpose(0, 1)  # (6, 11, 29) non-contiguous
    base = (xt @ W.float().t())
    got = gated_lora(xt, base, A.float(), B.float(), w.float(), b.float(), **GATE, backend=backend)
    exp = gated_lora_reference(xt.double(), base.double(), A, B, w, b, **GATE)
    assert_close_verbose(got, exp, atol=1e-4, rtol=1e-4, name="y")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x = torch.empty(0, 7, 16)
    base = torch.empty(0, 7, 12, requires_grad=True)
    w = torch.zeros(16, requires_grad=True)
    y, lam = gated_lora(x, base, torch.randn(4, 16), torch.randn(12, 4), w, torch.zeros(1), **GATE,
                        return_lambda=True, backend=backend)
    assert y.shape == (0, 7, 12) and lam.shape == (0, 7)
    y.sum().backward()
    assert base.grad.shape == base.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_gate_is_exactly_stage_one_lora(backend):
    """Zero gates: lambda == 1 exactly, output == PEFT's LoRA Linear output, and gates still get a gradient."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(45, 30))
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["0"], lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    layer = pm.base_model.model[0]
    x = torch.randn(3, 10, 45)
    with torch.no_grad():
        expected = pm(x)
    w = torch.zeros(45, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    A = layer.lora_A["default"].weight.detach()
    B = layer.lora_B["default"].weight.detach()
    y, lam = gated_lora(x, layer.base_layer(x), A, B, w, b, scaling=layer.scaling["default"], L=-4.0, U=4.0,
                        tau=1.0, return_lambda=True, backend=backend)
    assert torch.equal(lam, torch.ones_like(lam))
    assert_close_verbose(y, expected, atol=1e-6, rtol=1e-6, name="y vs PEFT")
    y.square().sum().backward()
    # at v = 0 the slope is the midpoint (U - L) / 2 = 4, so zero-initialised gates can learn
    assert float(w.grad.abs().sum()) > 0 and float(b.grad.abs()) > 0


def test_zero_gate_slope_is_midpoint():
    x, W, A, B, w, b = _inputs((9,), 16, 8, 4)
    dy = torch.randn(9, 8, dtype=torch.float64)
    zw, zb = torch.zeros_like(w), torch.zeros_like(b)
    ref = _run(gated_lora_reference, torch.float64, x, W, A, B, zw, zb, dy)
    for backend in ("reference", "triton") + (("cpp",) if _extension.has_kernel("gated_lora", "CPU") else ()):
        got = _run(gated_lora, torch.float64, x, W, A, B, zw, zb, dy, backend=backend)
        assert_close_verbose(got[2], ref[2], atol=1e-10, rtol=1e-10, name=f"{backend}/dw at v=0")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_gates_with_bfloat16_activations(backend):
    x, W, A, B, w, b = _inputs((21,), 40, 24, 4)
    xb = x.bfloat16().requires_grad_()
    wf = w.float().requires_grad_()
    bf = b.float().requires_grad_()
    y = gated_lora(xb, xb @ W.bfloat16().t(), A.bfloat16(), B.bfloat16(), wf, bf, **GATE, backend=backend)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert wf.grad.dtype == torch.float32 and bf.grad.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_gradient_for_frozen_lora_weights_or_gate_input(backend):
    x, W, A, B, w, b = _inputs((5,), 12, 10, 2)
    x = x.float().requires_grad_()
    A, B = A.float(), B.float()
    y = gated_lora(x, torch.zeros(5, 10), A, B, w.float(), b.float(), **GATE, backend=backend)
    (dx,) = torch.autograd.grad(y.sum(), x)
    # base_out does not depend on x here, gates do not require grad: dx is exactly the LoRA path with
    # lambda held fixed (stop-gradient on the gate input)
    lam = gated_lora(x.detach(), torch.zeros(5, 10), A, B, w.float(), b.float(), **GATE, return_lambda=True,
                     backend=backend)[1]
    expect = (GATE["scaling"] * lam[:, None] * (torch.ones(5, 10) @ B)) @ A
    assert_close_verbose(dx, expect, atol=1e-5, rtol=1e-5, name="dx")
    assert A.grad is None and B.grad is None


def test_bad_input_raises_before_work():
    x = torch.randn(4, 8)
    base = torch.randn(4, 6)
    A, B, w, b = torch.randn(2, 8), torch.randn(6, 2), torch.randn(8), torch.zeros(1)
    before = [t.clone() for t in (x, base, A, B, w, b)]
    ok = dict(scaling=1.0, L=-1.0, U=2.0, tau=1.0)
    cases = [
        (dict(ok, L=0.0), ValueError, "L must be"),
        (dict(ok, L=0.5), ValueError, "L must be"),
        (dict(ok, U=1.0), ValueError, "U must be"),
        (dict(ok, tau=0.0), ValueError, "tau must be"),
        (dict(ok, tau=-1.0), ValueError, "tau must be"),
        (dict(ok, tau=float("nan")), ValueError, "tau must be"),
        (dict(ok, scaling="1"), TypeError, "scaling"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            gated_lora(x, base, A, B, w, b, **kw)
    with pytest.raises(ValueError, match="base_out must have shape"):
        gated_lora(x, torch.randn(3, 6), A, B, w, b, **ok)
    with pytest.raises(ValueError, match="lora_A must have shape"):
        gated_lora(x, base, torch.randn(2, 7), B, w, b, **ok)
    with pytest.raises(ValueError, match="lora_B must have shape"):
        gated_lora(x, base, A, torch.randn(6, 3), w, b, **ok)
    with pytest.raises(ValueError, match="gate_weight must have shape"):
        gated_lora(x, base, A, B, torch.randn(7), b, **ok)
    with pytest.raises(ValueError, match="gate_bias must have shape"):
        gated_lora(x, base, A, B, w, torch.zeros(2), **ok)
    with pytest.raises(TypeError, match="base_out must have x's dtype"):
        gated_lora(x, base.double(), A, B, w, b, **ok)
    with pytest.raises(TypeError, match="gate_weight must have x's dtype"):
        gated_lora(x, base, A, B, w.double(), b, **ok)
    with pytest.raises(TypeError, match="floating dtype"):
        gated_lora(x.long(), base, A, B, w, b, **ok)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        gated_lora(x.numpy(), base, A, B, w, b, **ok)
    with pytest.raises(ValueError, match="lora_A requires grad"):
        gated_lora(x, base, A.clone().requires_grad_(), B, w, b, **ok)
    for t, orig in zip((x, base, A, B, w, b), before):
        assert torch.equal(t, orig)


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
def test_opcheck(backend):
    if backend == "cpp" and not _extension.has_kernel("gated_lora", "CPU"):
        skip_or_fail("treadle._C built without gated_lora")
    x = torch.randn(6, 16, requires_grad=True)
    base = torch.randn(6, 12, requires_grad=True)
    args = (x, base, torch.randn(4, 16), torch.randn(12, 4), torch.randn(16, requires_grad=True),
            torch.zeros(1, requires_grad=True), 1.5, -1.0, 2.0, 0.5, backend)
    torch.library.opcheck(torch.ops.treadle.gated_lora_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_torch_compile_runs():
    x, W, A, B, w, b = _inputs((2, 7), 24, 16, 4)
    x, W, A, B = x.float(), W.float(), A.float(), B.float()
    wp = w.float().requires_grad_()
    bp = b.float().requires_grad_()

    def f(x, w, b):
        return gated_lora(x, x @ W.t(), A, B, w, b, **GATE).square().mean()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    loss = compiled(x, wp, bp)
    loss.backward()
    g_compiled = (wp.grad.clone(), bp.grad.clone())
    wp.grad = bp.grad = None
    f(x, wp, bp).backward()
    assert_close_verbose(loss, f(x, wp, bp), atol=1e-6, rtol=1e-6, name="loss")
    assert_close_verbose(g_compiled[0], wp.grad, atol=1e-6, rtol=1e-5, name="dw")
    assert_close_verbose(g_compiled[1], bp.grad, atol=1e-6, rtol=1e-5, name="db")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches_reference(dtype):
    """GPU check (bench/gpu_check.sh): the compiled Triton kernels on CUDA, outputs and grads."""
    x, W, A, B, w, b = _inputs((3, 67), 200, 136, 16)
    dy = torch.randn(3, 67, 136, dtype=torch.float64)
    ref = _run(gated_lora_reference, torch.float64, x, W, A, B, w, b, dy)
    dev = [t.cuda() for t in (x, W, A, B, w, b, dy)]
    plain = _run(gated_lora_reference, dtype, *dev)
    got = _run(gated_lora, dtype, *dev, backend="triton")
    _assert_rule(got, plain, ref, "cuda/triton")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [((3, 67), 256, 136, 16, True), ((2048,), 512, 384, 16, False),
                                   ((300,), 1024, 520, 5, True)], ids=lambda s: f"{s[0]}x{s[1]}->{s[2]}r{s[3]}")
def test_cuda_fused_gemm_matches_reference(dtype, shape):
    """GPU check (bench/gpu_check.sh): ``gated_lora_linear`` as one persistent TMA GEMM per direction
    (the LoRA shrink on the base GEMM's x tiles, the gated expand in each epilogue), outputs and
    grads; and the same GEMM with the LoRA off against ``F.linear``."""
    from treadle.ops import gated_lora_linear
    from treadle.ops.gated_lora import triton_base_linear
    from treadle.triton_kernels import scale_fused

    lead, d_in, d_out, r, with_bias = shape
    x, W, A, B, w, b = _inputs(lead, d_in, d_out, r, gate_scale=3.0)
    bias = torch.randn(d_out, dtype=torch.float64) if with_bias else None
    dy = torch.randn(*lead, d_out, dtype=torch.float64)
    ref = _run_linear(None, torch.float64, x, W, A, B, w, b, dy, bias)
    dev = [t.cuda() for t in (x, W, A, B, w, b, dy)] + [None if bias is None else bias.cuda()]
    assert scale_fused.applies(dev[0].to(dtype), dev[1].to(dtype), r)
    plain = _run_linear(None, dtype, *dev)
    got = _run_linear(gated_lora_linear, dtype, *dev, backend="triton")
    _assert_rule([t.cpu() for t in got], [t.cpu() for t in plain], ref, "cuda/fused")
    xb, Wb = dev[0].to(dtype), dev[1].to(dtype)
    bb = None if bias is None else dev[7].to(dtype)
    base = triton_base_linear(xb, Wb, bb)
    exp = torch.nn.functional.linear(x, W, bias)
    assert_within_rule(base.cpu(), torch.nn.functional.linear(xb, Wb, bb).cpu(), exp, factor=2,
                       floor=1e-6 * float(exp.abs().max()), name="cuda/base gemm")


# ---------------------------------------------------------------- gated_lora_linear (base linear fused in)
def _run_linear(fn, dtype, x, W, A, B, w, b, dy, bias=None, **kw):
    xx = x.to(dtype).clone().requires_grad_()
    ww = w.to(dtype).clone().requires_grad_()
    bb = b.to(dtype).clone().requires_grad_()
    bias_d = None if bias is None else bias.to(dtype)
    if fn is None:  # the spec: base linear, then the reference gated LoRA
        y = gated_lora_reference(xx, torch.nn.functional.linear(xx, W.to(dtype), bias_d), A.to(dtype), B.to(dtype),
                                 ww, bb, **GATE)
    else:
        y = fn(xx, W.to(dtype), bias_d, A.to(dtype), B.to(dtype), ww, bb, **GATE, **kw)
    y.backward(dy.to(dtype))
    return y.detach(), xx.grad, ww.grad, bb.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=lambda s: f"{s[0]}x{s[1]}->{s[2]}r{s[3]}")
def test_linear_matches_reference_rule(backend, dtype, with_bias, shape):
    from treadle.ops import gated_lora_linear

    lead, d_in, d_out, r = shape
    x, W, A, B, w, b = _inputs(lead, d_in, d_out, r)
    bias = torch.randn(d_out, dtype=torch.float64) if with_bias else None
    dy = torch.randn(*lead, d_out, dtype=torch.float64)
    ref = _run_linear(None, torch.float64, x, W, A, B, w, b, dy, bias)
    plain = _run_linear(None, dtype, x, W, A, B, w, b, dy, bias)
    got = _run_linear(gated_lora_linear, dtype, x, W, A, B, w, b, dy, bias, backend=backend)
    assert got[0].shape == (*lead, d_out) and got[0].dtype == dtype
    _assert_rule(got, plain, ref, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_float64_and_lambda(backend):
    from treadle.ops import gated_lora_linear

    x, W, A, B, w, b = _inputs((3, 8), 37, 29, 6)
    bias = torch.randn(29, dtype=torch.float64)
    dy = torch.randn(3, 8, 29, dtype=torch.float64)
    ref = _run_linear(None, torch.float64, x, W, A, B, w, b, dy, bias)
    got = _run_linear(gated_lora_linear, torch.float64, x, W, A, B, w, b, dy, bias, backend=backend)
    for name, k, e in zip(("y", "dx", "dw", "db"), got, ref):
        assert_close_verbose(k, e, atol=1e-10, rtol=1e-10, name=f"{backend}/{name}")
    _, lam = gated_lora_linear(x, W, bias, A, B, w, b, **GATE, return_lambda=True, backend=backend)
    _, lam_ref = gated_lora_reference(x, x @ W.t(), A, B, w, b, **GATE, return_lambda=True)
    assert_close_verbose(lam, lam_ref, atol=1e-12, rtol=1e-12, name="lambda")


def test_linear_bad_input():
    from treadle.ops import gated_lora_linear

    x, W, A, B, w, b = (t.float() for t in _inputs((4,), 8, 6, 2))
    ok = dict(scaling=1.0, L=-1.0, U=2.0, tau=1.0)
    with pytest.raises(ValueError, match="weight requires grad"):
        gated_lora_linear(x, W.clone().requires_grad_(), None, A, B, w, b, **ok)
    with pytest.raises(ValueError, match="bias requires grad"):
        gated_lora_linear(x, W, torch.zeros(6, requires_grad=True), A, B, w, b, **ok)
    with pytest.raises(ValueError, match="weight must have shape"):
        gated_lora_linear(x, W[:, :5], None, A, B, w, b, **ok)
    with pytest.raises(ValueError, match="bias must have shape"):
        gated_lora_linear(x, W, torch.zeros(5), A, B, w, b, **ok)
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        gated_lora_linear(x, W.double(), None, A, B, w, b, **ok)
    with pytest.raises(ValueError, match="U must be"):
        gated_lora_linear(x, W, None, A, B, w, b, **dict(ok, U=0.5))
    y = gated_lora_linear(torch.empty(0, 8), W, None, A, B, w, b, **ok)
    assert y.shape == (0, 6)


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
def test_linear_opcheck(backend):
    if backend == "cpp" and not _extension.has_kernel("gated_lora_linear", "CPU"):
        skip_or_fail("treadle._C built without gated_lora_linear")
    x = torch.randn(2, 3, 16, requires_grad=True)
    args = (x, torch.randn(12, 16), torch.randn(12), torch.randn(4, 16), torch.randn(12, 4),
            torch.randn(16, requires_grad=True), torch.zeros(1, requires_grad=True), 1.5, -1.0, 2.0, 0.5, backend)
    torch.library.opcheck(torch.ops.treadle.gated_lora_linear_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

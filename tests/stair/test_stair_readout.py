"""treadle.ops.stair_readout against its float64 reference (outputs and both gradients), every backend.

Backends: ``reference`` (autograd through the literal maths), ``cpp`` (treadle._C), ``triton`` (the
interpreter on CPU: shapes kept tiny). Tolerance rule (CONVENTIONS.md): kernel error vs the float64
reference <= 2x (outputs) / 3x (gradients) the error of plain PyTorch (the reference run in the
kernel's dtype), plus a small floor.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from treadle import _extension
from treadle.ops import stair_readout
from treadle.reference.stair import stair_readout_reference
from treadle.testing import assert_close_verbose, assert_within_rule, require_backend

needs_cpp = require_backend("stair_readout", "cpp")  # skips locally, fails under CI
BACKENDS = [pytest.param("cpp", marks=needs_cpp), "triton"]
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float64: 1e-12}


def _inputs(B, Hq, Hkv, T, M, D, Dv, *, kscale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, M, D, generator=gen, dtype=torch.float64) * kscale
    v = torch.randn(B, Hkv, M, Dv, generator=gen, dtype=torch.float64)
    n = torch.randn(Hq, D, generator=gen, dtype=torch.float64)
    g = torch.randn(B, Hq, T, Dv, generator=gen, dtype=torch.float64)
    return q, k, v, n, g


def _run(fn, q, k, v, n, g, dtype, device="cpu", **kw):
    """Output and grads (dq, dn) of ``fn`` evaluated in ``dtype`` on ``device`` (the loss is <out, g>)."""
    qq = q.detach().to(device, dtype).requires_grad_(True)
    nn_ = n.detach().to(device, dtype).requires_grad_(True)
    if kw.get("bank_lengths") is not None:
        kw["bank_lengths"] = kw["bank_lengths"].to(device)
    out = fn(qq, k.to(device, dtype), v.to(device, dtype), nn_, **kw)
    dq, dn = torch.autograd.grad(out, (qq, nn_), g.to(device, out.dtype), materialize_grads=True)
    return out, dq, dn


def _check(backend, dims, dtype=torch.float32, *, kscale=1.0, lengths=None, eps=0.0, mode="diff", seed=0,
           device="cpu"):
    q, k, v, n, g = _inputs(*dims, kscale=kscale, seed=seed)
    kw = dict(eps=eps, mode=mode, bank_lengths=None if lengths is None else torch.tensor(lengths))
    ref = _run(stair_readout_reference, q, k, v, n, g, torch.float64, **kw)
    plain = _run(stair_readout_reference, q, k, v, n, g, dtype, device, **kw)
    got = _run(lambda *a, **k_: stair_readout(*a, backend=backend, **k_), q, k, v, n, g, dtype, device, **kw)
    assert got[0].dtype == dtype and got[0].shape == ref[0].shape
    # Floor: fp32 rounding of the logits themselves (|s| u, u = 2^-24) limits any fp32 softmax gradient,
    # so with large logits (keys x 30) the floor grows with max |s| (a rounding bound, not a fudge).
    floor = FLOOR[dtype]
    if dtype == torch.float32:
        smax = (q @ k.repeat_interleave(dims[1] // dims[2], 1).transpose(-1, -2)).abs().max().item() / math.sqrt(dims[5])
        floor = max(floor, 2.0 * smax * 2.0 ** -24)
    for name, x, p, r, factor in zip(("out", "dq", "dn"), got, plain, ref, (2.0, 3.0, 3.0)):
        assert torch.isfinite(x).all(), f"{backend} {name} has NaN/inf"
        assert_within_rule(x, p, r, factor=factor, floor=floor * max(1.0, r.abs().max().item()),
                           name=f"{backend} {name} {dims}")


# (B, Hq, Hkv, T, M, D, Dv)
CPP_CASES = [
    ((1, 4, 1, 33, 300, 64, 64), {}),                             # M not a tile multiple, M > T, GQA 4
    ((1, 2, 2, 20, 50, 128, 128), {}),                            # GQA 1, D 128
    ((1, 8, 1, 6, 17, 256, 256), {}),                             # GQA 8, D 256
    ((2, 2, 1, 7, 19, 59, 111), {"lengths": [19, 0]}),            # odd head dims, empty bank row
    ((1, 2, 1, 200, 5, 80, 80), {}),                              # M < T, several query tiles
    ((1, 2, 1, 1, 1, 96, 40), {}),                                # T = 1, M = 1
    ((3, 4, 2, 9, 600, 32, 24), {"lengths": [600, 1, 257], "eps": 0.1}),  # ragged, eps > 0, > 2 tiles
    ((1, 2, 1, 300, 1100, 32, 32), {"lengths": [1037]}),         # 3 bank tiles of 512, several query tiles
    ((1, 2, 1, 70, 1100, 16, 16), {"kscale": 30.0, "eps": 0.1}),  # large logits over 3 bank tiles
    # key norms growing along the bank: each 512-key tile's row maxima jump past the previous ones by far
    # more than the C++ forward's lazy-max margin (and more than exp's float32 range)
    ((1, 2, 1, 40, 1100, 16, 16), {"kscale": torch.linspace(0.1, 100.0, 1100, dtype=torch.float64)[:, None]}),
    ((1, 2, 1, 40, 1100, 16, 16), {"kscale": torch.linspace(0.1, 100.0, 1100, dtype=torch.float64)[:, None],
                                   "eps": 0.1}),
    ((1, 4, 2, 9, 70, 32, 32), {"eps": 0.3, "mode": "reflected"}),
    ((1, 4, 2, 9, 70, 32, 32), {"eps": 0.3, "mode": "reference"}),
    ((1, 4, 2, 9, 70, 32, 32), {"mode": "reflected"}),
    ((1, 2, 1, 12, 40, 16, 16), {"kscale": 30.0}),                # large logits
    ((1, 2, 1, 12, 40, 16, 16), {"kscale": 30.0, "eps": 0.2}),
]

TRITON_CASES = [
    ((1, 2, 1, 5, 7, 64, 64), {}),
    ((1, 2, 2, 3, 5, 128, 128), {}),
    ((1, 1, 1, 2, 3, 256, 256), {"eps": 0.1}),
    ((1, 4, 1, 3, 20, 16, 16), {}),                               # GQA 4, M > T, not a block multiple
    ((1, 8, 1, 2, 3, 16, 16), {}),                                # GQA 8
    ((2, 2, 2, 17, 5, 59, 37), {"lengths": [5, 0]}),              # odd dims, empty row, M < T
    ((1, 2, 1, 1, 1, 24, 24), {}),                                # T = 1, M = 1
    ((2, 2, 1, 4, 20, 16, 16), {"lengths": [20, 3], "eps": 0.1}),
    ((1, 2, 1, 4, 9, 16, 16), {"eps": 0.3, "mode": "reflected"}),
    ((1, 2, 1, 4, 9, 16, 16), {"mode": "reference"}),
    ((1, 2, 1, 4, 12, 16, 16), {"kscale": 30.0, "eps": 0.2}),
]


@needs_cpp
@pytest.mark.parametrize("dims,kw", CPP_CASES)
def test_cpp_matches_reference(dims, kw):
    _check("cpp", dims, **kw)


@pytest.mark.parametrize("dims,kw", TRITON_CASES)
def test_triton_matches_reference(dims, kw):
    _check("triton", dims, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision(backend, dtype):
    dims = (1, 4, 2, 9, 300, 64, 64) if backend == "cpp" else (1, 2, 1, 5, 20, 16, 16)
    _check(backend, dims, dtype)
    _check(backend, dims, dtype, eps=0.1, lengths=[dims[4] - 3])


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp), "triton"])
def test_identity_two_sdpa_calls(backend):
    """eps = 0, mode="diff": exactly attn(q reflected) - attn(q) with PyTorch's own SDPA."""
    dims = (2, 4, 2, 9, 70, 59, 40) if backend != "triton" else (1, 4, 2, 3, 20, 24, 16)
    q, k, v, n, _ = _inputs(*dims)
    u = n / n.norm(dim=-1, keepdim=True)
    qr = q - 2 * u[None, :, None, :] * (q * u[None, :, None, :]).sum(-1, keepdim=True)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = F.scaled_dot_product_attention(qr, kk, vv) - F.scaled_dot_product_attention(q, kk, vv)
    dtype = torch.float32 if backend == "triton" else torch.float64
    got = stair_readout(q.to(dtype), k.to(dtype), v.to(dtype), n.to(dtype), backend=backend)
    assert_close_verbose(got, want, atol=1e-12 if dtype == torch.float64 else 2e-6, rtol=0, name=backend)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("eps,mode,lengths", [(0.0, "diff", None), (0.2, "diff", [4, 0]), (0.1, "reflected", [3, 5]),
                                              (0.1, "reference", [2, 5])])
def test_gradcheck_float64(backend, eps, mode, lengths):
    q, k, v, n, _ = _inputs(2, 2, 1, 2, 5, 4, 3)
    L = None if lengths is None else torch.tensor(lengths)

    def f(qq, nn_):
        return stair_readout(qq, k, v, nn_, bank_lengths=L, eps=eps, mode=mode, backend=backend)

    assert torch.autograd.gradcheck(f, (q.requires_grad_(), n.requires_grad_()), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_and_caller_tensors_untouched(backend):
    B, Hq, Hkv, T, M, D = 2, 4, 2, 5, 19, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, Hq, D, generator=gen).transpose(1, 2)           # (B, Hq, T, D) view
    k = torch.randn(B, M, Hkv, 2 * D, generator=gen)[..., ::2].transpose(1, 2)
    v = torch.randn(B, M, Hkv, D, generator=gen).transpose(1, 2)
    n = torch.randn(D, Hq, generator=gen).t()
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or n.is_contiguous())
    before = [x.clone() for x in (q, k, v, n)]
    got = stair_readout(q, k, v, n, eps=0.1, backend=backend)
    want = stair_readout_reference(q.double(), k.double(), v.double(), n.double(), eps=0.1)
    assert_close_verbose(got, want, atol=2e-6, rtol=1e-5, name=backend)
    for x, y in zip((q, k, v, n), before):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp), "triton"])
def test_empty_bank_rows_are_exactly_zero(backend):
    q, k, v, n, g = _inputs(3, 2, 1, 4, 6, 16, 16)
    L = torch.tensor([0, 6, 0])
    out, dq, dn = _run(lambda *a, **kw: stair_readout(*a, backend=backend, **kw), q, k, v, n, g, torch.float32,
                       bank_lengths=L, eps=0.1)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.equal(dq[0], torch.zeros_like(dq[0])) and out[1].abs().sum() > 0
    # M = 0: zeros of the right shape, still differentiable
    out0 = stair_readout(q.float().requires_grad_(), k[:, :, :0].float(), v[:, :, :0].float(), n.float(),
                         backend=backend)
    assert out0.shape == (3, 2, 4, 16) and torch.equal(out0, torch.zeros_like(out0))
    out0.sum().backward()


def test_torch_compile_fullgraph_no_graph_break():
    backend = "cpp" if _extension.has_kernel("stair_readout", "CPU") else "reference"
    q, k, v, n, g = _inputs(1, 4, 2, 6, 11, 16, 16)
    q, k, v, n, g = (x.float() for x in (q, k, v, n, g))

    def f(qq, nn_):
        return stair_readout(qq, k, v, nn_, eps=0.1, backend=backend) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q1, n1 = q.clone().requires_grad_(), n.clone().requires_grad_()
    q2, n2 = q.clone().requires_grad_(), n.clone().requires_grad_()
    (compiled(q1, n1) * g).sum().backward()
    (f(q2, n2) * g).sum().backward()
    torch.testing.assert_close(q1.grad, q2.grad)
    torch.testing.assert_close(n1.grad, n2.grad)
    explained = torch._dynamo.explain(f)(q, n)
    assert explained.graph_break_count == 0


@pytest.mark.slow
@needs_cpp
def test_torch_compile_inductor_fullgraph():
    q, k, v, n, g = (x.float() for x in _inputs(1, 4, 2, 6, 11, 16, 16))

    def f(qq, nn_):
        return torch.tanh(stair_readout(qq, k, v, nn_, backend="cpp")).sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    q1, n1 = q.clone().requires_grad_(), n.clone().requires_grad_()
    q2, n2 = q.clone().requires_grad_(), n.clone().requires_grad_()
    compiled(q1, n1).sum().backward()
    f(q2, n2).sum().backward()
    torch.testing.assert_close(q1.grad, q2.grad)
    torch.testing.assert_close(n1.grad, n2.grad)


def test_fake_tensor_shapes_match_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, n = (x.float() for x in _inputs(2, 4, 2, 5, 7, 16, 12)[:4])
    mode = FakeTensorMode()
    fq, fk, fv, fn = (mode.from_tensor(x) for x in (q, k, v, n))
    with mode:
        out = stair_readout(fq, fk, fv, fn)
    assert out.shape == (2, 4, 5, 12) and out.dtype == torch.float32


def _good():
    q, k, v, n, _ = _inputs(2, 4, 2, 3, 5, 8, 6)
    return dict(q=q.float(), k_bank=k.float(), v_bank=v.float(), normals=n.float())


BAD = [
    (lambda a: a.update(q=a["q"][0]), ValueError, r"q must be 4-D"),
    (lambda a: a.update(k_bank=a["k_bank"][0]), ValueError, r"k_bank must be 4-D"),
    (lambda a: a.update(v_bank=a["v_bank"][..., 0]), ValueError, r"v_bank must be 4-D"),
    (lambda a: a.update(k_bank=torch.randn(2, 3, 5, 8)), ValueError, r"multiple of Hkv"),
    (lambda a: a.update(k_bank=torch.randn(2, 2, 5, 7)), ValueError, r"k_bank must have shape \(B=2, Hkv, M, D=8\)"),
    (lambda a: a.update(v_bank=torch.randn(2, 2, 4, 6)), ValueError, r"v_bank must have shape"),
    (lambda a: a.update(normals=torch.randn(4, 7)), ValueError, r"normals must have shape \(Hq=4, D=8\)"),
    (lambda a: a.update(k_bank=a["k_bank"].double()), TypeError, r"share one dtype"),
    (lambda a: a.update(q=a["q"].long()), TypeError, r"q must be a floating tensor"),
    (lambda a: a.update(normals=[1.0]), TypeError, r"normals must be a torch.Tensor"),
    (lambda a: a.update(k_bank=a["k_bank"].requires_grad_()), ValueError, r"k_bank requires grad.*detach"),
    (lambda a: a.update(v_bank=a["v_bank"].requires_grad_()), ValueError, r"v_bank requires grad"),
    (lambda a: a["normals"].__setitem__(2, 0.0), ValueError, r"normals\[2\] \(query head 2\) has zero length"),
    (lambda a: a.update(bank_lengths=torch.tensor([1, 2, 3])), ValueError, r"bank_lengths must have shape \(B=2,\)"),
    (lambda a: a.update(bank_lengths=torch.tensor([1, 6])), ValueError, r"bank_lengths must lie in \[0, M=5\]"),
    (lambda a: a.update(bank_lengths=torch.tensor([-1, 2])), ValueError, r"bank_lengths must lie in"),
    (lambda a: a.update(bank_lengths=torch.tensor([1.0, 2.0])), TypeError, r"bank_lengths must be an integer"),
    (lambda a: a.update(eps=1.0), ValueError, r"eps must be in \[0, 1\)"),
    (lambda a: a.update(eps=-0.1), ValueError, r"eps must be in"),
    (lambda a: a.update(scale=0.0), ValueError, r"scale must be"),
    (lambda a: a.update(mode="both"), ValueError, r"mode must be one of"),
    (lambda a: (a.update(debug=True), a["q"].__setitem__((0, 0, 0, 0), math.nan)), ValueError, r"q contains NaN"),
    (lambda a: a.update(normals=a["normals"].to("meta")), ValueError, r"normals is on meta but q is on cpu"),
]


@pytest.mark.parametrize("mutate,exc,match", BAD)
def test_bad_input_raises_clearly(mutate, exc, match):
    args = _good()
    mutate(args)
    q, k, v, n = args.pop("q"), args.pop("k_bank"), args.pop("v_bank"), args.pop("normals")
    with pytest.raises(exc, match=match):
        stair_readout(q, k, v, n, **args)


def test_triton_head_dim_limit_is_named():
    q, k, v, n, _ = _inputs(1, 1, 1, 1, 2, 300, 8)
    with pytest.raises(ValueError, match=r"D, Dv <= 256"):
        stair_readout(q.float(), k.float(), v.float(), n.float(), backend="triton")


# ---- CUDA (run by bench/gpu_check.sh on a GPU machine; skipped elsewhere) ----
CUDA_CASES = [
    ((1, 4, 1, 300, 1000, 128, 128), {}),
    ((2, 8, 1, 77, 513, 64, 64), {"lengths": [513, 0], "eps": 0.1}),
    ((1, 4, 4, 1, 1, 256, 256), {}),
    ((1, 4, 2, 130, 257, 80, 96), {"eps": 0.2, "mode": "reflected"}),
    ((1, 2, 1, 64, 200, 59, 111), {"kscale": 30.0}),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims,kw", CUDA_CASES)
def test_cuda_triton_matches_reference(dims, kw, dtype):
    _check("triton", dims, dtype, device="cuda", **kw)


@pytest.mark.cuda
def test_cuda_identity_and_default_dispatch():
    q, k, v, n, _ = (x.cuda() for x in _inputs(1, 8, 2, 100, 300, 128, 128))
    u = n / n.norm(dim=-1, keepdim=True)
    qr = q - 2 * u[None, :, None, :] * (q * u[None, :, None, :]).sum(-1, keepdim=True)
    kk, vv = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    want = F.scaled_dot_product_attention(qr, kk, vv) - F.scaled_dot_product_attention(q, kk, vv)
    got = stair_readout(q.float(), k.float(), v.float(), n.float())  # dispatch: Triton for CUDA tensors
    assert_close_verbose(got, want, atol=2e-5, rtol=0, name="cuda identity")

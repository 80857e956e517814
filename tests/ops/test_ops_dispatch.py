"""What the public ops hand to their backends: the backend that runs, the fast path that skips
the custom op, the arguments a kernel receives, the results of empty and one-element calls, and the
autocast policy's casts. The ops' own tests check the results' values; the backends agree with each
other so well that a call routed to the wrong one passes those: here spies record which one ran.
"""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from treadle import _extension
from treadle.ops import _amp
from treadle.ops.gated_lora import gated_lora, gated_lora_linear
from treadle.ops.grpo_advantages import grpo_advantages
from treadle.ops.stair_readout import stair_readout
from treadle.ops.topk_entropy import topk_entropy, topk_entropy_from_hidden
from treadle.reference.stair import stair_readout_reference
from treadle.testing import require_backend

# the modules (treadle.ops re-exports the functions under the same names)
gl_mod = importlib.import_module("treadle.ops.gated_lora")
grpo_mod = importlib.import_module("treadle.ops.grpo_advantages")
sr_mod = importlib.import_module("treadle.ops.stair_readout")

# the C++ backends are spied on and compared with: missing, they skip with the reason (and fail under CI)
pytestmark = [require_backend(op) for op in ("grpo_advantages", "gated_lora", "gated_lora_linear", "stair_readout")]


class Spy:
    """Wraps ``obj.name``: counts calls and keeps their arguments; calls through unless ``ret`` is set."""

    def __init__(self, monkeypatch, obj, name, ret=None):
        self.calls, self.ret = [], ret
        self.orig = getattr(obj, name)
        monkeypatch.setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.ret(*args, **kwargs) if self.ret is not None else self.orig(*args, **kwargs)


# ---------------------------------------------------------------- _amp
def test_amp_cast_rules():
    f32, f64, bf16 = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)
    assert _amp.cast(None, torch.bfloat16) is None
    assert _amp.cast(f32, None) is f32
    assert _amp.cast(bf16, torch.bfloat16) is bf16
    assert _amp.cast(f64, torch.bfloat16) is f64  # float64 is never cast
    ints = torch.ones(2, dtype=torch.int64)
    assert _amp.cast(ints, torch.bfloat16) is ints
    assert _amp.cast(f32, torch.bfloat16).dtype == torch.bfloat16
    assert _amp.cast(bf16, torch.float16).dtype == torch.float16


def test_amp_autocast_dtype_per_device():
    assert _amp.autocast_dtype("cpu") is None and _amp.autocast_dtype("cuda") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _amp.autocast_dtype("cpu") == torch.bfloat16
        assert _amp.autocast_dtype("meta") is None
    # the CUDA flag is thread-local state that can be set without a GPU
    prev = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    try:
        assert _amp.autocast_dtype("cuda") == torch.float16
        assert _amp.autocast_dtype("cpu") is None
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", prev)


# ---------------------------------------------------------------- grpo_advantages
R = torch.tensor([0.0, 1.0, 3.0, 5.0, 2.0])
G = torch.tensor([3, 3, 9, 9, 9], dtype=torch.int32)


def test_grpo_backend_reference_runs_the_reference(monkeypatch):
    ref = Spy(monkeypatch, grpo_mod, "grpo_advantages_reference")
    kern = Spy(monkeypatch, _extension, "op")
    grpo_advantages(R, G, backend="cpp")
    assert len(ref.calls) == 0 and [c[0][0] for c in kern.calls] == ["grpo_advantages"]
    out = grpo_advantages(R, G, backend="reference", singleton="raw", scale_rewards="batch")
    assert len(ref.calls) == 1 and len(kern.calls) == 1
    assert ref.calls[0][1]["singleton"] == "raw" and ref.calls[0][1]["scale_rewards"] == "batch"
    assert out.dtype == torch.float32 and out.device == R.device


def test_grpo_cpp_kernel_gets_int64_ids_and_the_output_dtype(monkeypatch):
    seen, real_op = [], _extension.op

    def op(name):
        real = real_op(name)

        def call(*args):
            seen.append(args)
            return real(*args)
        return call

    monkeypatch.setattr(_extension, "op", op)
    for dt in (torch.float16, torch.float32, torch.float64):
        grpo_advantages(R.to(dt), G, backend="cpp", eps_placement="var", nonfinite="skip")
    for (r, g, v, f, est, unbiased, eps, eps_in_sqrt, singleton_raw, scale, skip), dt in zip(
            seen, (torch.float32, torch.float32, torch.float64)):
        assert g.dtype == torch.int64 and r.dtype == dt and r.is_contiguous()
        assert eps_in_sqrt is True and skip is True and unbiased is True and singleton_raw is False


def test_grpo_interpreter_kernel_gets_every_option(monkeypatch):
    import treadle.triton_kernels.grpo as tk

    spy = Spy(monkeypatch, tk, "grpo_advantages_triton", ret=lambda r, *a: torch.zeros_like(r))
    grpo_advantages(R, G, backend="triton", eps_placement="var", nonfinite="skip", std="biased", eps=0.25)
    grpo_advantages(R, G, backend="triton")
    (a1, _), (a2, _) = spy.calls
    assert a1[1].dtype == torch.int64
    assert a1[4:] == (0, False, 0.25, True, False, 0, True)
    assert a2[4:] == (0, True, 1e-6, False, False, 0, False)
    spy.calls.clear()
    grpo_advantages(R, G, backend="cpp")
    assert spy.calls == []


def test_grpo_fast_path_only_for_plain_eager_cpp_calls(monkeypatch):
    spy = Spy(monkeypatch, grpo_mod, "_grpo_advantages_op")
    valid = torch.tensor([True, True, True, False, True])
    expect = grpo_advantages(R, G, valid=valid, flags=None, backend="cpp")
    assert spy.calls == []  # plain eager, no autograd: straight to the kernel
    grpo_advantages(R, G, backend="reference")
    assert len(spy.calls) == 1  # every other backend goes through the custom op

    def via_op(**kw):
        spy.calls.clear()
        args = dict(rewards=R, group_ids=G, valid=valid, flags=None)
        args.update(kw)
        out = grpo_advantages(args.pop("rewards"), args.pop("group_ids"), **args, backend="cpp")
        assert len(spy.calls) == 1, kw
        return out

    torch.testing.assert_close(via_op(rewards=R.clone().requires_grad_(True)), expect)
    param = torch.nn.Parameter  # a tensor subclass
    torch.testing.assert_close(via_op(group_ids=param(G, requires_grad=False)), expect)
    torch.testing.assert_close(via_op(valid=param(valid, requires_grad=False)), expect)
    via_op(flags=param(torch.zeros(5, dtype=torch.bool), requires_grad=False))

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class FLog(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Log():
        torch.testing.assert_close(via_op(), expect)
    with FLog():
        torch.testing.assert_close(via_op(), expect)


@pytest.mark.parametrize("dtype,out", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_grpo_empty_batch_dtype_and_device(dtype, out):
    for dev in ("cpu", "meta"):
        a = grpo_advantages(torch.zeros(0, dtype=dtype, device=dev), torch.zeros(0, dtype=torch.int64, device=dev))
        assert a.shape == (0,) and a.dtype == out and a.device.type == dev


def test_grpo_overflowing_sum_check_is_silent():
    big = torch.tensor([3e38, 3e38, -3e38, -3e38])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grpo_advantages(big, torch.tensor([0, 0, 1, 1]), backend="cpp").tolist() == [0.0] * 4


# ---------------------------------------------------------------- gated_lora
def _lora(n=4, d_in=8, d_out=6, r=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return t(n, d_in), t(n, d_out), t(r, d_in), t(d_out, r), t(d_in), t(1)


OK = dict(scaling=0.5, L=-1.0, U=3.0, tau=0.7)


def test_gated_lora_backend_and_zero_size_route(monkeypatch):
    spy = Spy(monkeypatch, gl_mod, "_fwd_torch")
    x, base, A, B, w, b = _lora()
    W = torch.randn(6, 8)
    gated_lora(x, base, A, B, w, b, **OK, backend="cpp")
    gated_lora_linear(x, W, None, A, B, w, b, **OK, backend="cpp")
    assert spy.calls == []
    gated_lora(x, base, A, B, w, b, **OK, backend="reference")
    gated_lora_linear(x, W, None, A, B, w, b, **OK, backend="reference")
    assert len(spy.calls) == 2
    # nothing to compute (N, r or d_out = 0): the PyTorch path, whatever backend was asked for
    for n, d_out, r in ((0, 6, 2), (4, 6, 0), (4, 0, 2)):
        spy.calls.clear()
        x, base, A, B, w, b = _lora(n=n, d_out=d_out, r=r)
        y = gated_lora(x, base, A, B, w, b, **OK, backend="cpp")
        y2 = gated_lora_linear(x, torch.zeros(d_out, 8), None, A, B, w, b, **OK, backend="cpp")
        assert len(spy.calls) == 2, (n, d_out, r)
        assert torch.equal(y, base) and y2.shape == (n, d_out) and torch.equal(y2, torch.zeros(n, d_out))


def test_gated_lora_one_token_without_leading_dims():
    x, base, A, B, w, b = _lora()
    W, bias = torch.randn(6, 8), torch.randn(6)
    for backend in ("reference", "cpp"):
        y = gated_lora(x[1], base[1], A, B, w, b, **OK, backend=backend)
        assert y.shape == (6,)
        torch.testing.assert_close(y, gated_lora(x, base, A, B, w, b, **OK, backend=backend)[1])
        y = gated_lora_linear(x[1], W, bias, A, B, w, b, **OK, backend=backend)
        assert y.shape == (6,)
        torch.testing.assert_close(y, gated_lora_linear(x, W, bias, A, B, w, b, **OK, backend=backend)[1])


def test_gated_lora_shape_messages_name_the_leading_dims():
    x, _, A, B, w, b = _lora()
    x3 = x.reshape(2, 2, 8)
    with pytest.raises(ValueError) as e:
        gated_lora(x3, torch.zeros(2, 3, 6), A, B, w, b, **OK)
    assert str(e.value) == "base_out must have shape (2, 2) + (d_out,) like x's leading dims, got (2, 3, 6)"
    with pytest.raises(ValueError) as e:
        gated_lora_linear(x3.reshape(1, 4, 8), torch.zeros(6, 7), None, A, B, w, b, **OK)
    assert str(e.value) == "weight must have shape (d_out, d_in=8), got (6, 7)"


def test_gated_lora_autocast_casts():
    x, base, A, B, w, b = _lora(dtype=torch.float16)
    W = torch.randn(6, 8, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # fp16 inputs and an fp16 gate under bf16 autocast: x/base/A/B to bf16, the gate to fp32
        y, lam = gated_lora(x, base, A, B, w, b, **OK, return_lambda=True, backend="reference")
        y2 = gated_lora_linear(x, W, None, A, B, w, b, **OK, backend="reference")
    assert y.dtype == torch.bfloat16 and y2.dtype == torch.bfloat16
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    ye, lame = gated_lora(bf(x), bf(base), bf(A), bf(B), w.float(), b.float(), **OK, return_lambda=True,
                          backend="reference")
    assert torch.equal(y, ye) and torch.equal(lam, lame)
    assert torch.equal(y2, gated_lora_linear(bf(x), bf(W), None, bf(A), bf(B), w.float(), b.float(), **OK,
                                             backend="reference"))
    # float64 is never cast, the gate included: bit for bit the result outside autocast
    x, base, A, B, w, b = _lora(dtype=torch.float64)
    out = gated_lora(x, base, A, B, w, b, **OK, return_lambda=True, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gated_lora(x, base, A, B, w, b, **OK, return_lambda=True, backend="reference")
        with pytest.raises(TypeError) as e:
            gated_lora(x, base.float(), A, B, w, b, **OK)
        assert str(e.value) == "base_out must have x's dtype torch.float64, got torch.float32"
    assert torch.equal(out[0], got[0]) and torch.equal(out[1], got[1]) and got[1].dtype == torch.float64
    # non-tensors are reported as such under autocast too (never handed to a cast)
    x, base, A, B, w, b = _lora()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i, name in ((2, "lora_A"), (3, "lora_B"), (4, "gate_weight"), (5, "gate_bias")):
            args = [x, base, A, B, w, b]
            args[i] = [1.0]
            with pytest.raises(TypeError) as e:
                gated_lora(*args, **OK)
            assert str(e.value) == f"{name} must be a torch.Tensor, got list"


# ---------------------------------------------------------------- stair_readout
def _bank(B=2, Hq=2, Hkv=1, T=3, M=4, D=8, Dv=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return t(B, Hq, T, D), t(B, Hkv, M, D), t(B, Hkv, M, Dv), t(Hq, D)


def test_stair_backend_route(monkeypatch):
    spy = Spy(monkeypatch, sr_mod, "stair_readout_reference")
    q, k, v, n = _bank()
    stair_readout(q, k, v, n, backend="cpp")
    assert spy.calls == []
    stair_readout(q, k, v, n, backend="reference")
    assert len(spy.calls) == 1
    # D = 0: uniform weights over the valid slots, computed by the PyTorch path whatever was asked for
    spy.calls.clear()
    q, k, v, n = _bank(D=0)
    lens = torch.tensor([4, 2])
    for mode in ("reference", "reflected", "diff"):
        out = stair_readout(q, k, v, n, bank_lengths=lens, mode=mode, eps=0.3, backend="cpp")
        mean = torch.stack([v[0, 0].mean(0), v[1, 0, :2].mean(0)])[:, None, None, :].expand(2, 2, 3, 5)
        torch.testing.assert_close(out, torch.zeros_like(mean) if mode == "diff" else mean)
    assert len(spy.calls) == 3


def test_stair_small_and_empty_shapes():
    # one slot: the reflected read is that slot's value exactly; one of everything is not an empty call
    q, k, v, n = _bank(B=1, Hq=1, Hkv=1, T=1, M=1, D=4, Dv=1)
    for backend in ("reference", "cpp"):
        torch.testing.assert_close(stair_readout(q, k, v, n, mode="reflected", backend=backend), v.reshape(1, 1, 1, 1))
    q, k, v, n = _bank(B=1, Hq=1, Hkv=1, T=1, M=2, D=4, Dv=1)
    expect = stair_readout_reference(q, k, v, n)
    assert expect.abs().item() > 0
    torch.testing.assert_close(stair_readout(q, k, v, n, backend="cpp"), expect)
    # every zero size gives exact zeros of the right shape, with zero gradients
    for shape in (dict(T=0), dict(Dv=0), dict(B=0), dict(M=0)):
        q, k, v, n = _bank(**shape)
        q.requires_grad_(True)
        n.requires_grad_(True)
        out = stair_readout(q, k, v, n, eps=0.5, bank_lengths=torch.zeros(q.shape[0], dtype=torch.int64))
        assert out.shape == (q.shape[0], 2, q.shape[2], v.shape[-1]) and torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(n.grad, torch.zeros_like(n))
    # an empty bank reads exactly 0 even for inputs that sum to 0 (no 0 / 0 anywhere)
    q, k, v, _ = _bank(M=0)
    n = torch.tensor([[1.0, -1.0] * 4, [2.0, -2.0] * 4], requires_grad=True)
    out = stair_readout(torch.zeros_like(q).requires_grad_(True), k, v, n)
    assert torch.equal(out, torch.zeros_like(out))


def test_stair_checks_at_size_one():
    q, k, v, n = _bank(B=1, Hq=1, Hkv=1, D=1)
    with pytest.raises(ValueError) as e:
        stair_readout(q, k, v, torch.zeros(1, 1))
    assert str(e.value) == "normals[0] (query head 0) has zero length: a zero normal has no reflection direction"
    with pytest.raises(ValueError) as e:
        stair_readout(q, k, v, n, bank_lengths=torch.tensor([5]))
    assert str(e.value) == "bank_lengths must lie in [0, M=4], got values in [5, 5]"
    with pytest.raises(ValueError) as e:
        stair_readout(q, k[:, :0], v[:, :0], n)
    assert str(e.value) == "Hq (q.shape[1] = 1) must be a multiple of Hkv (k_bank.shape[1] = 0)"
    # an empty batch with its (0,) lengths is a zero-size call; tiny fp16 normals are not zero
    q, k, v, n = _bank(B=0)
    assert stair_readout(q, k, v, n, bank_lengths=torch.zeros(0, dtype=torch.int64)).shape == (0, 2, 3, 5)
    q, k, v, n = _bank()
    tiny = torch.full((2, 8), 1e-4, dtype=torch.float16)
    torch.testing.assert_close(stair_readout(q, k, v, tiny, backend="reference"),
                               stair_readout(q, k, v, torch.ones(2, 8), backend="reference"))


def test_stair_autocast_message_names_the_cast_dtypes():
    q, k, v, n = _bank()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError) as e:
            stair_readout(q.double(), k, v, n)
    assert str(e.value) == ("q, k_bank and v_bank must share one dtype, got q torch.float64, k_bank torch.float32, "
                            "v_bank torch.float32")


@pytest.mark.parametrize("ndtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["diff", "reflected", "reference"])
def test_stair_reference_backend_gradients_in_the_accumulation_dtype(mode, ndtype):
    q, k, v, n = _bank(dtype=torch.bfloat16)
    n = n.to(ndtype)
    lens = torch.tensor([4, 3])
    qq, nn_ = q.clone().requires_grad_(True), n.clone().requires_grad_(True)
    out = stair_readout(qq, k, v, nn_, bank_lengths=lens, eps=0.2, scale=0.3, mode=mode, backend="reference")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(dout)
    # the ground truth: autograd through the reference maths in float32 (normals too), one cast at the end
    q32, n32 = q.float().requires_grad_(True), n.float().requires_grad_(True)
    ref = stair_readout_reference(q32, k.float(), v.float(), n32, bank_lengths=lens, eps=0.2, scale=0.3, mode=mode)
    dq, dn = torch.autograd.grad(ref, (q32, n32), dout.float(), allow_unused=True, materialize_grads=True)
    assert torch.equal(out, ref.to(torch.bfloat16))
    assert qq.grad.dtype == torch.bfloat16 and nn_.grad.dtype == ndtype
    assert torch.equal(qq.grad, dq.to(torch.bfloat16)) and torch.equal(nn_.grad, dn.to(ndtype))
    if mode == "reference":
        assert torch.equal(nn_.grad, torch.zeros_like(n))


# ---------------------------------------------------------------- topk_entropy
def test_topk_entropy_one_position_without_leading_dims():
    z = torch.randn(3, 12, generator=torch.Generator().manual_seed(3))
    assert topk_entropy(z[1], 5).item() == pytest.approx(topk_entropy(z, 5, reduction="none")[1].item(), rel=1e-6)
    hidden, head = z[:, :4], torch.randn(12, 4)
    assert topk_entropy_from_hidden(hidden[2], head, 5).item() == pytest.approx(
        topk_entropy(hidden[2:] @ head.t(), 5).item(), rel=1e-6)


def test_topk_entropy_from_hidden_autocast_message():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError) as e:
            topk_entropy_from_hidden(torch.zeros(3, 4, dtype=torch.float64), torch.zeros(10, 4), 4)
    assert str(e.value) == "lm_head_weight must have hidden's dtype torch.float64, got torch.float32"
    # cast together, they run as lm_head would: the chunked GEMM in bf16, the entropy in fp32
    hidden, head = torch.randn(3, 4), torch.randn(10, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = topk_entropy_from_hidden(hidden, head, 4)
    expect = topk_entropy(hidden.bfloat16() @ head.bfloat16().t(), 4)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(expect.item(), rel=1e-6)


# ---------------------------------------------------------------- the custom ops' outputs match their fake declarations
def test_gated_lora_custom_op_outputs_have_the_declared_dtypes_and_shapes():
    x, base, A, B, w, b = _lora(dtype=torch.bfloat16)
    w, b = w.float(), b.float()
    y, z, v = torch.ops.treadle.gated_lora_fwd(x, base, A, B, w, b, 0.5, -1.0, 3.0, 0.7, "reference")
    assert (y.dtype, tuple(y.shape)) == (torch.bfloat16, (4, 6))
    assert (z.dtype, tuple(z.shape)) == (torch.bfloat16, (4, 3))  # x A^T and x . w per token, in x's dtype
    assert (v.dtype, tuple(v.shape)) == (torch.float32, (4,))
    dy = torch.ones(4, 6, dtype=torch.bfloat16)
    for need_dx, need_dgate in ((True, False), (False, True), (True, True)):
        dx, dw, db = torch.ops.treadle.gated_lora_bwd(dy, x, A, B, z, v, 0.5, -1.0, 3.0, 0.7, need_dx, need_dgate,
                                                      "reference")
        assert (dx.dtype, tuple(dx.shape)) == (torch.bfloat16, (4, 8))
        assert (dw.dtype, tuple(dw.shape)) == (torch.float32, (8,))
        assert (db.dtype, tuple(db.shape)) == (torch.float32, (1,))
        if not need_dgate:
            assert torch.equal(dw, torch.zeros(8)) and torch.equal(db, torch.zeros(1))
        if not need_dx:
            assert torch.equal(dx, torch.zeros_like(x))


def test_gated_lora_lambda_is_detached():
    x, base, A, B, w, b = _lora()
    x.requires_grad_(True)
    w.requires_grad_(True)
    W = torch.randn(6, 8)
    for backend in ("reference", "cpp"):
        y, lam = gated_lora(x, base, A, B, w, b, **OK, return_lambda=True, backend=backend)
        assert y.requires_grad and not lam.requires_grad and lam.grad_fn is None
        y, lam = gated_lora_linear(x, W, None, A, B, w, b, **OK, return_lambda=True, backend=backend)
        assert y.requires_grad and not lam.requires_grad and lam.grad_fn is None


def test_topk_entropy_default_k_is_100():
    z = torch.randn(3, 150, generator=torch.Generator().manual_seed(4))
    assert topk_entropy(z).item() == topk_entropy(z, 100).item() != topk_entropy(z, 101).item()
    hidden, head = z[:, :6].contiguous(), torch.randn(150, 6, generator=torch.Generator().manual_seed(5))
    assert (topk_entropy_from_hidden(hidden, head).item() == topk_entropy_from_hidden(hidden, head, 100).item()
            != topk_entropy_from_hidden(hidden, head, 101).item())

"""``treadle.ops.gated_lora``: per-token gated LoRA (SCALE sec. 3.3), fused shrink / epilogue / expand.

Maths (spec: :mod:`treadle.reference.scale`). Over 2-D views ``x (N, d_in)``, ``base_out (N, d_out)``
with ``A (r, d_in)``, ``B (d_out, r)``, gate ``w (d_in,)``, ``b``::

    shrink:    z = x [A; w]^T            one GEMM over x: u = z[:, :r] = x A^T, and x . w = z[:, r]
    epilogue:  g = x . w + b,  v = tanh(g / tau),
               lambda = 1 + (1 - L) min(v, 0) + (U - 1) max(v, 0),  s = scaling * lambda   (per token)
    expand:    y = base_out + (s * u) B^T

Backward (chain rule; ``dy = dL/dy (N, d_out)``; A, B, W frozen; the gate reads ``sg(x)``)::

    dL/d base_out = dy                                           (reaches x through base_out's own graph,
                                                                  i.e. the ``dy W`` term of DESIGN.md)
    y_n = base_n + s_n * B u_n,  so
    dL/d s_n   = dy_n . (B u_n) = (dy_n B) . u_n = p_n . u_n      with p = dy B   (N, r): one thin GEMM,
                                                                  no (N, d_out) delta is re-formed
    dL/d lambda_n = scaling * (p_n . u_n)
    d lambda/d v  = (1 - L) if v < 0, (U - 1) if v > 0, (U - L) / 2 at v = 0 (midpoint, as
                    torch.minimum/maximum split a tie; zero-initialised gates sit exactly there)
    d v/d g       = (1 - v^2) / tau
    dg_n          = scaling * (p_n . u_n) * lambda'(v_n) * (1 - v_n^2) / tau
    dL/dw = sum_n dg_n x_n = x^T dg      dL/db = sum_n dg_n
    dL/dx (LoRA path) = s_n * (dy_n B) A = (s * p) A               (N, d_in)
    no term through g: the gate's input is stop-gradient; no gradient for A and B.

Saved for backward: x, A, B, ``z (N, r + 1)`` and ``v (N,)``: O(N r) beyond the inputs.

Backends: ``reference`` (the same decomposition in plain PyTorch), ``cpp`` (csrc/cpu/gated_lora.cpp:
stacked shrink GEMM, one OpenMP pass over the tokens for the epilogue (``s * u``, ``(N, r)``), then
one ``addmm`` for the rank-r expand (in place into the base GEMM's output for
:func:`gated_lora_linear`); backward: the thin GEMM ``p = dy B``, a per-token pass, one rank-r GEMM
for ``dx = (s p) A`` and one GEMV for ``dw``; MKL's rank-16 GEMMs measured as fast as a hand-written
register-blocked row loop here, which was removed), ``triton``: for :func:`gated_lora_linear` one
persistent TMA GEMM per direction (triton_kernels/scale_gemm.py: the shrink and the gate logit ride
on the x tiles of the first output tile of each work item, ``s * u`` stays in registers, and each
output tile's epilogue adds ``(s u) B^T`` with one more MMA; backward likewise ``dx = dy W + (s p) A``,
then one streaming pass over x for ``dw``), and for :func:`gated_lora` or shapes TMA cannot address
(triton_kernels/scale.py) one kernel for shrink + epilogue + expand, one for ``p``, the epilogue
and ``dx``. Memory traffic beyond the base linear, forward: one
read of x (shrink), one read of base_out and one write of y; backward: one read of dy, one write of
dx, one read of x (dw), plus autograd's in-place sum of x's two gradients (x and base_out enter the
op with their own shapes, so no reshape view forces that sum out of place).

:func:`gated_lora_linear` is the same op with the frozen base linear fused in (``weight``, ``bias``
instead of ``base_out``); on the C++ backend it removes the base_out buffer and autograd's sum of
x's two gradients (``dx = dy W`` by one GEMM, then ``(s p) A`` added in place).
"""
from __future__ import annotations

import math

import torch

from treadle.ops.dtensor import refuse_dtensor as _refuse_dtensor
from treadle import dispatch
from treadle.ops import _amp
from treadle.reference.scale import gate_lambda_reference as _lambda

OP = "gated_lora"
OP_LINEAR = "gated_lora_linear"
dispatch.register(OP, cpu=("cpp",), gpu=("triton",))
dispatch.register(OP_LINEAR, cpu=("cpp",), gpu=("triton",))

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lambda_slope(v: torch.Tensor, L: float, U: float) -> torch.Tensor:
    return torch.where(v < 0, 1.0 - L, torch.where(v > 0, U - 1.0, 0.5 * (U - L))).to(v.dtype)


# ---------------------------------------------------------------- plain-PyTorch backend ("reference")
def _fwd_torch(x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau):
    acc = _acc_dtype(x.dtype)
    d_in, d_out = x.shape[-1], base_out.shape[-1]
    n = math.prod(x.shape[:-1])  # explicit: reshape(-1, 0) is ambiguous when d_in or d_out is 0
    x2 = x.reshape(n, d_in)
    u = x2 @ lora_A.t()
    # the gate logit is accumulated in the accumulation dtype from x and the gate as given (a float32
    # gate on bf16 x is not rounded to bf16, and the logit is not rounded before tanh)
    g = x2.to(acc) @ gate_weight.to(acc)
    z = torch.cat([u, g.to(x.dtype).unsqueeze(1)], 1)
    v = torch.tanh((g + gate_bias.reshape(()).to(acc)) / tau)
    su = (u.to(acc) * (scaling * _lambda(v, L, U)).unsqueeze(1)).to(x.dtype)
    y = torch.empty_like(base_out)
    torch.addmm(base_out.reshape(n, d_out), su, lora_B.t(), out=y.view(n, d_out))
    return y, z, v


def _bwd_torch(dy, x, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate):
    acc = v.dtype
    d_in = x.shape[-1]
    n = v.shape[0]
    x2 = x.reshape(n, d_in)
    p = dy.reshape(n, dy.shape[-1]) @ lora_B
    ds = (p.to(acc) * z[:, :-1].to(acc)).sum(1)
    dg = scaling * ds * _lambda_slope(v, L, U) * (1 - v * v) / tau
    q = (p.to(acc) * (scaling * _lambda(v, L, U)).unsqueeze(1)).to(x.dtype)
    dx = torch.zeros_like(x)
    if need_dx:
        torch.mm(q, lora_A, out=dx.view(n, d_in))
    if need_dgate:
        dw, db = x2.to(acc).t() @ dg, dg.sum().reshape(1)
    else:
        dw, db = x.new_zeros(d_in, dtype=acc), x.new_zeros(1, dtype=acc)
    return dx, dw, db


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("treadle::gated_lora_fwd", mutates_args=())
@_amp.no_autocast
def _gated_lora_fwd(x: torch.Tensor, base_out: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                    gate_weight: torch.Tensor, gate_bias: torch.Tensor, scaling: float, L: float, U: float,
                    tau: float, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on contiguous ``x (..., d_in)``, ``base_out (..., d_out)``: returns ``y`` (base_out's shape),
    ``z (N, r + 1)`` (x A^T and x . w per token), ``v (N,)``."""
    if backend == "triton" and x.dtype != torch.float64:
        from treadle.triton_kernels.scale import gated_lora_fwd_triton

        return gated_lora_fwd_triton(x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau)
    if backend == "cpp":
        from treadle import _extension

        return _extension.op(OP)(x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau)
    return _fwd_torch(x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau)


@_gated_lora_fwd.register_fake
def _(x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, backend):
    n, r = x.numel() // x.shape[-1], lora_A.shape[0]
    return (torch.empty_like(base_out), x.new_empty((n, r + 1)), x.new_empty((n,), dtype=_acc_dtype(x.dtype)))


@torch.library.custom_op("treadle::gated_lora_bwd", mutates_args=())
@_amp.no_autocast
def _gated_lora_bwd(grad_y: torch.Tensor, x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                    z: torch.Tensor, v: torch.Tensor, scaling: float, L: float, U: float, tau: float,
                    need_dx: bool, need_dgate: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: returns ``dx`` (x's shape; LoRA path only), ``dw (d_in,)``, ``db (1,)`` (fp32/fp64)."""
    grad_y = grad_y.contiguous()
    if backend == "triton" and x.dtype != torch.float64:
        from treadle.triton_kernels.scale import gated_lora_bwd_triton

        return gated_lora_bwd_triton(grad_y, x, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate)
    if backend == "cpp":
        from treadle import _extension

        return _extension.op("gated_lora_backward")(grad_y, x, lora_A, lora_B, z, v, scaling, L, U, tau,
                                                     need_dx, need_dgate)
    return _bwd_torch(grad_y, x, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate)


@_gated_lora_bwd.register_fake
def _(grad_y, x, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate, backend):
    acc = _acc_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty((x.shape[-1],), dtype=acc), x.new_empty((1,), dtype=acc)


def _setup_context(ctx, inputs, output):
    x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, backend = inputs
    _, z, v = output
    ctx.save_for_backward(x, lora_A, lora_B, z, v)
    ctx.args = (scaling, L, U, tau, backend)
    ctx.gate_meta = (gate_weight.dtype, gate_bias.dtype, gate_bias.shape)
    ctx.mark_non_differentiable(z, v)
    ctx.set_materialize_grads(False)  # z and v never receive gradients: do not allocate zeros for them


@_amp.no_autocast
def _backward(ctx, grad_y, grad_z, grad_v):
    x, lora_A, lora_B, z, v = ctx.saved_tensors
    scaling, L, U, tau, backend = ctx.args
    need_dx = ctx.needs_input_grad[0]
    need_dgate = ctx.needs_input_grad[4] or ctx.needs_input_grad[5]
    dx = dw = db = None
    if grad_y is None:
        return (None,) * 11
    if need_dx or need_dgate:
        dx, dw, db = _gated_lora_bwd(grad_y, x, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate,
                                     backend)
    w_dtype, b_dtype, b_shape = ctx.gate_meta
    return (dx if need_dx else None,
            grad_y if ctx.needs_input_grad[1] else None,
            None, None,
            dw.to(w_dtype) if ctx.needs_input_grad[4] else None,
            db.to(b_dtype).reshape(b_shape) if ctx.needs_input_grad[5] else None,
            None, None, None, None, None)


_gated_lora_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- variant with the base linear fused in
def _fused_applies(x: torch.Tensor, weight: torch.Tensor, r: int, grad_y: torch.Tensor | None = None) -> bool:
    """Whether the Triton backend runs this call as one fused GEMM (16-bit x on a GPU, any float x
    under the CPU interpreter; TMA-aligned rows and pointers; ``r <= 32``); otherwise it runs the
    base GEMM with torch and then the unfused kernels."""
    from treadle.triton_kernels import scale_fused

    return scale_fused.applies(x, weight, r) and (grad_y is None or scale_fused.tma_aligned(grad_y))


@torch.library.custom_op("treadle::gated_lora_linear_fwd", mutates_args=())
@_amp.no_autocast
def _gated_lora_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                           lora_B: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor, scaling: float,
                           L: float, U: float, tau: float, backend: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y = x W^T (+ bias) + lambda * scaling * (x A^T) B^T`` on contiguous ``x (..., d_in)``."""
    if backend == "triton" and _fused_applies(x, weight, lora_A.shape[0]):
        from treadle.triton_kernels import scale_fused

        return scale_fused.linear_fwd(x, weight, bias, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau)
    if backend == "cpp":
        from treadle import _extension

        return _extension.op(OP_LINEAR)(x, weight, bias, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau)
    return _gated_lora_fwd(x, torch.nn.functional.linear(x, weight, bias), lora_A, lora_B, gate_weight, gate_bias,
                           scaling, L, U, tau, backend)


@_gated_lora_linear_fwd.register_fake
def _(x, weight, bias, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, backend):
    n, r = x.numel() // x.shape[-1], lora_A.shape[0]
    return (x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((n, r + 1)),
            x.new_empty((n,), dtype=_acc_dtype(x.dtype)))


@torch.library.custom_op("treadle::gated_lora_linear_bwd", mutates_args=())
@_amp.no_autocast
def _gated_lora_linear_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor,
                           lora_B: torch.Tensor, z: torch.Tensor, v: torch.Tensor, scaling: float, L: float, U: float,
                           tau: float, need_dx: bool, need_dgate: bool, backend: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dx = dy W + (s * (dy B)) A`` (the LoRA term added in place on the C++ path, in the GEMM's
    epilogue on the fused Triton path), ``dw``, ``db``."""
    grad_y = grad_y.contiguous()
    if backend == "triton" and need_dx and _fused_applies(x, weight, lora_A.shape[0], grad_y):
        from treadle.triton_kernels import scale_fused

        return scale_fused.linear_dx(grad_y, x, weight, lora_A, lora_B, z, v, scaling, L, U, tau, need_dgate)
    if backend == "cpp":
        from treadle import _extension

        return _extension.op(OP_LINEAR + "_backward")(grad_y, x, weight, lora_A, lora_B, z, v, scaling, L, U, tau,
                                                       need_dx, need_dgate)
    dx, dw, db = _gated_lora_bwd(grad_y, x, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate, backend)
    if need_dx:
        dx = dx + grad_y @ weight
    return dx, dw, db


@_gated_lora_linear_bwd.register_fake
def _(grad_y, x, weight, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx, need_dgate, backend):
    acc = _acc_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty((x.shape[-1],), dtype=acc), x.new_empty((1,), dtype=acc)


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, backend = inputs
    _, z, v = output
    ctx.save_for_backward(x, weight, lora_A, lora_B, z, v)
    ctx.args = (scaling, L, U, tau, backend)
    ctx.gate_meta = (gate_weight.dtype, gate_bias.dtype, gate_bias.shape)
    ctx.mark_non_differentiable(z, v)
    ctx.set_materialize_grads(False)


@_amp.no_autocast
def _linear_backward(ctx, grad_y, grad_z, grad_v):
    x, weight, lora_A, lora_B, z, v = ctx.saved_tensors
    scaling, L, U, tau, backend = ctx.args
    need_dx = ctx.needs_input_grad[0]
    need_dw, need_db = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
    if grad_y is None or not (need_dx or need_dw or need_db):
        return (None,) * 12
    dx, dw, db = _gated_lora_linear_bwd(grad_y, x, weight, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx,
                                        need_dw or need_db, backend)
    w_dtype, b_dtype, b_shape = ctx.gate_meta
    return (dx if need_dx else None, None, None, None, None,
            dw.to(w_dtype) if need_dw else None,
            db.to(b_dtype).reshape(b_shape) if need_db else None,
            None, None, None, None, None)


_gated_lora_linear_fwd.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ---------------------------------------------------------------- public API
def _check_tensor(name: str, t, dtypes=_FLOAT) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have a floating dtype (one of {dtypes}), got {t.dtype}")


def _check_scalar(name: str, value, cond, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or not cond(value):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def _autocast_inputs(x, others, gate_weight, gate_bias, nested=False):
    """The autocast policy (see :mod:`treadle.ops._amp`): under autocast, x and the matrices (base_out or
    the base weight/bias, A, B) run in the autocast dtype like ``F.linear``; the gate runs in float32."""
    amp = _amp.autocast_dtype(x.device.type)
    if amp is None:
        return (x, others, gate_weight, gate_bias) if nested else (x, *others, gate_weight, gate_bias)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        amp = None  # float64 is never cast
    x = _amp.cast(x, amp)
    others = tuple(_amp.cast(t, amp) if isinstance(t, torch.Tensor) else t for t in others)
    gate32 = torch.float32 if amp is not None else None
    gate_weight = _amp.cast(gate_weight, gate32) if isinstance(gate_weight, torch.Tensor) else gate_weight
    gate_bias = _amp.cast(gate_bias, gate32) if isinstance(gate_bias, torch.Tensor) else gate_bias
    return (x, others, gate_weight, gate_bias) if nested else (x, *others, gate_weight, gate_bias)


def _zero_size(x, lora_A, d_out) -> bool:
    return x.numel() == 0 or lora_A.shape[0] == 0 or d_out == 0


def _validate(x, d_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, frozen, return_lambda=False):
    """Checks shared by both entry points; returns (scaling, L, U, tau) as floats. ``frozen``: more
    ``(name, tensor)`` pairs that must not require grad."""
    for name, t in (("x", x), ("lora_A", lora_A), ("lora_B", lora_B), ("gate_weight", gate_weight),
                    ("gate_bias", gate_bias)):
        _check_tensor(name, t)
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in (("gate_weight", gate_weight), ("gate_bias", gate_bias)):
        if t.dtype not in (x.dtype, torch.float32):
            allowed = f"x's dtype {x.dtype}" + ("" if x.dtype == torch.float32 else " or torch.float32")
            raise TypeError(f"{name} must have {allowed}, got {t.dtype}")
    scaling = _check_scalar("scaling", scaling, lambda s: True, "a finite number")
    L = _check_scalar("L", L, lambda s: s < 0, "a finite number < 0 (lambda's lower end; L < 0 < 1 < U)")
    U = _check_scalar("U", U, lambda s: s > 1, "a finite number > 1 (lambda's upper end; L < 0 < 1 < U)")
    tau = _check_scalar("tau", tau, lambda s: s > 0, "a finite number > 0 (the gate temperature)")
    if not isinstance(return_lambda, bool):
        raise TypeError(f"return_lambda must be True or False, got {return_lambda!r}")
    if x.dim() < 1:
        raise ValueError("x must have shape (..., d_in), got a scalar")
    d_in = x.shape[-1]
    if lora_A.dim() != 2 or lora_A.shape[1] != d_in:
        raise ValueError(f"lora_A must have shape (r, d_in={d_in}), got {tuple(lora_A.shape)}")
    r = lora_A.shape[0]
    if lora_B.dim() != 2 or tuple(lora_B.shape) != (d_out, r):
        raise ValueError(f"lora_B must have shape (d_out={d_out}, r={r}), got {tuple(lora_B.shape)}")
    if gate_weight.dim() != 1 or gate_weight.shape[0] != d_in:
        raise ValueError(f"gate_weight must have shape (d_in={d_in},), got {tuple(gate_weight.shape)}")
    if gate_bias.numel() != 1 or gate_bias.dim() > 1:
        raise ValueError(f"gate_bias must have shape () or (1,), got {tuple(gate_bias.shape)}")
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B), ("gate_weight", gate_weight), ("gate_bias", gate_bias)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; put them on one device")
    if torch.is_grad_enabled():
        for name, t in (("lora_A", lora_A), ("lora_B", lora_B), *frozen):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, but gated LoRA treats it as frozen (SCALE Stage II) and "
                                 f"gives it no gradient; call {name}.requires_grad_(False) first")
    return scaling, L, U, tau


def gated_lora(
    x: torch.Tensor,
    base_out: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    *,
    scaling: float,
    L: float,
    U: float,
    tau: float,
    return_lambda: bool = False,
    backend: str | None = None,
):
    """Per-token gated LoRA: ``y = base_out + lambda * scaling * (x A^T) B^T`` (SCALE sec. 3.3).

    ``lambda = 1 + (1 - L) min(v, 0) + (U - 1) max(v, 0)`` with ``v = tanh((x . w + b) / tau)``, one
    value per token, in the open interval ``(L, U)``; ``lambda = 1`` exactly when ``w = 0, b = 0``.

    Args:
        x: ``(..., d_in)`` the LoRA module's input ``h`` (float16/bfloat16/float32/float64).
        base_out: ``(..., d_out)`` the frozen base layer's output ``W h (+ bias)``, same dtype and
            leading shape as ``x``. Its gradient is ``dy``, passed through unchanged, so ``x`` also
            receives the base path's ``dy W`` through ``base_out``'s own graph.
        lora_A: ``(r, d_in)`` PEFT's ``lora_A.weight``; frozen (must not require grad).
        lora_B: ``(d_out, r)`` PEFT's ``lora_B.weight``; frozen.
        gate_weight: ``(d_in,)`` gate vector ``w``, dtype of ``x`` or float32.
        gate_bias: ``()`` or ``(1,)`` gate bias ``b``, dtype of ``x`` or float32.
        scaling: PEFT's ``alpha / r`` (any finite float).
        L: lower end of lambda's range, ``L < 0`` (lambda < 0 reverses the LoRA delta).
        U: upper end, ``U > 1`` (lambda > 1 extrapolates it).
        tau: gate temperature, ``tau > 0``.
        return_lambda: also return ``lambda`` (shape ``x.shape[:-1]``, float32, or float64 for
            float64 inputs), detached: for statistics (reverse / suppress / extrapolate shares).
        backend: ``"reference"``, ``"cpp"`` or ``"triton"`` (default: the dispatch rule, see
            :func:`treadle.backends`). float64 inputs on the Triton backend run the PyTorch path.

    Returns:
        ``y`` with ``base_out``'s shape and dtype, or ``(y, lambda)`` if ``return_lambda``.

    Gradients: ``x`` (LoRA path ``(s * (dy B)) A``; none through the gate, whose input is
    stop-gradient), ``base_out`` (``dy``), ``gate_weight``, ``gate_bias`` (in their own dtypes).
    None for ``lora_A``, ``lora_B``. The derivation is in this module's docstring. At ``v = 0``
    ``d lambda / d v = (U - L) / 2`` (midpoint of the kink).

    Contract (every backend; tests/contracts):
        dtypes: x, base_out, A and B share one dtype; the gate is x's dtype or float32. Products
            ``x A^T`` and ``(s u) B^T`` run as a plain ``x @ A.T`` would in x's dtype; the gate logit
            ``x . w + b`` is accumulated in float32 (float64 for float64 x) from x and the gate *as
            given* (a float32 gate is never rounded to bf16, the logit never before tanh), and
            lambda, ``s`` and the gate gradients are float32/float64; one cast at the end.
        autocast: under ``torch.autocast`` x, base_out, A and B are cast to the autocast dtype (as
            ``F.linear`` is) and the gate to float32, then the op runs with autocast off (also in
            its backward): every backend gives what it gives outside autocast on those inputs.
            float64 inputs are never cast. Gradients reach the caller's tensors in their dtypes.
        masking: none; every row is a token (padding rows cost compute and never mix with others).
        zero sizes: any of N, d_in, d_out, r may be 0 (the PyTorch path runs: nothing to compute);
            tensors that require grad get zero gradients of their own shape.

    Raises:
        treadle.distributed.DTensorInputError (a TypeError): a DTensor input (convert it first).
        TypeError: a non-tensor, a non-float dtype, dtypes that differ (gates may be float32), or a
            non-float scalar.
        ValueError: ``L >= 0``, ``U <= 1``, ``tau <= 0``, non-finite scalars, inconsistent shapes,
            tensors on different devices, ``lora_A``/``lora_B`` requiring grad while grad is enabled.
            (All before any work.)
        treadle.dispatch.BackendUnavailableError: ``backend`` cannot run here.
    """
    _refuse_dtensor("gated_lora", x=x, base_out=base_out, lora_A=lora_A, lora_B=lora_B, gate_weight=gate_weight, gate_bias=gate_bias)
    _check_tensor("x", x)
    _check_tensor("base_out", base_out)
    x, base_out, lora_A, lora_B, gate_weight, gate_bias = _autocast_inputs(
        x, (base_out, lora_A, lora_B), gate_weight, gate_bias)
    if base_out.dtype != x.dtype:
        raise TypeError(f"base_out must have x's dtype {x.dtype}, got {base_out.dtype}")
    if base_out.dim() < 1:
        raise ValueError("base_out must have shape (..., d_out), got a scalar")
    d_out = base_out.shape[-1]
    scaling, L, U, tau = _validate(x, d_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, (),
                                   return_lambda)
    if base_out.dim() != x.dim() or base_out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"base_out must have shape {tuple(x.shape[:-1])} + (d_out,) like x's leading dims, "
                         f"got {tuple(base_out.shape)}")
    if base_out.device != x.device:
        raise ValueError(f"base_out is on {base_out.device} but x is on {x.device}; put them on one device")

    lead = x.shape[:-1]
    name = dispatch.resolve(OP, x.device, backend)
    if _zero_size(x, lora_A, d_out):
        name = "reference"  # nothing to compute: the PyTorch path gives the zero-size results and gradients
    # x and base_out go in with their own shapes: a reshape view around the op would make autograd
    # sum x's two gradients (base path + LoRA path) out of place, one more (N, d_in) buffer per backward
    y, _, v = _gated_lora_fwd(
        x.contiguous(), base_out.contiguous(), lora_A.contiguous(), lora_B.contiguous(), gate_weight.contiguous(),
        gate_bias.reshape(1), scaling, L, U, tau, name)
    if return_lambda:
        return y, _lambda(v, L, U).reshape(lead)
    return y


def gated_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    *,
    scaling: float,
    L: float,
    U: float,
    tau: float,
    return_lambda: bool = False,
    backend: str | None = None,
):
    """:func:`gated_lora` with the frozen base linear fused in: ``y = x W^T (+ bias) + lambda * scaling * (x A^T) B^T``.

    Same maths and gate as :func:`gated_lora` (SCALE sec. 3.3), for the case the base layer is a plain
    ``nn.Linear`` (PEFT's ``base_layer``). Fusing it lets the C++ kernel add the gated expand into the
    base GEMM's output in place, and form ``dx = dy W + (s * (dy B)) A`` with the LoRA term added in
    place to the base GEMM's ``dx``: no separate ``base_out`` buffer, no separate LoRA ``dx`` buffer and
    no autograd sum of the two (the CPU analogue of fusing the expand into the GEMM epilogue). The
    ``triton`` backend runs the whole forward as one persistent GEMM with the shrink on the base GEMM's
    x tiles and the gated expand in each output tile's epilogue (no ``base_out`` read or written
    twice), and the backward's ``dx`` the same way; it needs 16-bit x on a GPU, rows whose byte
    length is a multiple of 16 and ``r <= 32``, and otherwise (and on the ``reference`` backend)
    runs the base GEMM with torch and then the unfused op.

    Args:
        x: ``(..., d_in)`` float16/bfloat16/float32/float64.
        weight: ``(d_out, d_in)`` the base layer's weight (frozen: must not require grad), x's dtype.
        bias: ``(d_out,)`` or None, the base layer's bias (frozen), x's dtype.
        lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, return_lambda, backend: as
            :func:`gated_lora`.

    Returns:
        ``y (..., d_out)`` in x's dtype, or ``(y, lambda)``.

    Gradients: ``x`` (base path ``dy W`` and LoRA path), ``gate_weight``, ``gate_bias``; none for
    ``weight``, ``bias``, ``lora_A``, ``lora_B``.

    Contract: as :func:`gated_lora` (dtypes, autocast, zero sizes); under autocast the base
    ``weight`` and ``bias`` are cast to the autocast dtype too, like ``F.linear``.

    Raises:
        treadle.distributed.DTensorInputError (a TypeError): a DTensor input (convert it first).
        TypeError / ValueError: as :func:`gated_lora`; also a weight/bias of the wrong shape, dtype or
            device, or one that requires grad while grad is enabled.
    """
    _refuse_dtensor("gated_lora_linear", x=x, weight=weight, bias=bias, lora_A=lora_A, lora_B=lora_B, gate_weight=gate_weight, gate_bias=gate_bias)
    _check_tensor("x", x)
    _check_tensor("weight", weight)
    if bias is not None:
        _check_tensor("bias", bias)
    x, (weight, bias, lora_A, lora_B), gate_weight, gate_bias = _autocast_inputs(
        x, (weight, bias, lora_A, lora_B), gate_weight, gate_bias, nested=True)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (d_out, d_in={x.shape[-1] if x.dim() else '?'}), "
                         f"got {tuple(weight.shape)}")
    d_out = weight.shape[0]
    if bias is not None:
        _check_tensor("bias", bias)
        if bias.dtype != x.dtype:
            raise TypeError(f"bias must have x's dtype {x.dtype}, got {bias.dtype}")
        if tuple(bias.shape) != (d_out,):
            raise ValueError(f"bias must have shape (d_out={d_out},) or be None, got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; put them on one device")
    scaling, L, U, tau = _validate(x, d_out, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau,
                                   (("weight", weight), ("bias", bias)), return_lambda)
    lead = x.shape[:-1]
    name = dispatch.resolve(OP_LINEAR, x.device, backend)
    if _zero_size(x, lora_A, d_out):
        name = "reference"  # nothing to compute: the PyTorch path gives the zero-size results and gradients
    y, _, v = _gated_lora_linear_fwd(
        x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), lora_A.contiguous(),
        lora_B.contiguous(), gate_weight.contiguous(), gate_bias.reshape(1), scaling, L, U, tau, name)
    if return_lambda:
        return y, _lambda(v, L, U).reshape(lead)
    return y


def triton_base_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` by the Triton GEMM that :func:`gated_lora_linear` fuses the LoRA into, with
    the LoRA off: a benchmark yardstick (time it against ``F.linear``, i.e. cuBLAS, to see what the
    fused op's GEMM costs before the LoRA), not a training op (no autograd).

    Needs what the fused path needs: a CUDA tensor (or the CPU interpreter) in float16/bfloat16,
    ``x (..., d_in)`` and ``weight (d_out, d_in)`` contiguous with ``d_in`` and ``d_out`` multiples
    of 8, ``bias (d_out,)`` or None in x's dtype.

    Raises:
        TypeError / ValueError: inputs the fused GEMM cannot take (before any work).
    """
    from treadle.triton_kernels import scale_fused

    _check_tensor("x", x)
    _check_tensor("weight", weight)
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"weight and bias must have x's dtype {x.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (d_out, d_in={x.shape[-1] if x.dim() else '?'}), "
                         f"got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape (d_out={weight.shape[0]},) or be None, got {tuple(bias.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    if not scale_fused.applies(x, weight, 0):
        raise ValueError("the fused Triton GEMM cannot take these inputs (it needs float16/bfloat16 on a GPU, "
                         "d_in and d_out multiples of 8, at least one token)")
    with torch.no_grad():
        return scale_fused.base_linear(x, weight, None if bias is None else bias.contiguous())

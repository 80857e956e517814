"""``treadle.ops.stair_readout``: STAIR's fused reflected-attention bank read-out (forward + backward).

Backends: ``reference`` (treadle.reference.stair; materialises ``T x M``), ``cpp``
(csrc/cpu/stair_readout.cpp: one pass over bank tiles with online-softmax accumulators for s,
s + t and t, BLAS tile GEMMs, OpenMP over (batch, head, query tile)), ``triton``
(triton_kernels/stair.py: the same algorithm for GPUs, with the reflection logit as one extra
16-wide MMA step on the ``Q K^T`` accumulator, TMA loads and Hopper warp specialisation on sm_90;
CPU tensors under ``TRITON_INTERPRET=1``).

Autograd (registered on the ``torch.library`` custom op, so ``torch.compile(fullgraph=True)``
traces through it): gradients for ``q`` and ``normals``; the bank is detached by design. The
forward saves q, the bank, the normals, two fp32 row vectors per query (``O_R`` and ``Y``) and two
row statistics (``lse_s``, ``log Z``); the backward recomputes each bank tile (``S = Q K^T``,
``G = dO V^T``, then ``dS K``; the Triton kernel also accumulates ``dT K``, from which the epilogue
forms the reflection's share of dq and d normals). The derivation is in the header of
csrc/cpu/stair_readout.cpp and in :func:`stair_readout`'s docstring.
"""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from treadle.ops.dtensor import refuse_dtensor as _refuse_dtensor
from treadle import dispatch
from treadle.ops import _amp
from treadle.ops._values import values_readable
from treadle.reference.stair import MODES, stair_readout_reference

OP = "stair_readout"
dispatch.register(OP, cpu=("cpp",), gpu=("triton",))

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
# out = a * O_R + b * O_ref
_COEF = {"diff": (1.0, -1.0), "reflected": (1.0, 0.0), "reference": (0.0, 1.0)}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.compiler.assume_constant_result
def _resolve_backend(device_type: str, backend: str | None) -> str:
    # evaluated once at trace time under torch.compile (the choice depends on the environment only)
    return dispatch.resolve(OP, device_type, backend)


@torch.library.custom_op("treadle::stair_readout", mutates_args=())
@_amp.no_autocast
def _stair_fwd_op(
    q: torch.Tensor,
    k_bank: torch.Tensor,
    v_bank: torch.Tensor,
    normals: torch.Tensor,
    bank_lengths: torch.Tensor | None,
    eps: float,
    scale: float,
    mode: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = _COEF[mode]
    if backend == "reference":
        acc = _acc_dtype(q.dtype)  # computed in the accumulation dtype, cast once at the end
        out = stair_readout_reference(q.to(acc), k_bank.to(acc), v_bank.to(acc), normals.to(acc),
                                      bank_lengths=bank_lengths, eps=eps, scale=scale, mode=mode).to(q.dtype)
        B, Hq, T, _ = q.shape
        Dv = v_bank.shape[-1]
        return (out, q.new_zeros((B, Hq, T, 2, Dv), dtype=acc), q.new_zeros((B, Hq, T, 2), dtype=acc))
    if backend == "triton":
        from treadle.triton_kernels.stair import stair_readout_fwd_triton

        return stair_readout_fwd_triton(q, k_bank, v_bank, normals, bank_lengths, eps, scale, a, b)
    from treadle import _extension

    out, rows, stats = _extension.op(OP)(q, k_bank, v_bank, normals, bank_lengths, eps, scale, a, b)
    return out, rows, stats


@_stair_fwd_op.register_fake
def _(q, k_bank, v_bank, normals, bank_lengths, eps, scale, mode, backend):
    B, Hq, T, _ = q.shape
    Dv = v_bank.shape[-1]
    acc = _acc_dtype(q.dtype)
    return (q.new_empty((B, Hq, T, Dv)), q.new_empty((B, Hq, T, 2, Dv), dtype=acc),
            q.new_empty((B, Hq, T, 2), dtype=acc))


@torch.library.custom_op("treadle::stair_readout_backward", mutates_args=())
@_amp.no_autocast
def _stair_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k_bank: torch.Tensor,
    v_bank: torch.Tensor,
    normals: torch.Tensor,
    bank_lengths: torch.Tensor | None,
    rows: torch.Tensor,
    stats: torch.Tensor,
    eps: float,
    scale: float,
    mode: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _COEF[mode]
    if backend == "triton":
        from treadle.triton_kernels.stair import stair_readout_bwd_triton

        return stair_readout_bwd_triton(dout, q, k_bank, v_bank, normals, bank_lengths, rows, stats, eps, scale, a, b)
    from treadle import _extension

    dq, dn = _extension.op("stair_readout_backward")(dout, q, k_bank, v_bank, normals, bank_lengths, rows, stats,
                                                     eps, scale, a, b)
    return dq, dn


@_stair_bwd_op.register_fake
def _(dout, q, k_bank, v_bank, normals, bank_lengths, rows, stats, eps, scale, mode, backend):
    return torch.empty_like(q), torch.empty_like(normals)


def _reference_grads(dout, q, k_bank, v_bank, normals, bank_lengths, eps, scale, mode):
    """Backward of the reference backend: autograd through the literal maths (the ground truth)."""
    acc = _acc_dtype(q.dtype)
    with torch.enable_grad():
        qq = q.detach().to(acc).requires_grad_(True)
        nn_ = normals.detach().to(acc).requires_grad_(True)
        out = stair_readout_reference(qq, k_bank.to(acc), v_bank.to(acc), nn_, bank_lengths=bank_lengths, eps=eps,
                                      scale=scale, mode=mode)
        dq, dn = torch.autograd.grad(out, (qq, nn_), dout.to(out.dtype), allow_unused=True, materialize_grads=True)
    return dq.to(q.dtype), dn.to(normals.dtype)


def _setup_context(ctx, inputs, output):
    q, k_bank, v_bank, normals, bank_lengths, eps, scale, mode, backend = inputs
    _, rows, stats = output
    ctx.save_for_backward(q, k_bank, v_bank, normals, bank_lengths, rows, stats)
    ctx.cfg = (eps, scale, mode, backend)


@_amp.no_autocast
def _backward(ctx, dout, drows, dstats):
    q, k_bank, v_bank, normals, bank_lengths, rows, stats = ctx.saved_tensors
    eps, scale, mode, backend = ctx.cfg
    if dout is None:
        dout = torch.zeros(q.shape[:-1] + v_bank.shape[-1:], dtype=q.dtype, device=q.device)
    if backend == "reference":
        dq, dn = _reference_grads(dout, q, k_bank, v_bank, normals, bank_lengths, eps, scale, mode)
    else:
        dq, dn = _stair_bwd_op(dout.contiguous(), q, k_bank, v_bank, normals, bank_lengths, rows, stats, eps, scale,
                               mode, backend)
    return dq, None, None, dn, None, None, None, None, None


_stair_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check_float(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name} must be a floating tensor (one of {_DTYPES}), got {x.dtype}")


def stair_readout(
    q: torch.Tensor,
    k_bank: torch.Tensor,
    v_bank: torch.Tensor,
    normals: torch.Tensor,
    *,
    bank_lengths: torch.Tensor | None = None,
    eps: float = 0.0,
    scale: float | None = None,
    mode: str = "diff",
    debug: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """STAIR reflected bank read-out (STAIR sec. 3.4 eqs. for pi_ref, pi_R and dr; fused form sec. 4.4).

    For query head h (reading kv head ``h // (Hq // Hkv)``), with ``u = n_h / ||n_h||``,
    ``s_j = scale q . k_j``, ``pi_ref = (1 - eps) softmax(s) + eps / L_b``,
    ``t_j = -2 scale (u . q)(u . k_j)`` (the logit change of the Householder-reflected query
    ``q - 2 u (u . q)``) and ``pi_R_j = pi_ref_j e^{t_j} / sum_i pi_ref_i e^{t_i}``:

    * ``mode="diff"``: ``sum_j (pi_R_j - pi_ref_j) v_j`` (what STAIR injects; with eps = 0 it equals
      ``sdpa(q_reflected) - sdpa(q)``);
    * ``mode="reflected"``: ``sum_j pi_R_j v_j`` (the "direct reflected read" control);
    * ``mode="reference"``: ``sum_j pi_ref_j v_j``.

    Args:
        q: ``(B, Hq, T, D)`` current-turn queries after q_proj/q_norm, already rotated by the caller
            with the auxiliary positions ``M + p``. float16/bfloat16/float32 (float64 for checks).
        k_bank: ``(B, Hkv, M, D)`` bank keys rotated with positions ``0..M-1``; same dtype as q; must
            not require grad (the bank is detached by design).
        v_bank: ``(B, Hkv, M, Dv)`` bank values; same dtype as q; must not require grad.
        normals: ``(Hq, D)`` one reflection normal per query head, any float dtype (normalised
            inside; gets a gradient). A zero normal has no direction and raises.
        bank_lengths: optional ``(B,)`` integer tensor in ``[0, M]`` on q's device; keys at
            ``j >= bank_lengths[b]`` are ignored and the uniform part of ``pi_ref`` spreads over the
            valid ones. A row with an empty bank gets exactly 0.
        eps: uniform mixing weight of ``pi_ref``, in ``[0, 1)``.
        scale: logit scale; default ``D ** -0.5``.
        mode: ``"diff"`` | ``"reflected"`` | ``"reference"``.
        debug: also check q, the bank and the normals for NaN/inf (a host sync), and check
            ``bank_lengths``' range and the normals' lengths on CUDA tensors too (they are always
            checked on CPU; skipped while ``torch.compile`` traces).
        backend: force ``"reference"``, ``"cpp"`` or ``"triton"`` (default: the dispatch rule, see
            :func:`treadle.backends`).

    Returns:
        ``(B, Hq, T, Dv)`` in q's dtype (accumulation in float32, float64 for float64 inputs).

    Contract (every backend; tests/contracts):
        dtypes: q, k_bank, v_bank share one dtype; normals may have any float dtype and are
            normalised in the accumulation dtype (float32, float64 for float64 q), never rounded to
            q's dtype; softmax statistics and accumulators in that dtype; one cast at the end.
            ``dq`` comes back in q's dtype, ``d normals`` in the normals' dtype.
        autocast: under ``torch.autocast`` q, k_bank and v_bank (float16/bfloat16/float32) are cast
            to the autocast dtype, as ``scaled_dot_product_attention`` is; the normals stay as given;
            then the op (and its backward) runs with autocast off, so every backend gives what it
            gives outside autocast on those inputs. float64 inputs are never cast.
        masking: bank slots ``j >= bank_lengths[b]`` are never read into the result or the
            gradient, whatever they hold (NaN, inf, stale data).
        zero sizes: any of B, Hq (= Hkv = 0), T, M, D, Dv may be 0; an empty bank reads exactly 0;
            ``D = 0`` (uniform weights over the bank) runs the PyTorch path; q and the normals get
            gradients of their own shapes.

    Raises:
        treadle.distributed.DTensorInputError (a TypeError): a DTensor input (convert it first).
        TypeError: a non-tensor argument, non-float q/bank/normals, q/k_bank/v_bank dtypes that
            differ, non-integer bank_lengths, ``eps`` / ``scale`` that are not numbers (a string, a
            bool), a non-bool ``debug``.
        ValueError: wrong ranks or shapes (each message names the argument and the expected
            shape), Hq not a multiple of Hkv, D mismatch, tensors on different devices, a bank that
            requires grad, bank_lengths of the wrong shape or out of ``[0, M]``, a zero-length or
            non-finite normal (names the head; checked on CPU, and on CUDA with ``debug=True``),
            eps outside ``[0, 1)``, a non-positive scale, an unknown mode,
            NaN/inf inputs with ``debug=True``.
        treadle.dispatch.BackendUnavailableError: ``backend`` cannot run here.

    Backward (flash-attention style, recomputing tiles): with ``out = a O_R + b O_ref``,
    ``G_j = dO . v_j``, ``PE_j = p_j e^{t_j} / Z``:
    ``dT_j = a pi_R_j (G_j - dO.O_R)``, ``dS_j = (1-eps)[b p_j G_j + a PE_j (G_j - dO.O_R) - p_j dO.Y]``
    with ``Y = b O_s + a (sum_j PE_j v_j - (sum_j PE_j) O_R)``; ``dq = scale dS K + (dT beta) u`` and
    ``dn`` from ``du = sum_t dalpha_t q_t - 2 scale sum_j (sum_t alpha_t dT_tj) k_j`` through the
    normalisation Jacobian ``(I - u u^T) / ||n||``.
    """
    _refuse_dtensor("stair_readout", q=q, k_bank=k_bank, v_bank=v_bank, normals=normals, bank_lengths=bank_lengths)
    for name, x in (("q", q), ("k_bank", k_bank), ("v_bank", v_bank), ("normals", normals)):
        _check_float(name, x)
    amp = _amp.autocast_dtype(q.device.type)
    if amp is not None and q.dtype != torch.float64:  # autocast policy: q, k, v like sdpa; normals as given
        q, k_bank, v_bank = _amp.cast(q, amp), _amp.cast(k_bank, amp), _amp.cast(v_bank, amp)
    if k_bank.dtype != q.dtype or v_bank.dtype != q.dtype:
        raise TypeError(f"q, k_bank and v_bank must share one dtype, got q {q.dtype}, k_bank {k_bank.dtype}, "
                        f"v_bank {v_bank.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, Hq, T, D), got shape {tuple(q.shape)}")
    B, Hq, T, D = q.shape
    if k_bank.dim() != 4:
        raise ValueError(f"k_bank must be 4-D (B, Hkv, M, D), got shape {tuple(k_bank.shape)}")
    _, Hkv, M, _ = k_bank.shape
    if v_bank.dim() != 4:
        raise ValueError(f"v_bank must be 4-D (B, Hkv, M, Dv), got shape {tuple(v_bank.shape)}")
    Dv = v_bank.shape[-1]
    if k_bank.shape[0] != B or k_bank.shape[3] != D:
        raise ValueError(f"k_bank must have shape (B={B}, Hkv, M, D={D}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k_bank.shape)}")
    if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv != 0):
        raise ValueError(f"Hq (q.shape[1] = {Hq}) must be a multiple of Hkv (k_bank.shape[1] = {Hkv})")
    if tuple(v_bank.shape[:3]) != (B, Hkv, M):
        raise ValueError(f"v_bank must have shape (B={B}, Hkv={Hkv}, M={M}, Dv) like k_bank, got "
                         f"{tuple(v_bank.shape)}")
    if normals.dim() != 2 or tuple(normals.shape) != (Hq, D):
        raise ValueError(f"normals must have shape (Hq={Hq}, D={D}), got {tuple(normals.shape)}")
    for name, x in (("k_bank", k_bank), ("v_bank", v_bank), ("normals", normals)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; put all inputs on one device")
    for name, x in (("k_bank", k_bank), ("v_bank", v_bank)):
        if x.requires_grad:
            raise ValueError(f"{name} requires grad, but the STAIR bank is detached by design and gets no gradient; "
                             f"pass {name}.detach()")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for sname, v in (("eps", eps), ("scale", scale)):
        if isinstance(v, (bool, str, bytes)) or (v is None and sname == "eps"):
            raise TypeError(f"{sname} must be a float, got {type(v).__name__} {v!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"debug must be True or False, got {debug!r}")
    eps = float(eps)
    if not (0.0 <= eps < 1.0):
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    scale = float(scale)
    if not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if bank_lengths is not None:
        if not isinstance(bank_lengths, torch.Tensor):
            raise TypeError(f"bank_lengths must be a torch.Tensor of integers, got {type(bank_lengths).__name__}")
        if bank_lengths.dtype not in _INT:
            raise TypeError(f"bank_lengths must be an integer tensor (e.g. torch.int64), got {bank_lengths.dtype}")
        if bank_lengths.dim() != 1 or bank_lengths.shape[0] != B:
            raise ValueError(f"bank_lengths must have shape (B={B},), got {tuple(bank_lengths.shape)}")
        if bank_lengths.device != q.device:
            raise ValueError(f"bank_lengths is on {bank_lengths.device} but q is on {q.device}")
    tracing = not values_readable(q, k_bank, v_bank, normals, bank_lengths) or is_fake(q)  # no data to look at
    checks = not tracing and (q.device.type == "cpu" or debug)
    if checks:
        if bank_lengths is not None and B > 0:
            lo, hi = int(bank_lengths.min()), int(bank_lengths.max())
            if lo < 0 or hi > M:
                raise ValueError(f"bank_lengths must lie in [0, M={M}], got values in [{lo}, {hi}]")
        if Hq > 0 and D > 0:  # D = 0: no direction to reflect, nothing to check
            length = normals.detach().to(torch.float64).norm(dim=-1)
            zero = (length == 0).nonzero().flatten()
            if zero.numel():
                raise ValueError(f"normals[{int(zero[0])}] (query head {int(zero[0])}) has zero length: a zero "
                                 f"normal has no reflection direction")
            bad = (~torch.isfinite(length)).nonzero().flatten()
            if bad.numel():  # a NaN/inf normal would make that head's read-out NaN without a word
                raise ValueError(f"normals[{int(bad[0])}] (query head {int(bad[0])}) contains NaN or inf values: a "
                                 f"reflection normal must be finite")
    if debug and not tracing:
        # the bank is checked over its valid slots only: padding past bank_lengths may hold anything
        slots = None if bank_lengths is None else (
            torch.arange(M, device=q.device)[None, :] < bank_lengths.to(torch.int64)[:, None])[:, None, :, None]
        for name, x in (("q", q), ("k_bank", k_bank), ("v_bank", v_bank), ("normals", normals)):
            finite = torch.isfinite(x)
            if slots is not None and name in ("k_bank", "v_bank"):
                finite = finite | ~slots
            if x.numel() and not bool(finite.all()):
                raise ValueError(f"{name} contains NaN or inf values (debug=True)")
    if B * Hq * T * Dv == 0 or M == 0:  # empty output, or every bank empty: exactly 0 (zero gradients)
        return q.new_zeros((B, Hq, T, Dv)) + 0.0 * q.sum() + 0.0 * normals.sum().to(q.dtype)
    name = _resolve_backend(q.device.type, backend)
    if D == 0:
        name = "reference"  # no query/key dims: uniform weights over the bank, the PyTorch path computes it
    out, _, _ = _stair_fwd_op(q, k_bank, v_bank, normals, bank_lengths, eps, scale, mode, name)
    return out

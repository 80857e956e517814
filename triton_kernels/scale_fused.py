"""Launchers of the fused gated-LoRA GEMMs (kernels: triton_kernels/scale_gemm.py).

``linear_fwd`` runs ``y = x W^T (+ bias) + (s u) B^T`` as one persistent TMA GEMM and returns what
the op saves for backward (``z = [u | x . w]``, ``v``); ``linear_dx`` runs ``dx = dy W + (s p) A`` the
same way and returns the gate's gradients; ``base_linear`` is the same forward GEMM with the LoRA
off (the yardstick for the Triton GEMM against cuBLAS). ``applies`` says whether a call can take this
path (TMA needs 16-byte aligned rows and base pointers); the op falls back to the base GEMM plus the
unfused kernels where it cannot.

Configs are pinned (no autotuning on the device), chosen by the sm_90a ahead-of-time check
(``aot_specs`` in triton_kernels/scale.py): 0 spills, no serialised wgmma, shared memory under the
227 KB limit. Under Triton's CPU interpreter the same kernels run one program per work item with
small tiles, float32 output buffers (the interpreter rounds to 16-bit floats by truncation) and
float32 MMAs.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from treadle.triton_kernels.scale_gemm import (
    _dw_partial_kernel, _pack_rows_kernel, gated_lora_gemm_dx_kernel, gated_lora_gemm_fwd_kernel)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One pinned launch config of the fused GEMMs."""

    BM: int
    BN: int
    BK: int
    NT: int
    """Output tiles per work item: the shrink's extra MMA work is ``RP / (BN * NT)`` of the GEMM."""
    num_warps: int
    num_stages: int
    epi_split: bool = True
    """Store each output tile in two halves (half the epilogue's shared memory)."""
    flat: bool = False
    """Run an item's later tiles as one flattened (tile, k) loop with the epilogue inside, so the
    next tile's loads overlap this tile's epilogue (at 128 x 256 ptxas then serialises wgmma for
    registers, C7512; at 128 x 128 it compiles clean)."""

    @property
    def label(self) -> str:
        return (f"BM{self.BM}-BN{self.BN}-BK{self.BK}-NT{self.NT}-w{self.num_warps}-s{self.num_stages}"
                + ("-split" if self.epi_split else "") + ("-flat" if self.flat else ""))


# sm_90 (H100/H200) configs for 16-bit inputs, pinned by the AOT check (see triton_kernels/scale.py).
# 128 x 256 tiles, BK 64, 3 stages: 213,016 B of shared memory with the split epilogue (4 stages or
# an unsplit epilogue go over the 232,448 B limit); 8 warps (two consumer warpgroups of 64 rows).
# NT = 8 output tiles per item: the shrink's extra MMA is 32 / (256 * 8) = 1.6% of the GEMM. On an
# H200 (bf16, d 4096, r 16, 16K tokens) the LoRA adds 3.1% over the same GEMM with it off at NT 8
# and 9.4% at NT 4, while the LoRA-off GEMM itself is 3% slower at NT 8 (about 66 MB of x in flight
# against the 50 MB L2) and within noise of cuBLAS at NT 4 (bench/results/gpu-2026-12-04/).
FWD_CONFIG = GemmConfig(BM=128, BN=256, BK=64, NT=8, num_warps=8, num_stages=3)
DX_CONFIG = GemmConfig(BM=128, BN=256, BK=64, NT=4, num_warps=8, num_stages=3)
# Alternatives for timing on a device (pass ``config=``), clean under the same check: fewer or more
# tiles per item, and 128 x 128 tiles with the flattened loop (epilogue overlapped, 4 stages).
ALT_CONFIGS = (dataclasses.replace(FWD_CONFIG, NT=4), dataclasses.replace(FWD_CONFIG, NT=16),
               GemmConfig(BM=128, BN=128, BK=64, NT=8, num_warps=8, num_stages=4, flat=True))
# the CPU interpreter: small tiles, and several items and runs even on test-sized shapes
INTERP_CONFIG = GemmConfig(BM=16, BN=32, BK=32, NT=2, num_warps=4, num_stages=1)
GATE_ROWS = 3
# The largest rank the fused path takes: the forward pads r + 3 to 64, the backward r to 32. The AOT
# check compiles every padding this allows (RANK_CHECKS besides the benchmark's 16): at r 32 the
# forward uses 255 registers without spilling; a backward padded to 64 would spill.
MAX_RANK = 32
RANK_CHECKS = (8, 32)
# the gate vector's pieces are scaled by this per level (about the mantissa width of x's dtype)
GATE_SCALE = {torch.bfloat16: 256.0, torch.float16: 2048.0, torch.float32: 1.0}
DW_BLOCK_M, DW_BLOCK_D = 32, 128


def rank_pad(r: int, gate: bool) -> int:
    """Padded rank ``RP``: a power of two >= 16 (``tl.dot``'s minimum) holding ``r`` (+ the gate rows)."""
    return max(16, triton.next_power_of_2(r + (GATE_ROWS if gate else 0)))


def _interp(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def tma_aligned(t: torch.Tensor) -> bool:
    """16-byte aligned base pointer and row strides (what a TMA descriptor over ``t`` needs)."""
    return t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


def applies(x: torch.Tensor, weight: torch.Tensor, r: int) -> bool:
    """Whether the fused path runs this call: 16-bit inputs on a GPU (any float on the CPU
    interpreter), rows whose byte length is a multiple of 16 for every TMA-read or -written tensor,
    16-byte aligned base pointers, and ``r <= 32`` (see ``MAX_RANK``)."""
    if x.device.type not in ("cpu", "cuda") or x.dtype not in (
            (torch.float16, torch.bfloat16, torch.float32) if _interp(x) else (torch.float16, torch.bfloat16)):
        return False
    if r > MAX_RANK or x.dim() < 1 or x.numel() == 0:
        return False
    d_in, d_out = x.shape[-1], weight.shape[0]
    out_bytes = 4 if _interp(x) else x.element_size()
    return (d_in * x.element_size() % 16 == 0 and d_out * x.element_size() % 16 == 0
            and d_in * out_bytes % 16 == 0 and d_out * out_bytes % 16 == 0
            and tma_aligned(x) and tma_aligned(weight))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(t: torch.Tensor, n_items: int, programs: int | None) -> tuple[bool, int]:
    """(persistent, number of programs): on a GPU one program per SM looping over the items; under
    the interpreter one program per item, or ``programs`` persistent ones when given (tests)."""
    if programs is not None:
        return True, max(1, min(n_items, programs))
    if _interp(t):
        return False, n_items
    return True, max(1, min(n_items, _num_sms(t.device.index or 0)))


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if _interp(x) else x.dtype


def _pack(src: torch.Tensor, rows: int, rp: int, d: int, dtype: torch.dtype, w: torch.Tensor | None = None):
    """``(rp, d)``: ``src`` (``(rows, d)`` view, any strides) padded with zero rows, plus the gate rows."""
    out = torch.empty((rp, d), dtype=dtype, device=src.device)
    block = 256
    _pack_rows_kernel[(rp, triton.cdiv(d, block))](
        src, src.stride(0), src.stride(1), src if w is None else w, out, rows, d, GATE_SCALE[dtype],
        GATE=w is not None, BLOCK_D=block)
    return out


def _desc(t: torch.Tensor, block) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, list(block))


def _flags(x: torch.Tensor):
    return dict(IEEE=x.dtype == torch.float32, UPCAST=_interp(x))


def linear_fwd(x, weight, bias, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau, *, lora=True,
               config: GemmConfig | None = None, programs: int | None = None):
    """``(y, z (N, r + 1), v (N,) fp32)`` for contiguous ``x (..., d_in)``, ``weight (d_out, d_in)``;
    with ``lora=False`` only ``y = x W^T (+ bias)`` (z and v are None)."""
    d_in = x.shape[-1]
    n = x.numel() // d_in
    d_out = weight.shape[0]
    cfg = config or (INTERP_CONFIG if _interp(x) else FWD_CONFIG)
    x2 = x.reshape(n, d_in)
    y = torch.empty((n, d_out), dtype=_out_dtype(x), device=x.device)
    x_desc = _desc(x2, (cfg.BM, cfg.BK))
    w_desc = _desc(weight, (cfg.BN, cfg.BK))
    y_desc = _desc(y, (cfg.BM, cfg.BN // 2 if cfg.epi_split else cfg.BN))
    if lora:
        r = lora_A.shape[0]
        rp = rank_pad(r, gate=True)
        a_pack = _pack(lora_A, r, rp, d_in, x.dtype, gate_weight)
        bt_pack = _pack(lora_B.t(), r, rp, d_out, x.dtype)
        a_desc, bt_desc = _desc(a_pack, (rp, cfg.BK)), _desc(bt_pack, (rp, cfg.BN))
        z = torch.empty((n, r + 1), dtype=_out_dtype(x), device=x.device)
        v = torch.empty((n,), dtype=torch.float32, device=x.device)
        gb = gate_bias
    else:
        r, rp = 0, 16
        a_desc = bt_desc = x_desc
        z = v = None
        gb = x
    runs = triton.cdiv(triton.cdiv(d_out, cfg.BN), cfg.NT)
    n_items = triton.cdiv(n, cfg.BM) * runs
    persistent, progs = _grid(x, n_items, programs)
    gated_lora_gemm_fwd_kernel[(progs,)](
        x_desc, w_desc, a_desc, bt_desc, y_desc, bias, gb, x if z is None else z, x if v is None else v,
        float(scaling), float(L), float(U), float(1.0 / tau), GATE_SCALE[x.dtype],
        n, d_out, d_in, r, progs,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, RP=rp, NT=cfg.NT, LORA=lora, HAS_BIAS=bias is not None,
        EPI_SPLIT=cfg.epi_split, PERSISTENT=persistent, FLAT=cfg.flat, **_flags(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    y = y.reshape(*x.shape[:-1], d_out).to(x.dtype)
    if not lora:
        return y
    return y, z.to(x.dtype), v


def base_linear(x, weight, bias=None, *, config: GemmConfig | None = None, programs: int | None = None):
    """``x W^T (+ bias)`` by the fused kernel with the LoRA off (no autograd): the Triton GEMM the
    fused op stands on, for timing against ``F.linear`` (cuBLAS)."""
    return linear_fwd(x, weight, bias, None, None, None, None, 1.0, -1.0, 2.0, 1.0, lora=False, config=config,
                      programs=programs)


def dw_from_dg(x2: torch.Tensor, dg: torch.Tensor):
    """``(x^T dg (d_in,), sum dg (1,))`` in fp32: one streaming pass over x, row splits summed in a
    fixed order."""
    n, d = x2.shape
    if _interp(x2):
        splits = min(4, triton.cdiv(n, DW_BLOCK_M))
    else:
        want = 4 * _num_sms(x2.device.index or 0)
        splits = max(1, min(triton.cdiv(n, 8 * DW_BLOCK_M), want // triton.cdiv(d, DW_BLOCK_D)))
    rows = triton.cdiv(triton.cdiv(n, splits), DW_BLOCK_M) * DW_BLOCK_M
    splits = triton.cdiv(n, rows)
    part = torch.empty((splits, d), dtype=torch.float32, device=x2.device)
    _dw_partial_kernel[(triton.cdiv(d, DW_BLOCK_D), splits)](
        x2, dg, part, n, d, rows, BLOCK_M=DW_BLOCK_M, BLOCK_D=DW_BLOCK_D)
    return part.sum(0), dg.sum().reshape(1)


def linear_dx(grad_y, x, weight, lora_A, lora_B, z, v, scaling, L, U, tau, need_dgate, *,
              config: GemmConfig | None = None, programs: int | None = None):
    """``(dx = dy W + (s p) A, dw (d_in,) fp32, db (1,) fp32)``; ``grad_y`` contiguous."""
    d_in = x.shape[-1]
    n = x.numel() // d_in
    d_out, r = lora_B.shape
    rp = rank_pad(r, gate=False)
    dg = torch.empty((n,), dtype=torch.float32, device=x.device)
    dx = _launch_dx(grad_y.reshape(n, d_out), weight, _pack(lora_B.t(), r, rp, d_out, x.dtype),
                    _pack(lora_A, r, rp, d_in, x.dtype), z, v, dg, scaling, L, U, tau, r, rp, True, x, config,
                    programs)
    dx = dx.reshape(x.shape).to(x.dtype)
    if need_dgate:
        dw, db = dw_from_dg(x.reshape(n, d_in), dg)
    else:
        dw = torch.zeros(d_in, dtype=torch.float32, device=x.device)
        db = torch.zeros(1, dtype=torch.float32, device=x.device)
    return dx, dw, db


def base_dx(grad_y, weight, *, config: GemmConfig | None = None, programs: int | None = None):
    """``dy W`` by the backward's fused dx kernel with the LoRA off (no autograd): the Triton GEMM the
    fused backward stands on, for timing against ``dy @ W`` (cuBLAS).

    ``grad_y (..., d_out)`` contiguous, ``weight (d_out, d_in)`` float16/bfloat16 (float32 under the
    interpreter), with what :func:`applies` requires of the fused path; returns ``(n, d_in)`` with
    ``n`` the rows of ``grad_y``, in ``weight``'s dtype (float32 under the interpreter)."""
    n, (d_out, d_in) = grad_y.numel() // weight.shape[0], weight.shape
    rp = rank_pad(16, gate=False)
    dev, dt = weight.device, weight.dtype
    unused = torch.zeros(1, dtype=torch.float32, device=dev)  # z, v and dg are read only with the LoRA on
    return _launch_dx(grad_y.reshape(n, d_out), weight, torch.zeros((rp, d_out), dtype=dt, device=dev),
                      torch.zeros((rp, d_in), dtype=dt, device=dev), unused.to(dt), unused, unused,
                      1.0, -1.0, 2.0, 1.0, 16, rp, False, weight, config, programs)


def _launch_dx(dy2, weight, bt_pack, a_pack, z, v, dg, scaling, L, U, tau, r, rp, lora, x, config, programs):
    """One launch of the fused dx GEMM over ``dy2 (n, d_out)``: ``dx (n, d_in)``; ``x``'s dtype and
    device choose the output dtype, the MMA flags and the config (as in the forward)."""
    n, d_out = dy2.shape
    d_in = weight.shape[1]
    cfg = config or (INTERP_CONFIG if _interp(x) else DX_CONFIG)
    dx = torch.empty((n, d_in), dtype=_out_dtype(x), device=x.device)
    runs = triton.cdiv(triton.cdiv(d_in, cfg.BN), cfg.NT)
    persistent, progs = _grid(x, triton.cdiv(n, cfg.BM) * runs, programs)
    gated_lora_gemm_dx_kernel[(progs,)](
        _desc(dy2, (cfg.BM, cfg.BK)), _desc(weight, (cfg.BK, cfg.BN)), _desc(bt_pack, (rp, cfg.BK)),
        _desc(a_pack, (rp, cfg.BN)), _desc(dx, (cfg.BM, cfg.BN // 2 if cfg.epi_split else cfg.BN)), z, v, dg,
        float(scaling), float(L), float(U), float(1.0 / tau),
        n, d_in, d_out, r, progs,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, RP=rp, NT=cfg.NT, LORA=lora,
        EPI_SPLIT=cfg.epi_split, PERSISTENT=persistent, FLAT=cfg.flat, **_flags(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dx

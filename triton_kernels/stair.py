"""Launchers and pinned launch configs of STAIR's reflected bank read-out Triton kernels (spec:
treadle/reference/stair.py; kernels: triton_kernels/stair_fwd.py and stair_bwd.py, whose headers
give the maths).

The launcher precomputes two small operands that put the reflection logit into the tensor cores:
``QX`` (one ``XW``-wide row per query) and ``KX`` (one per bank key and kv head) with
``QX[t] . KX[j] = alpha_t (-2 u_h . k_j)``, ``alpha_t = u_h . q_t``. Each product is split hi/lo in
q's dtype (``a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi``, about 16 significant bits in bf16; exact
for fp32, where lo = 0), three columns per query head; the ``GROUP = Hq / Hkv`` heads of a kv head
share its KX rows in disjoint column slots, so KX costs ``XW / D`` of K's bytes (1/8 at D 128).

Configs are pinned per (dtype, head dims, eps > 0, GPU generation), never autotuned: each was
compiled ahead of time for sm_90a (:func:`aot_specs`, ``bench/gpu_aot.py``) and kept only with 0
spills, no wgmma serialisation warning (ptxas C7511/C7515) and shared memory within Hopper's 227 KB.
On Hopper (sm_90) with 16-bit inputs whose head dims are multiples of 8 (16-byte TMA strides) both
kernels load the query tile, K, V and KX by TMA through device-side tensor descriptors
(``triton.set_allocator`` is pointed at a torch allocator for their ~1 KB of scratch per program);
the forward at eps = 0 and head dims <= 128 runs the bank loop warp specialised (the backward's
warp-specialised variant compiles but spills, so it runs on 8 plain warps); everything else runs the
same kernels with pointer loads. Under
``TRITON_INTERPRET=1`` one small config runs on CPU tensors (``INTERPRET_TMA`` switches the
interpreter to the descriptor/warp-specialised variant, which tests use).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton

from treadle.triton_kernels.aot import AotSpec
from treadle.triton_kernels.stair_bwd import _stair_bwd_kernel
from treadle.triton_kernels.stair_fwd import LOG2E, _stair_fwd_kernel, _stair_t_kernel

MAX_HEAD_DIM = 256
_MIN_BLOCK_M = 16  # smallest BLOCK_M of any config (sizes the per-program du buffer)
INTERPRET_TMA = False  # tests set it: the interpreter then runs the TMA / warp-specialised variant
last_configs: dict[str, "Config"] = {}  # the config of the latest launch, per "fwd" / "bwd" (for reports)


@dataclasses.dataclass(frozen=True)
class Config:
    """One pinned launch config of a STAIR kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    ws: bool = False
    t_pre: bool = False
    """eps > 0 forward: the main kernel runs its eps = 0 variant (two accumulators, warp specialised),
    then ``_stair_t_kernel`` (:data:`_T_CONFIG`) runs the third softmax and mixes it in."""

    @property
    def label(self) -> str:
        return (f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"
                + ("-tma" if self.tma else "") + ("-ws" if self.ws else "") + ("-tpre" if self.t_pre else ""))


_INTERPRET = Config(16, 16, 4, 1)  # the interpreter: small and fast to emulate
# _stair_t_kernel (eps > 0, ``t_pre`` configs): one fp32 accumulator and a 16-column logit product
_T_CONFIG = Config(128, 64, 8, 3, tma=True)
# Keyed by (kernel, kind, head dims > 128, eps > 0 (forward only)). Kinds: "tma" = Hopper, 16-bit,
# head dims that TMA can stride; "ptr16" = other 16-bit launches (pointer loads); "fp32" = IEEE fp32
# products on CUDA cores (no wgmma). Chosen by the AOT check (bench/stair_aot.py): the largest
# tiles with 0 spills and no serialised wgmma. BLOCK_M 32 does not use wgmma (its minimum is 64 rows
# per warp group) but mma.sync: the head-dim-256 configs keep 0 spills that way.
_CONFIGS = {
    # eps = 0: the warp-specialised variant (BM 128, BN 64, 4 warps: 1 TMA producer + 2 x 64-row
    # consumers) compiles clean but wrote wrong rows on an H200 (bench shape: max |diff| against two
    # SDPA calls equal to max |out|; interpreter results are right), so it is not launched; of the
    # clean TMA configs 64 x 64 on 4 warps is the fastest (8.8 ms at the bench shape)
    ("fwd", "tma", False, False): Config(64, 64, 4, 3, tma=True),
    # eps > 0: a third accumulator in the same loop; 64 x 32 on 8 warps is its only clean config (its
    # wgmma waits: ptxas C7519) and takes 26.6 ms on an H200 at the bench shape, against 14.8 ms at the
    # best config that spills. ``t_pre=True`` (the eps = 0 kernel, then the third softmax in its own
    # kernel: clean, right under the interpreter) is timed by bench/gpu_sweep.py and is pinned once a
    # device run shows it right and faster
    ("fwd", "tma", False, True): Config(64, 32, 8, 3, tma=True),
    ("fwd", "tma", True, False): Config(64, 16, 8, 2, tma=True),
    ("fwd", "tma", True, True): Config(32, 32, 8, 2, tma=True),
    # backward: warp specialisation compiles (with every pre-loop load by TMA) but spills 400-1000 B at
    # BN 16-32 (two 128 x 128 accumulators per consumer), so plain warps; of the clean configs, 64 x 16
    # on 4 warps is the fastest on an H200 (backward 12.0 ms against 13.2 ms for 128 x 16 on 8 warps)
    ("bwd", "tma", False, None): Config(64, 16, 4, 3, tma=True),
    ("bwd", "tma", True, None): Config(32, 16, 8, 2, tma=True),
    ("fwd", "ptr16", False, False): Config(64, 32, 8, 2),
    ("fwd", "ptr16", False, True): Config(64, 32, 8, 2),
    ("fwd", "ptr16", True, False): Config(32, 32, 8, 2),
    ("fwd", "ptr16", True, True): Config(32, 32, 8, 2),
    ("bwd", "ptr16", False, None): Config(32, 32, 8, 2),
    ("bwd", "ptr16", True, None): Config(16, 16, 8, 2),
    ("fwd", "fp32", False, False): Config(32, 16, 8, 2),
    ("fwd", "fp32", False, True): Config(32, 16, 8, 2),
    ("fwd", "fp32", True, False): Config(16, 16, 8, 2),
    ("fwd", "fp32", True, True): Config(16, 16, 8, 2),
    ("bwd", "fp32", False, None): Config(32, 16, 8, 2),
    ("bwd", "fp32", True, None): Config(16, 16, 8, 2),
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tma_able(dtype: torch.dtype, D: int, Dv: int) -> bool:
    """Row strides of K, V (and q, dq, out) that are multiples of 16 bytes (TMA's stride rule); KX's
    rows are XW >= 16 elements wide."""
    size = torch.empty((), dtype=dtype).element_size()
    return (D * size) % 16 == 0 and (Dv * size) % 16 == 0


def launch_config(which: str, dtype: torch.dtype, D: int, Dv: int, eps_positive: bool,
                  capability: tuple[int, int] | None, interpret: bool = False, aligned: bool = True) -> Config:
    """The pinned config of kernel ``which`` ("fwd" | "bwd") for these inputs.

    ``capability``: the CUDA device's (major, minor), or None off CUDA. ``interpret``: the CPU
    interpreter (one small config; the TMA / warp-specialised variant when :data:`INTERPRET_TMA`).
    ``aligned``: every tensor the kernel reads by TMA starts on a 16-byte boundary (TMA's rule)."""
    if interpret:
        tma = INTERPRET_TMA and aligned and _tma_able(dtype, D, Dv)  # the variant Hopper runs: WS where its config has it
        hopper = _CONFIGS[(which, "tma", False, eps_positive if which == "fwd" else None)]
        return dataclasses.replace(_INTERPRET, tma=tma, ws=tma and hopper.ws, t_pre=tma and hopper.t_pre)
    d_pad, dv_pad = _pads(D, Dv)
    big = max(d_pad, dv_pad) > 128
    if dtype == torch.float32:
        kind = "fp32"
    elif capability is not None and capability[0] == 9 and aligned and _tma_able(dtype, D, Dv):  # Hopper
        kind = "tma"
    else:
        kind = "ptr16"
    return _CONFIGS[(which, kind, big, eps_positive if which == "fwd" else None)]


def _pads(D: int, Dv: int) -> tuple[int, int]:
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        raise ValueError(f"the Triton stair_readout kernel supports head dims D, Dv <= {MAX_HEAD_DIM} (any size up to "
                         f"that, padded to a power of two >= 16); got D={D}, Dv={Dv}")
    return max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))


def _x_layout(Hq: int, Hkv: int) -> tuple[int, int, int]:
    """``(XW, HX, GX)``: KX width, KX heads and query heads per KX head.

    Three columns per query head: the heads of a kv head share its KX rows while ``3 GROUP <= 64``
    (XW 16 up to GROUP 5, 32 up to 10, 64 up to 21); beyond that one KX head per query head."""
    group = Hq // Hkv
    if 3 * group <= 64:
        return max(16, triton.next_power_of_2(3 * group)), Hkv, group
    return 16, Hq, 1


def _split(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    hi = x.to(dtype)
    return hi, (x - hi.to(x.dtype)).to(dtype)


def _x_operands(q, k_bank, u):
    """``(QX (B, Hq, T, XW), KX (B, HX, M, XW), XW, HX, GX)`` in q's dtype (see the module docstring).

    KX rows of slots past a row's bank length may hold anything (they are never loaded)."""
    B, Hq, T, D = q.shape
    Hkv, M = k_bank.shape[1], k_bank.shape[2]
    XW, HX, GX = _x_layout(Hq, Hkv)
    uf = u.float()
    alpha = torch.einsum("bhtd,hd->bht", q.float(), uf)                                 # u . q
    ukb = torch.einsum("bkmd,kgd->bkgm", k_bank.float(), uf.view(Hkv, Hq // Hkv, D))   # u . k, per q head
    ukb = (-2.0 * ukb).reshape(B, HX, GX, M).transpose(-1, -2)
    a_hi, a_lo = _split(alpha, q.dtype)
    b_hi, b_lo = _split(ukb, q.dtype)
    kx = torch.stack((b_hi, b_lo, b_hi), dim=-1).reshape(B, HX, M, 3 * GX)
    kx = torch.nn.functional.pad(kx, (0, XW - 3 * GX))
    qa = torch.stack((a_hi, a_hi, a_lo), dim=-1)                                        # (B, Hq, T, 3)
    qx = q.new_zeros((B, Hq, T, XW))
    for g in range(GX):  # head h's three columns sit in slot h % GX
        qx[:, g::GX, :, 3 * g:3 * g + 3] = qa[:, g::GX]
    return qx, kx.contiguous(), XW, HX, GX


def _buffer_dtype(x: torch.Tensor) -> torch.dtype:
    # the CPU interpreter converts fp32 -> bf16/fp16 by truncation (GPUs round to nearest), so on CPU
    # the kernels write fp32 and torch rounds afterwards
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return x.dtype


def _common(q, k_bank, v_bank, normals, bank_lengths):
    B, Hq, T, D = q.shape
    Hkv, M = k_bank.shape[1], k_bank.shape[2]
    Dv = v_bank.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    nf = normals.to(acc)
    nrm = nf.norm(dim=-1, keepdim=True)
    u = (nf / nrm).contiguous()
    lens = None if bank_lengths is None else bank_lengths.to(torch.int32).contiguous()
    return B, Hq, T, D, Hkv, M, Dv, acc, u, nrm, lens


def _config(which: str, q: torch.Tensor, D: int, Dv: int, eps: float, *tensors: torch.Tensor) -> Config:
    cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    aligned = all(t.data_ptr() % 16 == 0 for t in tensors)  # e.g. a view with an odd storage offset
    cfg = launch_config(which, q.dtype, D, Dv, eps > 0.0, cap, interpret=_interpreting(), aligned=aligned)
    last_configs[which] = cfg
    return cfg


def set_tma_allocator(device: torch.device) -> None:
    """Point Triton's scratch allocator (device-side tensor descriptors) at torch's allocator on ``device``.

    Set before every TMA launch: Triton keeps the allocator in a context variable, and autograd runs
    the backward in another thread."""
    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)


def _launch_options(cfg: Config, interpret: bool, device: torch.device) -> dict:
    if cfg.tma and not interpret:
        set_tma_allocator(device)
    opts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=cfg.tma, WS=cfg.ws)
    if not interpret:
        opts.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return opts


def stair_readout_fwd_triton(q, k_bank, v_bank, normals, bank_lengths, eps, scale, a, b):
    """``(out (B, Hq, T, Dv) q.dtype, rows (B, Hq, T, 2, Dv) fp32, stats (B, Hq, T, 2) fp32)``.

    float64 inputs are computed in float32 (the kernels accumulate in fp32) and returned as float64.
    """
    if q.dtype == torch.float64:
        out, rows, stats = stair_readout_fwd_triton(q.float(), k_bank.float(), v_bank.float(), normals.float(),
                                                    bank_lengths, eps, scale, a, b)
        return out.double(), rows.double(), stats.double()
    B, Hq, T, D, Hkv, M, Dv, acc, u, nrm, lens = _common(q, k_bank, v_bank, normals, bank_lengths)
    d_pad, dv_pad = _pads(D, Dv)
    q_, k_, v_ = q.contiguous(), k_bank.contiguous(), v_bank.contiguous()
    out = torch.empty((B, Hq, T, Dv), dtype=_buffer_dtype(q), device=q.device)
    rows = torch.zeros((B, Hq, T, 2, Dv), dtype=acc, device=q.device)
    stats = torch.zeros((B, Hq, T, 2), dtype=acc, device=q.device)
    if out.numel() == 0:
        return out.to(q.dtype), rows, stats
    use_t = eps > 0.0
    if use_t:  # mean of the valid bank values, per (batch, kv head)
        if lens is None:
            vbar = v_.to(acc).mean(dim=2)
        else:
            valid = torch.arange(M, device=q.device)[None, :] < lens[:, None].long()  # (B, M)
            # where, not a 0/1 product: padded slots may hold NaN/inf (0 * NaN = NaN)
            vsum = torch.where(valid[:, None, :, None], v_.to(acc), 0.0).sum(dim=2)
            vbar = vsum / lens.clamp(min=1).to(acc)[:, None, None]
        vbar = vbar.contiguous()
    else:
        vbar = rows  # unused
    qx, kx, XW, HX, GX = _x_operands(q_, k_, u)
    interp = _interpreting()
    cfg = _config("fwd", q, D, Dv, eps, q_, k_, v_)
    t_pre = use_t and cfg.t_pre  # the eps = 0 kernel, then the third softmax mixed in by its own kernel
    grid = (triton.cdiv(T, cfg.block_m), B * Hq)
    lens_arg = lens if lens is not None else u
    _stair_fwd_kernel[grid](
        q_, k_, v_, qx, kx, lens_arg, vbar, out, rows, stats,
        Hq, Hkv, HX, T, M, D, Dv, Hq // Hkv, GX,
        float(scale) * LOG2E, float(eps), float(a), float(b),
        HAS_LEN=lens is not None, USE_T=use_t and not t_pre, IEEE=q.dtype == torch.float32,
        UPCAST=q.device.type == "cpu" and q.dtype != torch.float32, D_PAD=d_pad, DV_PAD=dv_pad, XW=XW,
        **_launch_options(cfg, interp, q.device),
    )
    if t_pre:
        tcfg = dataclasses.replace(_INTERPRET if interp else _T_CONFIG, tma=cfg.tma, ws=False)
        topts = _launch_options(tcfg, interp, q.device)
        del topts["WS"]
        _stair_t_kernel[(triton.cdiv(T, tcfg.block_m), B * Hq)](
            qx, kx, v_, lens_arg, vbar, out, rows, stats,
            Hq, Hkv, HX, T, M, Dv, Hq // Hkv, GX,
            float(scale) * LOG2E, float(eps), float(a), float(b),
            HAS_LEN=lens is not None, IEEE=q.dtype == torch.float32,
            UPCAST=q.device.type == "cpu" and q.dtype != torch.float32, DV_PAD=dv_pad, XW=XW, **topts,
        )
    return out.to(q.dtype), rows, stats


def _row_stats(dout, rows, stats) -> tuple[torch.Tensor, int]:
    """``(RS (5, B*Hq, T4) fp32, T4)``: per query row, in the exp2 domain ``lse_s``, ``lse_s + log Z``,
    ``log Z``, then ``dO . O_R`` and ``dO . Y``; T4 = T rounded up to 4 (16-byte rows for TMA: the
    kernel loads them as 1-D boxes, since a [BLOCK_M, 5] tile split in registers fails the
    warp-specialisation pass)."""
    B, Hq, T = stats.shape[:3]
    t4 = -(-T // 4) * 4
    rs = torch.zeros((5, B * Hq, t4), dtype=torch.float32, device=stats.device)
    st = stats.float().reshape(B * Hq, T, 2) * LOG2E
    rs[0, :, :T] = st[..., 0]
    rs[1, :, :T] = st[..., 0] + st[..., 1]
    rs[2, :, :T] = st[..., 1]
    g = torch.einsum("bhtv,bhtkv->bhtk", dout.float(), rows.float()).reshape(B * Hq, T, 2)
    rs[3, :, :T] = g[..., 0]
    rs[4, :, :T] = g[..., 1]
    return rs, t4


def stair_readout_bwd_triton(dout, q, k_bank, v_bank, normals, bank_lengths, rows, stats, eps, scale, a, b):
    """``(dq (B, Hq, T, D) q.dtype, dn (Hq, D) normals.dtype)``."""
    if q.dtype == torch.float64:
        dq, dn = stair_readout_bwd_triton(dout.float(), q.float(), k_bank.float(), v_bank.float(), normals.float(),
                                          bank_lengths, rows.float(), stats.float(), eps, scale, a, b)
        return dq.double(), dn.to(normals.dtype)
    B, Hq, T, D, Hkv, M, Dv, acc, u, nrm, lens = _common(q, k_bank, v_bank, normals, bank_lengths)
    d_pad, dv_pad = _pads(D, Dv)
    dq = torch.empty((B, Hq, T, D), dtype=_buffer_dtype(q), device=q.device)
    nqt = triton.cdiv(max(T, 1), _MIN_BLOCK_M)
    du = torch.zeros((B * Hq * nqt, D), dtype=acc, device=q.device)  # d normals' partial sums, per program
    if dq.numel() > 0:
        q_, k_, v_ = q.contiguous(), k_bank.contiguous(), v_bank.contiguous()
        cfg = _config("bwd", q, D, Dv, eps, q_, k_, v_)
        qx, kx, XW, HX, GX = _x_operands(q_, k_, u)
        interp = _interpreting()
        grid = (triton.cdiv(T, cfg.block_m), B * Hq)
        rs, t4 = _row_stats(dout, rows, stats)
        _stair_bwd_kernel[grid](
            dout.contiguous(), q_, k_, v_, qx, kx, u,
            lens if lens is not None else u, rs, dq, du,
            Hq, Hkv, HX, T, t4, M, D, Dv, Hq // Hkv, GX, nqt, B * Hq,
            float(scale), float(scale) * LOG2E, float(eps), float(a), float(b),
            HAS_LEN=lens is not None, USE_R=a != 0.0, USE_E=a != 0.0 and eps > 0.0,
            IEEE=q.dtype == torch.float32, UPCAST=q.device.type == "cpu" and q.dtype != torch.float32,
            D_PAD=d_pad, DV_PAD=dv_pad, XW=XW, **_launch_options(cfg, interp, q.device),
        )
    dusum = du.view(B, Hq, nqt, D).sum(dim=(0, 2))
    dn = (dusum - u * (u * dusum).sum(-1, keepdim=True)) / nrm
    return dq.to(q.dtype), dn.to(normals.dtype)



# ---- ahead-of-time structure check (bench/gpu_aot.py): every config above, as the JIT compiles it ----
_TORCH_TO_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_FWD_ARGS = ("Q", "K", "V", "QX", "KX", "LEN", "VBAR", "OUT", "ROWS", "STATS",
             "Hq", "Hkv", "HX", "T", "M", "D", "DV", "GROUP", "GX", "qk_scale", "eps", "a", "b")
_BWD_ARGS = ("DO", "Q", "K", "V", "QX", "KX", "U", "LEN", "RS", "DQ", "DU",
             "Hq", "Hkv", "HX", "T", "T4", "M", "D", "DV", "GROUP", "GX", "NQT", "BHQ", "scale", "qk_scale", "eps", "a",
             "b")
_T_ARGS = ("QX", "KX", "V", "LEN", "VBAR", "OUT", "ROWS", "STATS", "Hq", "Hkv", "HX", "T", "M", "DV", "GROUP", "GX",
           "qk_scale", "eps", "a", "b")
_NO_SPECIALIZE = ("T", "M")


def _spec(which: str, dtype: torch.dtype, D: int, Dv: int, eps: float, *, has_len: bool = False, a: float = 1.0,
          B: int = 1, Hq: int = 32, Hkv: int = 8, T: int = 4096, M: int = 32768) -> AotSpec:
    """The spec of one launch, with the signature the JIT gives it (the bench shape by default)."""
    cfg = launch_config("fwd" if which == "t" else which, dtype, D, Dv, eps > 0.0, (9, 0))
    d_pad, dv_pad = _pads(D, Dv)
    XW, HX, GX = _x_layout(Hq, Hkv)
    dt = _TORCH_TO_SIG[dtype]
    ints = dict(Hq=Hq, Hkv=Hkv, HX=HX, T=T, M=M, D=D, DV=Dv, GROUP=Hq // Hkv, GX=GX,
                NQT=triton.cdiv(T, _MIN_BLOCK_M), T4=-(-T // 4) * 4, BHQ=B * Hq)
    ptrs = dict(Q=dt, K=dt, V=dt, QX=dt, KX=dt, DO=dt, OUT=dt, DQ=dt, LEN="i32" if has_len else "fp32",
                U="fp32", VBAR="fp32", ROWS="fp32", STATS="fp32", DU="fp32", RS="fp32")
    constexprs = dict(HAS_LEN=has_len, IEEE=dtype == torch.float32, UPCAST=False, TMA=cfg.tma, WS=cfg.ws,
                      D_PAD=d_pad, DV_PAD=dv_pad, XW=XW, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    if which == "t":  # the eps > 0 third softmax of a t_pre forward config, at its own config
        cfg = dataclasses.replace(_T_CONFIG, tma=cfg.tma)
        args, fn = _T_ARGS, _stair_t_kernel
        constexprs.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        for name in ("D_PAD", "WS"):
            constexprs.pop(name)
    elif which == "fwd":
        args, fn = _FWD_ARGS, _stair_fwd_kernel
        constexprs["USE_T"] = eps > 0.0 and not cfg.t_pre
    else:
        args, fn = _BWD_ARGS, _stair_bwd_kernel
        constexprs.update(USE_R=a != 0.0, USE_E=a != 0.0 and eps > 0.0)
    sig, div16 = {}, []
    for name in args:
        if name in ptrs:
            sig[name], _ = "*" + ptrs[name], div16.append(name)
        elif name in ints:
            val = ints[name]
            if val == 1 and name not in _NO_SPECIALIZE:  # the JIT turns an int equal to 1 into a constant
                sig[name], constexprs[name] = "constexpr", 1
            else:
                sig[name] = "i32"
                if val % 16 == 0 and name not in _NO_SPECIALIZE:
                    div16.append(name)
        else:
            sig[name] = "fp32"
    sig.update({name: "constexpr" for name in constexprs if name not in sig})
    sig = {name: sig[name] for name in fn.arg_names}  # the kernel's argument order (attrs go by index)
    label = (f"{dt}-D{D}-Dv{Dv}-eps{eps:g}" + ("-len" if has_len else "") + ("" if a else "-a0")
             + f"-{cfg.label}")
    wgmma = dtype != torch.float32 and cfg.block_m >= 64
    return AotSpec(kernel=f"stair_{which}", config=label, fn=fn, signature=sig, constexprs=constexprs,
                   divisible_by_16=tuple(div16), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                   expect_wgmma=wgmma, expect_tma=cfg.tma, expect_warp_specialized=cfg.ws and which != "t",
                   global_scratch=cfg.tma)


def aot_specs() -> list[AotSpec]:
    """Every pinned config the op launches on an sm_90 GPU, at the bench shape (T 4096, M 32K, Hq 32,
    Hkv 8) and, for the other configs, at head dims that select them (fp32; D 256; D 59, which TMA
    cannot stride; D 64; a bank-length vector; mode "reference", whose backward has no reflection)."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    # (dtype, head dim, eps): D 128 / 64 / 256 select the TMA configs, D 100 / 250 (not 16-byte strides)
    # the 16-bit pointer configs, fp32 its own
    shapes = [(bf16, 128, 0.0), (bf16, 128, 0.1), (fp16, 128, 0.0), (fp16, 128, 0.1), (bf16, 64, 0.0),
              (bf16, 256, 0.0), (bf16, 256, 0.1), (bf16, 100, 0.0), (bf16, 100, 0.1), (bf16, 250, 0.0),
              (bf16, 250, 0.1), (fp32, 128, 0.0), (fp32, 128, 0.1), (fp32, 256, 0.0), (fp32, 256, 0.1)]
    specs = [_spec("fwd", dt, d, d, e) for dt, d, e in shapes]
    # the third-softmax kernel of a t_pre forward (pinned, or timed by bench/gpu_sweep.py at the bench
    # shape; its main kernel is the eps = 0 variant, compiled above)
    specs += [_spec("t", dt, d, d, e) for dt, d, e in shapes
              if e > 0 and (launch_config("fwd", dt, d, d, True, (9, 0)).t_pre or (d == 128 and dt != fp32))]
    specs.append(_spec("fwd", bf16, 128, 128, 0.0, has_len=True, B=2))
    specs += [_spec("bwd", dt, d, d, e) for dt, d, e in shapes if e > 0 or dt == bf16 and d == 128]
    specs.append(_spec("bwd", bf16, 128, 128, 0.0, a=0.0))
    return specs

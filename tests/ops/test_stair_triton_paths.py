"""The STAIR read-out's Triton launch paths as far as a CPU can exercise them.

* The TMA / warp-specialised kernel variant (device-side tensor descriptors, ``tl.range(...,
  warp_specialize=True)``) runs under ``TRITON_INTERPRET=1`` and matches the float64 reference within
  the tolerance rule (CONVENTIONS.md: <= 2x / 3x the plain-PyTorch error), like the pointer variant.
* The reflection logit's hi/lo operands ``QX . KX`` reproduce ``alpha (-2 u . k)`` to ~16 bits.
* Config selection (Hopper / other GPUs / fp32 / head dims / eps), the TMA allocator, and the AOT
  specs (every config an sm_90 launch can pick, with the kernels' own argument lists).
"""
import os
import sys

import pytest
import torch

from treadle.triton_kernels import stair as ks
from treadle.triton_kernels.aot import AotSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "stair"))
from test_stair_readout import _check  # noqa: E402  (the reference comparison with the tolerance rule)

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.fixture
def tma_in_interpreter(monkeypatch):
    monkeypatch.setattr(ks, "INTERPRET_TMA", True)
    ks.last_configs.clear()
    yield
    for which in ("fwd", "bwd"):
        assert ks.last_configs[which].tma, f"the descriptor variant of {which} did not run"


# (B, Hq, Hkv, T, M, D, Dv): odd T / M (ragged last tiles), GQA, D != Dv, lengths with an empty row
TMA_CASES = [
    ((1, 4, 1, 19, 37, 16, 32), {}),
    ((2, 2, 1, 5, 23, 32, 16), {"lengths": [23, 0], "eps": 0.1}),
    ((1, 2, 2, 3, 9, 24, 24), {"mode": "reflected", "eps": 0.2}),
    ((2, 4, 2, 6, 21, 16, 16), {"lengths": [7, 21], "mode": "reference"}),
    ((1, 2, 1, 4, 12, 16, 16), {"kscale": 30.0}),  # large logits
]


@interp
@pytest.mark.parametrize("dims,kw", TMA_CASES)
def test_tma_variant_matches_reference_fp32(tma_in_interpreter, dims, kw):
    _check("triton", dims, torch.float32, **kw)
    # the variants Hopper launches (warp specialised where the pinned config says so); at eps > 0 the
    # third softmax's own kernel after the eps = 0 loop (t_pre)
    pinned = ks._CONFIGS[("fwd", "tma", False, kw.get("eps", 0.0) > 0.0)]
    assert ks.last_configs["fwd"].ws == pinned.ws
    assert ks.last_configs["fwd"].t_pre == (kw.get("eps", 0.0) > 0.0 and pinned.t_pre)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims,kw", [c for c in TMA_CASES if c[1].get("eps", 0.0) > 0.0]
                         + [((2, 4, 2, 6, 21, 16, 16), {"lengths": [7, 0], "eps": 0.3})])
def test_eps_forward_in_two_kernels_matches_reference(tma_in_interpreter, monkeypatch, dims, kw, dtype):
    """eps > 0 with ``t_pre``: the eps = 0 kernel, then ``_stair_t_kernel`` mixes the third softmax into
    the written out / rows / stats; the backward reads them as it reads the one-loop forward's."""
    key = ("fwd", "tma", False, True)
    monkeypatch.setitem(ks._CONFIGS, key, ks.Config(64, 64, 4, 3, tma=True, t_pre=True))
    _check("triton", dims, dtype, **kw)
    assert ks.last_configs["fwd"].t_pre


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_variant_matches_reference_half(tma_in_interpreter, dtype):
    _check("triton", (1, 4, 2, 7, 29, 16, 16), dtype)
    _check("triton", (2, 2, 1, 5, 20, 16, 16), dtype, eps=0.1, lengths=[17, 3])


@interp
def test_unaligned_head_dim_falls_back_to_pointer_loads(monkeypatch):
    monkeypatch.setattr(ks, "INTERPRET_TMA", True)
    _check("triton", (1, 2, 1, 5, 9, 59, 37), torch.float32, lengths=[6])  # 59 * 4 B: not 16-byte rows
    assert not ks.last_configs["fwd"].tma and not ks.last_configs["bwd"].tma


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (4, 4), (12, 1), (64, 2)])
def test_reflection_operands_reproduce_alpha_beta(dtype, Hq, Hkv):
    """``QX[t] . KX[j] = alpha_t (-2 u . k_j)`` with fp32 accumulation: ~16 bits in bf16 (hi/lo split)."""
    gen = torch.Generator().manual_seed(1)
    B, T, M, D = 2, 5, 7, 32
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = (3 * torch.randn(B, Hkv, M, D, generator=gen)).to(dtype)
    u = torch.nn.functional.normalize(torch.randn(Hq, D, generator=gen, dtype=torch.float64), dim=-1).float()
    qx, kx, XW, HX, GX = ks._x_operands(q, k, u)
    assert XW % 16 == 0 and XW >= 3 * GX and qx.shape == (B, Hq, T, XW) and kx.shape == (B, HX, M, XW)
    khead = torch.arange(Hq) // GX                                           # the KX head of each query head
    got = torch.einsum("bhtx,bhmx->bhtm", qx.double(), kx[:, khead].double())
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)
    want = torch.einsum("bhtd,hd->bht", q.double(), u.double())[..., None] * \
        (-2.0 * torch.einsum("bhmd,hd->bhm", kk, u.double()))[:, :, None, :]
    rel = {torch.float32: 1e-6, torch.bfloat16: 2 ** -14, torch.float16: 2 ** -18}[dtype]
    assert (got - want).abs().max() <= rel * want.abs().max() + 1e-6


HOPPER, AMPERE = (9, 0), (8, 0)


def test_launch_config_selection():
    cfg = ks.launch_config
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert cfg("fwd", bf16, 128, 128, False, HOPPER) == ks.Config(64, 64, 4, 3, tma=True)
    assert cfg("fwd", fp16, 64, 64, False, HOPPER).tma
    eps_cfg = cfg("fwd", bf16, 128, 128, True, HOPPER)   # eps > 0: its own config (a third accumulator)
    assert eps_cfg.tma and not eps_cfg.ws and eps_cfg.block_m == 64
    assert cfg("bwd", bf16, 128, 128, True, HOPPER).tma
    assert not cfg("fwd", bf16, 59, 59, False, HOPPER).tma          # 118-byte rows: pointer loads
    assert not cfg("fwd", bf16, 128, 128, False, AMPERE).tma       # TMA/WS only on sm_90
    assert not cfg("fwd", bf16, 128, 128, False, None).tma
    f32 = cfg("fwd", fp32, 128, 128, False, HOPPER)
    assert not f32.tma and not f32.ws
    assert cfg("fwd", bf16, 256, 200, False, HOPPER).block_m <= 64   # head dims 256: smaller tiles
    small = cfg("fwd", bf16, 128, 128, False, HOPPER, interpret=True)
    assert (small.block_m, small.block_n, small.tma) == (16, 16, ks.INTERPRET_TMA)
    every = set(ks._CONFIGS.values())
    assert all(c.block_m % ks._MIN_BLOCK_M == 0 for c in every | {ks._INTERPRET})  # sizes the du buffer
    assert all(c.num_warps == 4 for c in every if c.ws)  # Triton's Hopper auto-WS needs exactly 4 warps


@interp
def test_misaligned_view_falls_back_to_pointer_loads(monkeypatch):
    """A bank whose storage starts off a 16-byte boundary (a flat view at offset 1) cannot be a TMA base."""
    monkeypatch.setattr(ks, "INTERPRET_TMA", True)
    gen = torch.Generator().manual_seed(3)
    q, v = torch.randn(1, 2, 5, 16, generator=gen), torch.randn(1, 1, 9, 16, generator=gen)
    n = torch.randn(2, 16, generator=gen)
    k = torch.randn(1 + 9 * 16, generator=gen)[1:].view(1, 1, 9, 16)
    assert k.is_contiguous() and k.data_ptr() % 16 != 0
    from treadle.ops import stair_readout
    from treadle.reference.stair import stair_readout_reference
    got = stair_readout(q, k, v, n, backend="triton")
    assert not ks.last_configs["fwd"].tma
    torch.testing.assert_close(got, stair_readout_reference(q, k, v, n).float(), atol=2e-6, rtol=0)
    assert not ks.launch_config("fwd", torch.bfloat16, 128, 128, False, HOPPER, aligned=False).tma


def test_head_dim_limit_is_named():
    with pytest.raises(ValueError, match=r"D, Dv <= 256"):
        ks.launch_config("fwd", torch.bfloat16, 300, 128, False, HOPPER)


def test_tma_allocator_returns_device_scratch(monkeypatch):
    seen = []
    monkeypatch.setattr(ks.triton, "set_allocator", seen.append)
    ks.set_tma_allocator(torch.device("cpu"))
    buf = seen[-1](640, 128, None)
    assert isinstance(buf, torch.Tensor) and buf.numel() == 640 and buf.device.type == "cpu"
    seen.clear()
    opts = ks._launch_options(ks.Config(128, 64, 4, 2, tma=True, ws=True), False, torch.device("cpu"))
    assert seen and opts == dict(BLOCK_M=128, BLOCK_N=64, TMA=True, WS=True, num_warps=4, num_stages=2)
    seen.clear()
    ks._launch_options(ks.Config(64, 32, 8, 2), False, torch.device("cpu"))
    assert not seen  # pointer configs need no scratch


def test_aot_specs_cover_every_sm90_config():
    specs = ks.aot_specs()
    assert all(isinstance(s, AotSpec) for s in specs)
    labels = [(s.kernel, s.config) for s in specs]
    assert len(labels) == len(set(labels))
    launched = {s.config.split("-", 4)[-1] for s in specs}
    for (which, kind, big, eps), c in ks._CONFIGS.items():
        assert c.label in launched, f"no AOT spec for {which} {kind} {c.label}"
    for s in specs:
        names = s.fn.arg_names
        assert list(s.signature) == names, s.config
        assert set(s.divisible_by_16) <= set(s.signature) and not {"T", "M"} & set(s.divisible_by_16)
        for name, typ in s.signature.items():
            assert (typ == "constexpr") == (name in s.constexprs), name
        assert s.expect_tma == s.constexprs["TMA"] == s.global_scratch
        assert s.expect_warp_specialized == s.constexprs.get("WS", False)  # the t kernel has no WS
        assert s.expect_wgmma == (not s.constexprs["IEEE"] and s.constexprs["BLOCK_M"] >= 64)
    bench = [s for s in specs if s.config.startswith("bf16-D128-Dv128-eps0-BM")]
    fwd = next(s for s in bench if s.kernel == "stair_fwd")
    assert fwd.expect_tma and fwd.expect_wgmma and fwd.num_warps == 4
    assert {"Q", "K", "V", "Hq", "D", "DV"} <= set(fwd.divisible_by_16)   # the bench shape's JIT specialisation
    t = [s for s in specs if s.kernel == "stair_t"]  # every t_pre forward spec has its third-softmax kernel
    assert len(t) >= sum(1 for s in specs if s.kernel == "stair_fwd" and "-tpre" in s.config)
    assert t and all(s.expect_tma for s in t)
    bwd = next(s for s in bench if s.kernel == "stair_bwd")
    assert "NQT" in bwd.divisible_by_16

"""Contract: zero-size dimensions. Every op accepts a zero-size dimension in every
argument on every backend: the result has the right shape and values (float64 spec), and every
input that requires grad receives a gradient of its own shape (zeros where nothing flowed), never
None and never an error."""
import pytest
import torch

import cases

ZERO = {  # op -> {case id: builder keyword arguments}
    "grpo_advantages": {"N=0": dict(n_groups=0)},
    "stair_readout": {"B=0": dict(B=0, lengths=()), "T=0": dict(T=0), "M=0": dict(M=0, lengths=(0, 0)),
                      "D=0": dict(D=0), "Dv=0": dict(Dv=0), "Hq=Hkv=0": dict(Hq=0, Hkv=0),
                      "M=0,no lengths": dict(M=0, lengths=None)},
    "gated_lora": {"N=0": dict(lead=(0,)), "lead 2x0": dict(lead=(2, 0)), "d_in=0": dict(d_in=0),
                   "d_out=0": dict(d_out=0), "r=0": dict(r=0)},
    "gated_lora_linear": {"N=0": dict(lead=(0,)), "lead 2x0": dict(lead=(2, 0)), "d_in=0": dict(d_in=0),
                          "d_out=0": dict(d_out=0), "r=0": dict(r=0), "r=0,no bias": dict(r=0, bias=False)},
    "topk_entropy": {"positions=0": dict(lead=(0, 3), mask=False, reduction="none"),
                     "positions 2x0": dict(lead=(2, 0), mask=False, reduction="none")},
    "topk_entropy_from_hidden": {"d=0": dict(d=0), "d=0,no mask": dict(d=0, mask=False)},
}
PARAMS = [pytest.param(op, b, cid, id=f"{op}-{b or 'torch'}-{cid}") for op, b in
          [(p.values[0], p.values[1]) for p in cases.op_backend_params()] for cid in ZERO[op]]


@pytest.mark.parametrize("op,backend,cid", PARAMS)
def test_zero_size(op, backend, cid):
    kw = dict(ZERO[op][cid])
    if op == "stair_readout" and kw.get("Hq") == 0:
        kw["lengths"] = (5, 3)
    case = cases.make(op, **kw)
    inputs = case.clone()
    out = cases.call(case, inputs, backend)
    # values: the float64 spec (Hq = Hkv = 0 has no head to read: an empty result)
    if op == "stair_readout" and kw.get("Hq") == 0:
        assert out.shape == (2, 0, 5, 20)
    else:
        ref = cases.reference(case, case.clone(torch.float64, requires_grad=False))
        assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    if not case.grad_names:
        return
    assert out.requires_grad, "the result must stay connected to the inputs that require grad"
    w = torch.randn(out.shape, dtype=out.dtype)
    tensors = [inputs[n] for n in case.grad_names]
    gs = torch.autograd.grad((out * w).sum(), tensors, allow_unused=True)
    for name, t, g in zip(case.grad_names, tensors, gs):
        assert g is not None, f"{name} requires grad but got no gradient"
        assert g.shape == t.shape and g.dtype == t.dtype, f"d{name}: {tuple(g.shape)} {g.dtype}"
        assert bool(torch.isfinite(g).all())


@pytest.mark.parametrize("op", ["topk_entropy", "topk_entropy_from_hidden"])
def test_mean_over_no_position_raises(op):
    case = cases.make(op, lead=(0, 3), mask=False)
    with pytest.raises(ValueError, match="no positions"):
        cases.call(case, case.clone(), None)

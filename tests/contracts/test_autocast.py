"""Contract: autocast. Policy (treadle/ops/_amp.py, and each op's docstring):
matrix-product ops cast their float16/bfloat16/float32 inputs to the autocast dtype before the op
(``stair_readout``: q, k_bank, v_bank; ``gated_lora``: x, base_out, A, B, with the gate in float32;
``gated_lora_linear``: also the base weight and bias; ``topk_entropy_from_hidden``: hidden and the
head's weight), ``topk_entropy`` and ``grpo_advantages`` take their inputs as given, and every op
body and backward runs with autocast off. So under autocast every backend gives exactly what it gives
outside autocast on the policy's inputs, forward and backward, and nothing raises."""
import pytest
import torch

import cases

POLICY = {  # input name -> dtype it runs in under autocast ("amp": the autocast dtype)
    "grpo_advantages": {},
    "stair_readout": {"q": "amp", "k_bank": "amp", "v_bank": "amp"},
    "gated_lora": {"x": "amp", "base_out": "amp", "lora_A": "amp", "lora_B": "amp",
                   "gate_weight": torch.float32, "gate_bias": torch.float32},
    "gated_lora_linear": {"x": "amp", "weight": "amp", "bias": "amp", "lora_A": "amp", "lora_B": "amp",
                          "gate_weight": torch.float32, "gate_bias": torch.float32},
    "topk_entropy": {},
    "topk_entropy_from_hidden": {"hidden": "amp", "lm_head_weight": "amp"},
}
OUT_DTYPE = {"grpo_advantages": torch.float32, "topk_entropy": torch.float32,
             "topk_entropy_from_hidden": torch.float32}


def _policy_cast(op, inputs, amp):
    out = dict(inputs)
    for name, dt in POLICY[op].items():
        if out.get(name) is not None:
            out[name] = out[name].to(amp if dt == "amp" else dt)
    return out


def _check(op, backend, device, amp):
    case = cases.make(op)
    # under autocast, float32 leaves
    leaves = case.clone(device=device)
    with torch.autocast(device, dtype=amp):
        out = cases.call(case, leaves, backend)
    g = cases.grads(out, leaves, case.grad_names) if case.grad_names else {}
    assert out.dtype == OUT_DTYPE.get(op, amp), f"{op}: output dtype {out.dtype} under autocast {amp}"
    # the policy spelled out, autocast off
    leaves2 = case.clone(device=device)
    out2 = cases.call(case, _policy_cast(op, leaves2, amp), backend)
    g2 = cases.grads(out2, leaves2, case.grad_names) if case.grad_names else {}
    # bitwise equal, except the GPU grpo kernels' float64 atomics (order-dependent last bits)
    tol = dict(rtol=1e-6, atol=1e-9) if device == "cuda" and op == "grpo_advantages" else dict(rtol=0, atol=0)
    torch.testing.assert_close(out, out2, **tol)
    for name in g:
        assert g[name].dtype == leaves[name].dtype, f"d{name} must come back in the leaf's dtype"
        torch.testing.assert_close(g[name], g2[name], rtol=0, atol=0, msg=f"{op} d{name}")
    # and within the tolerance rule against float64 on the policy's (rounded) inputs
    cast_inputs = {k: (v.detach() if isinstance(v, torch.Tensor) else v)
                   for k, v in _policy_cast(op, case.clone(requires_grad=False), amp).items()}
    ref_case = cases.Case(op, cast_inputs, case.grad_names, case.options)
    plain, _ = cases.run_with_grads(ref_case, backend, ref=True)
    ref, _ = cases.run_with_grads(ref_case, backend, dtype=torch.float64, ref=True)
    if op != "grpo_advantages":
        cases.assert_rule(out.cpu(), plain, ref, factor=2, dtype=amp, name=f"{op}[{backend}] under autocast")


@pytest.mark.parametrize("op,backend", cases.op_backend_params())
def test_cpu_autocast_bf16(op, backend):
    _check(op, backend, "cpu", torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(device="cuda") if torch.cuda.is_available() else
                         [pytest.param(op, None, id=op) for op in cases.OPS])
def test_cuda_autocast(op, backend, amp):
    _check(op, backend, "cuda", amp)


@pytest.mark.parametrize("op,backend", cases.op_backend_params(("stair_readout", "gated_lora")))
def test_autocast_does_not_leak_into_a_backward_called_under_autocast(op, backend):
    # a backward called inside the autocast region must not recast the kernels' internal GEMMs either
    case = cases.make(op)
    leaves = case.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cases.call(case, leaves, backend)
        g = cases.grads(out, leaves, case.grad_names)
    leaves2 = case.clone()
    out2 = cases.call(case, _policy_cast(op, leaves2, torch.bfloat16), backend)
    g2 = cases.grads(out2, leaves2, case.grad_names)
    for name in g:
        torch.testing.assert_close(g[name], g2[name], rtol=0, atol=0)

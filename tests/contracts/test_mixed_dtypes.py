"""Contract: mixed dtypes. Every op computes in the accumulation dtype from its inputs *as given*
and casts once at the end, so its error against the float64 spec is at most 2x (gradients 3x) the
error of plain PyTorch in the same dtypes."""
import pytest
import torch

import cases
from treadle.reference.scale import gate_lambda_reference

LOW = [torch.bfloat16, torch.float16]


def _check(case, backend, dtype):
    out, g = cases.run_with_grads(case, backend)
    plain, gp = cases.run_with_grads(case, backend, ref=True)
    ref, gr = cases.run_with_grads(case, backend, dtype=torch.float64, ref=True)
    cases.assert_rule(out, plain, ref, factor=2, dtype=dtype, name=f"{case.op}[{backend}] output")
    for name in g:
        cases.assert_rule(g[name], gp[name], gr[name], factor=3, dtype=dtype, name=f"{case.op}[{backend}] d{name}")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("gated_lora", "gated_lora_linear")))
def test_low_precision_x_with_float32_gate(op, backend, dtype):
    # a float32 gate on bf16/fp16 activations is never rounded to the activations' dtype
    case = cases.make(op, lead=(64,), d_in=64, d_out=48, r=8, dtype=dtype, gate_dtype=torch.float32)
    _check(case, backend, dtype)


@pytest.mark.parametrize("op,backend", cases.op_backend_params(("gated_lora", "gated_lora_linear")))
def test_issue_example_lambda_and_gate_bias_gradient(op, backend):
    # the issue's input: bf16 x (64 x 64), float32 gate w = 0.25 randn, b = 0.1, L = -2, U = 3, tau = 0.7
    case = cases.make(op, lead=(64,), d_in=64, d_out=64, r=8, dtype=torch.bfloat16, gate_dtype=torch.float32,
                      L=-2.0, U=3.0, tau=0.7)
    inputs = case.clone()
    out, lam = cases.call(cases.Case(op, inputs, case.grad_names, dict(case.options, return_lambda=True)), inputs,
                          backend)
    x64 = inputs["x"].detach().double()
    g64 = x64 @ inputs["gate_weight"].detach().double() + 0.1
    lam64 = gate_lambda_reference(torch.tanh(g64 / 0.7), -2.0, 3.0)
    plain_lam = gate_lambda_reference(torch.tanh(((inputs["x"].detach() * inputs["gate_weight"].detach()).sum(-1)
                                                  + 0.1) / 0.7), -2.0, 3.0)
    cases.assert_rule(lam, plain_lam, lam64, factor=2, dtype=torch.float32, name="lambda")
    assert (lam.double() - lam64).abs().max().item() < 1e-4  # was 1.5e-2 with the gate rounded to bf16
    _check(case, backend, torch.bfloat16)


@pytest.mark.parametrize("normals_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("stair_readout",)))
def test_stair_low_precision_qkv_with_wide_normals(op, backend, normals_dtype):
    case = cases.make(op, dtype=torch.bfloat16)
    case.inputs["normals"] = case.inputs["normals"].to(normals_dtype)
    out, g = cases.run_with_grads(case, backend)
    assert out.dtype == torch.bfloat16 and g["normals"].dtype == normals_dtype
    _check(case, backend, torch.bfloat16)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("topk_entropy", "topk_entropy_from_hidden")))
def test_topk_low_precision(op, backend, dtype):
    case = cases.make(op, dtype=dtype)
    out, _ = cases.run_with_grads(case, backend)
    assert out.dtype == torch.float32  # computed and returned in float32
    _check(case, backend, dtype)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("dtype", LOW + [torch.float32])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("grpo_advantages",)))
def test_grpo_low_precision_rewards_any_int_ids(op, backend, dtype, ids_dtype):
    case = cases.make(op, dtype=dtype)
    case.inputs["group_ids"] = case.inputs["group_ids"].to(ids_dtype)
    out = cases.call(case, case.clone(), backend)
    ref = cases.reference(case, case.clone(torch.float64))  # the same (rounded) rewards, in float64
    assert out.dtype == torch.float32
    # float64 statistics from the rewards as given: only the final float32 rounding remains
    torch.testing.assert_close(out.double(), ref, rtol=2e-7, atol=1e-7)

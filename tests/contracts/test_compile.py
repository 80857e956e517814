"""Contract: ``torch.compile(fullgraph=True)``. Every op traces into one graph with every
optional argument given (masks, lengths, flags, valid, options), gives eager's values and gradients,
and a second call with new tensor values (new masks, lengths, flags) of the same shapes does not
recompile. ``aot_eager`` traces exactly what inductor would (dynamo + fake tensors + autograd) without
the C++ compile, which the 2-core CI cannot afford per test."""
import pytest
import torch
import torch._dynamo

import cases
from treadle import ops


def _fn(op, backend):
    if op == "grpo_advantages":
        def f(rewards, group_ids, valid, flags):
            return ops.grpo_advantages(rewards, group_ids, valid=valid, flags=flags, estimator="grpo", std="biased",
                                       eps=1e-4, eps_placement="var", singleton="raw", scale_rewards="batch",
                                       nonfinite="skip", check_finite=False, backend=backend)
    elif op == "stair_readout":
        def f(q, k_bank, v_bank, normals, bank_lengths):
            return ops.stair_readout(q, k_bank, v_bank, normals, bank_lengths=bank_lengths, eps=0.1, scale=0.3,
                                     mode="reflected", debug=False, backend=backend)
    elif op == "gated_lora":
        def f(x, base_out, lora_A, lora_B, gate_weight, gate_bias):
            y, lam = ops.gated_lora(x, base_out, lora_A, lora_B, gate_weight, gate_bias, scaling=2.0, L=-2.0, U=3.0,
                                    tau=0.7, return_lambda=True, backend=backend)
            return y * lam.unsqueeze(-1).to(y.dtype)
    elif op == "gated_lora_linear":
        def f(x, weight, bias, lora_A, lora_B, gate_weight, gate_bias):
            y, lam = ops.gated_lora_linear(x, weight, bias, lora_A, lora_B, gate_weight, gate_bias, scaling=2.0,
                                           L=-2.0, U=3.0, tau=0.7, return_lambda=True, backend=backend)
            return y * lam.unsqueeze(-1).to(y.dtype)
    elif op == "topk_entropy":
        def f(logits, mask):
            return ops.topk_entropy(logits, 8, mask, reduction="mean")
    else:
        def f(hidden, lm_head_weight, mask):
            return ops.topk_entropy_from_hidden(hidden, lm_head_weight, 8, mask, chunk_size=4)
    return f


def _new_values(op, inputs):
    """Same shapes, new values: new masks / lengths / flags / valid rows and new floats."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for k, v in inputs.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif v.dtype == torch.bool:
            m = torch.rand(v.shape, generator=g) > 0.5
            m.view(-1)[0] = True
            out[k] = m
        elif k == "bank_lengths":
            out[k] = torch.tensor([2, 8])
        elif k == "group_ids":
            out[k] = v.flip(0).clone()
        elif v.is_floating_point():
            out[k] = (v.detach() + 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype)
                      ).requires_grad_(v.requires_grad)
        else:
            out[k] = v.clone()
    return out


@pytest.mark.parametrize("op,backend", cases.op_backend_params())
def test_fullgraph_all_options_no_recompile(op, backend):
    torch._dynamo.reset()
    case = cases.make(op)
    f = _fn(op, backend)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
    first = case.clone()
    second = _new_values(op, case.clone())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for inputs in (first, second):
            out = compiled(**inputs)
            eager_inputs = {k: (v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor)
                                else v) for k, v in inputs.items()}
            ref = f(**eager_inputs)
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
            if case.grad_names:
                g = cases.grads(out, inputs, case.grad_names)
                gr = cases.grads(ref, eager_inputs, case.grad_names)
                for name in g:
                    torch.testing.assert_close(g[name], gr[name], rtol=1e-5, atol=1e-6, msg=f"d{name}")


@pytest.mark.parametrize("op,backend", cases.op_backend_params(cases.GRAD_OPS))
def test_fullgraph_under_autocast_matches_eager(op, backend):
    # the autocast policy is decided while tracing (treadle/ops/_amp.py) exactly as in eager mode
    torch._dynamo.reset()
    case = cases.make(op)
    f = _fn(op, backend)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
    inputs, eager_inputs = case.clone(), case.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(**inputs)
        ref = f(**eager_inputs)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g, gr = cases.grads(out, inputs, case.grad_names), cases.grads(ref, eager_inputs, case.grad_names)
    for name in g:
        assert g[name].dtype == inputs[name].dtype
        torch.testing.assert_close(g[name], gr[name], rtol=1e-6, atol=1e-6, msg=f"d{name}")

"""Contract: cancellation. Every backend computes its statistics in two passes
(or an equally stable way), so a large common offset costs no more than the rounding of the inputs.
The float64 expectation is the reference's literal two-pass maths."""
import pytest
import torch

import cases

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_baseline"]


@pytest.mark.parametrize("op,backend", cases.op_backend_params(("grpo_advantages",)))
def test_issue_example_reinforce_baseline_raw_singletons(op, backend):
    rewards = 1e7 + torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    ids = torch.arange(4)
    out = cases.call(cases.Case(op, {}, options={"estimator": "reinforce_baseline", "singleton": "raw"}),
                     {"rewards": rewards, "group_ids": ids}, backend)
    d = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    expected = (d - d.mean()) / (d.std() + 1e-6)  # the offset cancels exactly in exact arithmetic
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out, torch.tensor([-1.0247, -0.4392, 0.1464, 1.3175], dtype=torch.float64),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("offset", [1e6, 1e7, -3e8])
@pytest.mark.parametrize("estimator,scale", [(e, None) for e in ESTIMATORS] + [("grpo", "batch")])
@pytest.mark.parametrize("singleton", ["zero", "raw"])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("grpo_advantages",)))
def test_grpo_large_offset(op, backend, estimator, scale, singleton, offset):
    case = cases.make(op, n_groups=6, size=5, dtype=torch.float64, estimator=estimator, scale_rewards=scale,
                      singleton=singleton)
    case.inputs["rewards"] = case.inputs["rewards"] + offset
    case.inputs["group_ids"][:3] = 100 + torch.arange(3)  # a few singletons
    out = cases.call(case, case.clone(), backend)
    ref = cases.reference(case, case.clone())
    # rewards are exact float64 values: two-pass statistics lose only ~|offset| * 2^-52 relative to
    # the spread (about 1): the one-pass E[x^2] - E[x]^2 loses |offset|^2 * 2^-52
    tol = 64 * abs(offset) * 2.0 ** -52 + 1e-12
    torch.testing.assert_close(out, ref, rtol=0, atol=tol * max(1.0, ref.abs().max().item()))


@pytest.mark.parametrize("op,backend", cases.op_backend_params(("topk_entropy", "topk_entropy_from_hidden")))
def test_topk_shift_invariance(op, backend):
    # the entropy of a softmax does not see a common offset; a stable log-sum-exp keeps it that way
    case = cases.make(op, mask=False, dtype=torch.float64)
    out0 = cases.call(case, case.clone(), backend)
    inputs = case.clone()
    if op == "topk_entropy":
        inputs["logits"] = inputs["logits"] + 1e4
    else:  # a constant column in hidden and the head adds 1e4 to every logit
        inputs["hidden"] = torch.cat([inputs["hidden"], torch.full((*inputs["hidden"].shape[:-1], 1), 1e2,
                                                                   dtype=torch.float64)], -1)
        inputs["lm_head_weight"] = torch.cat([inputs["lm_head_weight"],
                                              torch.full((inputs["lm_head_weight"].shape[0], 1), 1e2,
                                                         dtype=torch.float64)], -1)
    out1 = cases.call(case, inputs, backend)
    torch.testing.assert_close(out1, out0, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("stair_readout",)))
def test_stair_large_logits(op, backend, eps):
    # logits up to ~170 (e^170 overflows float32): the online softmax must subtract running maxima
    # (no inf/NaN), and the error stays at the conditioning of the problem: rounding the logits
    # alone moves each weight by ~eps32 * |s|, so |error| <= c * eps32 * max|s| * max|v|.
    case = cases.make(op, eps=eps)
    case.inputs["q"] = case.inputs["q"] * 60.0
    out, g = cases.run_with_grads(case, backend)
    ref, gr = cases.run_with_grads(case, backend, dtype=torch.float64, ref=True)
    q, k = case.inputs["q"].double(), case.inputs["k_bank"].double()
    s_max = (q.abs().amax() * k.abs().amax() * q.shape[-1] ** 0.5).item()  # bound on |scale q . k|
    bound = 8 * torch.finfo(torch.float32).eps * s_max * case.inputs["v_bank"].abs().max().item()
    assert bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(t).all()) for t in g.values())
    assert (out.double() - ref).abs().max().item() <= bound
    for name in g:
        assert (g[name].double() - gr[name]).abs().max().item() <= bound * max(1.0, gr[name].abs().max().item())

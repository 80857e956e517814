"""Contract: garbage beyond the valid region. Padded bank slots
(``stair_readout``'s ``j >= bank_lengths[b]``), masked positions (``topk_entropy``'s and
``topk_entropy_from_hidden``'s ``mask``) and invalid rows (``grpo_advantages``' ``valid=False``) never
reach a result or a gradient, whatever they hold. (``gated_lora``/``gated_lora_linear`` have no
padding or mask argument: every row is a token.) The float64 expectation is computed on the valid
region alone (banks cut to their length, masked rows dropped, invalid rows removed)."""

import pytest
import torch

import cases

GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30]
PADDED_OPS = ("stair_readout", "topk_entropy", "topk_entropy_from_hidden", "grpo_advantages")


@pytest.mark.parametrize("junk", GARBAGE, ids=["nan", "inf", "-inf", "huge"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["diff", "reflected", "reference"])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("stair_readout",)))
def test_stair_padded_bank_slots(op, backend, mode, eps, junk):
    case = cases.make(op, B=2, M=8, lengths=(5, 3), eps=eps, mode=mode)
    lengths = case.inputs["bank_lengths"].tolist()
    for b, L in enumerate(lengths):
        case.inputs["k_bank"][b, :, L:] = junk
        case.inputs["v_bank"][b, :, L:] = junk
    out, g = cases.run_with_grads(case, backend)
    assert bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(t).all()) for t in g.values())
    if junk != junk and mode == "diff" and eps == 0.1:  # debug=True checks the valid slots only
        inputs = case.clone()
        cases.call(cases.Case(op, inputs, case.grad_names, dict(case.options, debug=True)), inputs, backend)
    # float64 expectation, one batch row at a time on the bank cut to its length (no lengths at all)
    inputs = case.clone(torch.float64)
    outs = []
    for b, L in enumerate(lengths):
        row = cases.Case(op, {"q": inputs["q"][b:b + 1], "k_bank": inputs["k_bank"][b:b + 1, :, :L],
                              "v_bank": inputs["v_bank"][b:b + 1, :, :L], "normals": inputs["normals"]},
                         case.grad_names, case.options)
        outs.append(cases.reference(row, row.inputs))
    ref = torch.cat(outs)
    gr = cases.grads(ref, inputs, case.grad_names)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for name in g:
        torch.testing.assert_close(g[name].double(), gr[name], rtol=1e-4, atol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("junk", GARBAGE, ids=["nan", "inf", "-inf", "huge"])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("topk_entropy", "topk_entropy_from_hidden")))
def test_topk_masked_positions(op, backend, junk):
    case = cases.make(op)
    mask = case.inputs["mask"]
    name = "logits" if op == "topk_entropy" else "hidden"
    case.inputs[name][~mask] = junk
    out, g = cases.run_with_grads(case, backend)
    assert bool(torch.isfinite(out)) and all(bool(torch.isfinite(t).all()) for t in g.values())
    assert bool((g[name][~mask] == 0).all()), "masked positions must get exactly zero gradient"
    # float64 expectation over the masked-in rows only
    inputs = case.clone(torch.float64)
    sel = inputs[name][mask]
    if op == "topk_entropy":
        rows = cases.Case(op, {"logits": sel}, ("logits",), {"k": case.options["k"]})
    else:
        rows = cases.Case(op, {"hidden": sel, "lm_head_weight": inputs["lm_head_weight"]}, case.grad_names,
                          {"k": case.options["k"]})
    ref = cases.reference(rows, rows.inputs)
    gr = cases.grads(ref, rows.inputs, rows.grad_names)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g[name][mask].double(), gr[name], rtol=1e-4, atol=1e-6)
    if op == "topk_entropy_from_hidden":
        torch.testing.assert_close(g["lm_head_weight"].double(), gr["lm_head_weight"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("op,backend", cases.op_backend_params(("topk_entropy",)))
def test_topk_reduction_none_is_exactly_zero_nowhere_else(op, backend):
    # without a mask, garbage stays in its own row: the other rows are untouched
    case = cases.make(op, mask=False, reduction="none")
    case.inputs["logits"][0, 0] = float("nan")
    out = cases.call(case, case.clone(), backend)
    assert bool(torch.isnan(out[0, 0])) and bool(torch.isfinite(out.flatten()[1:]).all())


@pytest.mark.parametrize("junk", GARBAGE + [-1e300, 1e300], ids=["nan", "inf", "-inf", "huge", "-1e300", "1e300"])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
@pytest.mark.parametrize("op,backend", cases.op_backend_params(("grpo_advantages",)))
def test_grpo_invalid_rows(op, backend, estimator, junk):
    scale = "batch" if estimator == "grpo" else None
    case = cases.make(op, dtype=torch.float64, estimator=estimator, scale_rewards=scale)
    valid = case.inputs["valid"]
    case.inputs["rewards"][~valid] = junk
    out = cases.call(case, case.clone(), backend)
    assert bool((out[~valid] == 0).all())
    # expectation: the valid rows alone, in float64
    keep = {k: v[valid] for k, v in case.clone(requires_grad=False).items() if k != "valid"}
    ref = cases.reference(cases.Case(op, keep, (), case.options), keep)
    torch.testing.assert_close(out[valid], ref, rtol=1e-12, atol=1e-12)

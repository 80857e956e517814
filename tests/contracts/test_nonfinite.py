"""Contract: non-finite logits in ``topk_entropy``. ``-inf`` logits have probability 0 and ``0 log 0 = 0``;
a row of all ``-inf`` has value 0 and zero gradient; a row with ``+inf`` logits has the limit
distribution (uniform over its ``+inf`` entries) and zero gradient; ``+inf``/NaN at masked positions
are never read; ties at the k-th value do not change the value, and the gradient goes to the lowest
vocabulary indices. Expectations are closed forms or float64 autograd on the finite entries alone.
(``topk_entropy_from_hidden`` takes finite hidden states; ``-inf`` logits cannot arise from them.)"""
import math

import pytest
import torch

import cases
from treadle.ops import topk_entropy

INF = float("inf")
BACKENDS = cases.op_backend_params(("topk_entropy",))


def _finite_part_expectation(row: torch.Tensor, k: int):
    """Value and gradient of H_k / log k for a row with fewer than k finite logits: the softmax over
    its finite entries (all of them are in the top k), by float64 autograd on those entries only."""
    fin = torch.isfinite(row)
    z = row[fin].double().clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    val = -(logp.exp() * logp).sum() / math.log(k)
    (gz,) = torch.autograd.grad(val, z)
    grad = torch.zeros(row.shape, dtype=torch.float64)
    grad[fin] = gz
    return val.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op,backend", BACKENDS)
def test_fewer_than_k_finite_logits(op, backend, dtype):
    x = torch.tensor([[0.0, 0.0] + [-INF] * 7], dtype=dtype, requires_grad=True)
    v = topk_entropy(x, 4)
    v.backward()
    assert v.item() == pytest.approx(math.log(2) / math.log(4), abs=1e-6)  # = 0.5
    assert bool(torch.isfinite(x.grad).all()) and x.grad.abs().max().item() < 1e-6  # H's maximum: flat


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_partly_finite_rows_value_and_gradient(op, backend):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 12, generator=g, dtype=torch.float64)
    for i, n_fin in enumerate((1, 2, 3, 5)):
        rows[i, n_fin:] = -INF
    x = rows.float().requires_grad_(True)
    v = topk_entropy(x, 6, reduction="none")
    (v * torch.arange(1.0, 5.0)).sum().backward()
    for i in range(4):
        val, grad = _finite_part_expectation(rows[i].float(), 6)
        assert v[i].item() == pytest.approx(val.item(), abs=1e-6)
        torch.testing.assert_close(x.grad[i].double(), grad * (i + 1), rtol=1e-5, atol=1e-6)
    assert v[0].item() == 0.0  # one finite logit: a point mass, entropy exactly 0


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_all_minus_inf_row_is_zero_with_zero_gradient(op, backend):
    x = torch.full((2, 7), -INF)
    x[1] = torch.arange(7.0)
    x.requires_grad_(True)
    v = topk_entropy(x, 3, reduction="none")
    v.sum().backward()
    assert v[0].item() == 0.0 and not math.copysign(1.0, v[0].item()) < 0
    assert bool((x.grad[0] == 0).all()) and bool(torch.isfinite(x.grad).all())
    m = topk_entropy(x.detach(), 3)  # and it enters the mean as a 0
    assert m.item() == pytest.approx(v[1].item() / 2, rel=1e-6)


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_plus_inf_logits_give_the_limit_distribution(op, backend):
    x = torch.tensor([[INF, INF, 0.0, 1.0, 2.0], [INF, 0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    v = topk_entropy(x, 4, reduction="none")
    v.sum().backward()
    assert v[0].item() == pytest.approx(math.log(2) / math.log(4), abs=1e-7)  # uniform over the two +inf
    assert v[1].item() == 0.0  # one +inf: a point mass
    assert bool((x.grad == 0).all())


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_plus_inf_and_nan_at_masked_positions(op, backend):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 10, generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 1] = mask[2, 3] = False
    x[0, 1, 2] = INF
    x[2, 3] = float("nan")
    x.requires_grad_(True)
    v = topk_entropy(x, 5, mask)
    v.backward()
    ref = cases.reference(cases.Case("topk_entropy", {"logits": x.detach()[mask].double()}, (), {"k": 5}),
                          {"logits": x.detach()[mask].double()})
    assert v.item() == pytest.approx(ref.item(), rel=1e-6)
    assert bool(torch.isfinite(x.grad).all()) and bool((x.grad[~mask] == 0).all())


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_nan_in_a_considered_row_is_not_hidden(op, backend):
    x = torch.randn(2, 6)
    x[0, 3] = float("nan")
    v = topk_entropy(x, 3, reduction="none")
    assert bool(torch.isnan(v[0])) and bool(torch.isfinite(v[1]))


@pytest.mark.parametrize("op,backend", BACKENDS)
def test_ties_inside_and_at_the_kth_value(op, backend):
    # top-4 of [3, 1, 1, 1, 1, 0]: the value is that of [3, 1, 1, 1]; the gradient lands on the
    # lowest-index 1s (indices 1, 2, 3), never on index 4 or 5
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    v = topk_entropy(x, 4)
    v.backward()
    val, grad = _finite_part_expectation(torch.tensor([3.0, 1.0, 1.0, 1.0], dtype=torch.float64), 4)
    assert v.item() == pytest.approx(val.item(), rel=1e-12)
    expected = torch.zeros(1, 6, dtype=torch.float64)
    expected[0, :4] = grad
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-15)
    # the same logits permuted: the value is unchanged, the gradient follows the lowest indices
    y = torch.tensor([[1.0, 0.0, 1.0, 3.0, 1.0, 1.0]], dtype=torch.float64, requires_grad=True)
    w = topk_entropy(y, 4)
    w.backward()
    assert w.item() == pytest.approx(val.item(), rel=1e-12)
    assert y.grad[0, 5].item() == 0.0 and y.grad[0, 1].item() == 0.0
    torch.testing.assert_close(y.grad[0, [0, 2, 4]], grad[1:], rtol=1e-12, atol=1e-15)

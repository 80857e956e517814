"""treadle.ops.topk_entropy / topk_entropy_from_hidden against the literal float64 reference."""
from __future__ import annotations

import math

import pytest
import torch

from treadle.ops.topk_entropy import topk_entropy, topk_entropy_from_hidden
from treadle.reference.scale import topk_entropy_reference, topk_entropy_rows_reference
from treadle.testing import assert_close_verbose, assert_within_rule


def _value_and_grad(fn, logits64, dtype, **kw):
    z = logits64.to(dtype).clone().requires_grad_()
    out = fn(z, **kw)
    out.sum().backward()
    return out.detach(), z.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,k", [((37, 211), 100), ((2, 5, 150), 7), ((1, 50), 50), ((3, 1, 9), 2)])
def test_matches_reference_rule(dtype, shape, k):
    # distinct values exactly representable in every dtype (multiples of 1/32 below 8): no ties at
    # the k-th value after rounding, so every implementation selects the same entries
    vocab = shape[-1]
    rows = torch.stack([torch.randperm(vocab) for _ in range(math.prod(shape[:-1]))])
    logits = (rows.to(torch.float64) / 32 - vocab / 64).reshape(shape)
    # per-position values (a single scalar would make the rule depend on one lucky rounding)
    ref = _value_and_grad(topk_entropy_rows_reference, logits, torch.float64, k=k)
    plain = _value_and_grad(topk_entropy_rows_reference, logits, dtype, k=k)
    got = _value_and_grad(topk_entropy, logits, dtype, k=k, reduction="none")
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[0].shape == shape[:-1]
    # the op computes in fp32 from the rounded logits: compare against the reference on those logits
    ref_r = _value_and_grad(topk_entropy_rows_reference, logits.to(dtype).double(), torch.float64, k=k)
    assert_within_rule(got[0], plain[0], ref[0], factor=2, floor=1e-6, name="value")
    assert_within_rule(got[1], plain[1], ref_r[1], factor=3, floor=1e-6, name="grad")


@pytest.mark.parametrize("shape,k", [((37, 211), 100), ((4, 3, 64), 13)])
def test_float64_matches_reference(shape, k):
    logits = 2 * torch.randn(*shape, dtype=torch.float64)
    mask = torch.rand(shape[:-1]) < 0.6
    mask.view(-1)[0] = True
    ref = _value_and_grad(topk_entropy_reference, logits, torch.float64, k=k, mask=mask)
    got = _value_and_grad(topk_entropy, logits, torch.float64, k=k, mask=mask)
    assert_close_verbose(got[0], ref[0], atol=1e-12, rtol=1e-12, name="value")
    assert_close_verbose(got[1], ref[1], atol=1e-12, rtol=1e-12, name="grad")
    # masked-out positions get exactly zero gradient
    assert torch.count_nonzero(got[1][~mask]) == 0


def test_gradient_only_on_top_k_entries():
    logits = torch.randn(20, 300, dtype=torch.float64)
    _, g = _value_and_grad(topk_entropy, logits, torch.float64, k=17)
    nz = g != 0
    assert torch.equal(nz.sum(-1), torch.full((20,), 17))
    top = torch.topk(logits, 17, dim=-1).indices
    assert bool(nz.gather(-1, top).all())


def test_ties_at_kth_value_go_to_lowest_indices():
    row = torch.tensor([1.0, 3.0, 5.0, 3.0, 4.0, 3.0, 0.5], dtype=torch.float64)
    logits = torch.stack([row, row.flip(0)])
    k = 4  # 5, 4 and two of the three 3's
    value, g = _value_and_grad(topk_entropy, logits, torch.float64, k=k, reduction="none")
    expected = topk_entropy_rows_reference(logits, k)
    assert_close_verbose(value, expected, atol=1e-14, rtol=1e-14, name="value")
    nz = (g != 0).tolist()
    assert nz[0] == [False, True, True, True, True, False, False]  # 3's at indices 1, 3 (not 5)
    assert nz[1] == [False, True, True, True, True, False, False]  # flipped [.5,3,4,3,5,3,1]: 3's at 1, 3
    # the gradient equals the literal gradient wrt the chosen top-k values
    vals = torch.tensor([5.0, 4.0, 3.0, 3.0], dtype=torch.float64, requires_grad=True)
    gv = torch.autograd.grad(topk_entropy_rows_reference(vals[None], k).sum(), vals)[0]
    assert_close_verbose(g[0, [2, 4, 1, 3]], gv, atol=1e-14, rtol=1e-14, name="tie grad")
    # deterministic: same result on repeat
    assert torch.equal(g, _value_and_grad(topk_entropy, logits, torch.float64, k=k, reduction="none")[1])


def test_ties_inside_top_k_and_uniform_extremes():
    z = torch.zeros(3, 40, dtype=torch.float64)
    assert abs(float(topk_entropy(z, k=10)) - 1.0) < 1e-12  # uniform over the top k
    z[:, 5] = 1e4
    assert float(topk_entropy(z, k=10)) < 1e-12  # one dominant token


def test_reduction_none_shape():
    out = topk_entropy(torch.randn(2, 3, 20), k=5, reduction="none")
    assert out.shape == (2, 3)
    assert topk_entropy(torch.randn(0, 4, 20), k=5, reduction="none").shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000, None])
def test_chunked_equals_unchunked(dtype, chunk_size):
    torch.manual_seed(0)
    n, d, vocab, k = 23, 16, 97, 10
    hidden = torch.randn(2, n, d, dtype=dtype)
    weight = torch.randn(vocab, d, dtype=dtype)
    mask = torch.rand(2, n) < 0.7
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    full = topk_entropy(h1 @ w1.t(), k=k, mask=mask)
    full.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    chunked = topk_entropy_from_hidden(h2, w2, k=k, mask=mask, chunk_size=chunk_size)
    chunked.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert_close_verbose(chunked, full, atol=tol, rtol=tol, name="value")
    assert_close_verbose(h2.grad, h1.grad, atol=tol, rtol=tol, name="d hidden")
    assert_close_verbose(w2.grad, w1.grad, atol=tol, rtol=tol, name="d lm_head_weight")
    assert torch.count_nonzero(h2.grad[~mask]) == 0


def test_chunked_frozen_head_and_bf16():
    torch.manual_seed(0)
    hidden = torch.randn(30, 24, dtype=torch.float64)
    weight = torch.randn(120, 24, dtype=torch.float64) / 3
    ref_h = hidden.clone().requires_grad_()
    ref = topk_entropy_reference(ref_h @ weight.t(), k=20)
    ref.backward()
    plain_h = hidden.bfloat16().requires_grad_()
    plain = topk_entropy_reference(plain_h @ weight.bfloat16().t(), k=20)
    plain.backward()
    h = hidden.bfloat16().requires_grad_()
    w = weight.bfloat16()  # frozen head: no gradient computed or returned
    out = topk_entropy_from_hidden(h, w, k=20, chunk_size=8)
    out.backward()
    assert w.grad is None and h.grad.dtype == torch.bfloat16
    # a scalar makes the rule a coin toss (plain bf16's single final rounding may land anywhere), so
    # the value is checked against the float64 spec on the same bf16 logits instead
    same_logits = topk_entropy_reference((hidden.bfloat16() @ weight.bfloat16().t()).double(), k=20)
    assert_close_verbose(out, same_logits, atol=1e-6, rtol=1e-6, name="value")
    assert_within_rule(h.grad, plain_h.grad, ref_h.grad, factor=3, floor=1e-6, name="d hidden")


def test_bad_input():
    z = torch.randn(4, 10)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        topk_entropy(z, k=11)
    with pytest.raises(ValueError, match="k must be >= 2"):
        topk_entropy(z, k=1)
    with pytest.raises(ValueError, match="k must be >= 2"):
        topk_entropy(z, k=0)
    with pytest.raises(TypeError, match="k must be a Python int"):
        topk_entropy(z, k=2.0)
    with pytest.raises(ValueError, match="no True"):
        topk_entropy(z, k=3, mask=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must have shape"):
        topk_entropy(z, k=3, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must have dtype"):
        topk_entropy(z, k=3, mask=torch.ones(4))
    with pytest.raises(ValueError, match="reduction"):
        topk_entropy(z, k=3, reduction="sum")
    with pytest.raises(TypeError, match="floating dtype"):
        topk_entropy(z.long(), k=3)
    with pytest.raises(ValueError, match="no positions"):
        topk_entropy(torch.randn(0, 10), k=3)
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        topk_entropy_from_hidden(h, w, k=11)
    with pytest.raises(ValueError, match="no True"):
        topk_entropy_from_hidden(h, w, k=3, mask=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="lm_head_weight must have shape"):
        topk_entropy_from_hidden(h, torch.randn(10, 7), k=3)
    with pytest.raises(TypeError, match="lm_head_weight must have hidden's dtype"):
        topk_entropy_from_hidden(h, w.double(), k=3)
    with pytest.raises(ValueError, match="chunk_size"):
        topk_entropy_from_hidden(h, w, k=3, chunk_size=0)


def test_opcheck():
    z = torch.randn(5, 30, requires_grad=True)
    mask = torch.tensor([True, False, True, True, False])
    for m in (None, mask):
        torch.library.opcheck(torch.ops.treadle.topk_entropy_rows.default, (z, 6, m),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    for m in (None, mask):
        torch.library.opcheck(torch.ops.treadle.topk_entropy_hidden.default, (h, w, m, 6, 2),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_torch_compile_runs():
    h = torch.randn(2, 9, 16, requires_grad=True)
    w = torch.randn(50, 16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False

    def f(h):
        return topk_entropy(h @ w.t(), k=8, mask=mask) + topk_entropy_from_hidden(h, w, k=8, chunk_size=4)

    compiled = torch.compile(f, backend="aot_eager")
    out = compiled(h)
    (g,) = torch.autograd.grad(out, h)
    out_e = f(h)
    (g_e,) = torch.autograd.grad(out_e, h)
    assert_close_verbose(out, out_e, atol=1e-6, rtol=1e-6, name="value")
    assert_close_verbose(g, g_e, atol=1e-6, rtol=1e-5, name="grad")
    assert math.isfinite(float(out.detach()))


@pytest.mark.cuda
def test_cuda_chunked_equals_unchunked():
    hidden = torch.randn(37, 64, device="cuda")
    weight = torch.randn(1000, 64, device="cuda")
    h1 = hidden.clone().requires_grad_()
    full = topk_entropy(h1 @ weight.t(), k=100)
    full.backward()
    h2 = hidden.clone().requires_grad_()
    chunked = topk_entropy_from_hidden(h2, weight, k=100, chunk_size=8)
    chunked.backward()
    assert_close_verbose(chunked, full, atol=1e-5, rtol=1e-5, name="value")
    assert_close_verbose(h2.grad, h1.grad, atol=1e-5, rtol=1e-4, name="d hidden")


@pytest.mark.parametrize("lead,V,k", [((3, 5), 50, 8), ((64,), 4000, 1000), ((64,), 1000, 100)])
def test_float32_gradient_within_rule_with_one_ulp_floor(lead, V, k):
    """The backward's factor ``z - lse_k + H`` cancels two numbers of size ~log k: with float32 row
    statistics the gradient's error was 3.5-5.6x plain PyTorch's (found on an H200). The
    statistics are float64 now; the rule (3x for gradients) holds with a floor of one ulp of the result."""
    from treadle.reference import topk_entropy_reference
    from treadle.testing import max_error

    g = torch.Generator().manual_seed(0)
    z64 = torch.randn(*lead, V, generator=g, dtype=torch.float64) * 2
    w = torch.randn((), generator=g, dtype=torch.float64)

    def grad(fn, dtype):
        z = z64.clone().to(dtype).requires_grad_()
        (fn(z, k) * w.to(dtype)).backward()
        return z.grad

    ref = grad(topk_entropy_reference, torch.float64)
    plain = grad(topk_entropy_reference, torch.float32)
    ours = grad(lambda z, k_: topk_entropy(z, k=k_), torch.float32)
    floor = torch.finfo(torch.float32).eps * ref.abs().max().item()
    assert max_error(ours, ref) <= 3 * max_error(plain, ref) + floor

"""The plain-PyTorch references on the edge cases their docstrings promise: rows of
non-finite logits in a batch with ordinary rows, 3-D logits, STAIR's default scale at D = 0 and its
empty bank. Each expected value is worked out by hand (comments), not by the code under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from treadle.reference.scale import topk_entropy_rows_reference
from treadle.reference.stair import stair_readout_reference

INF = math.inf


def _entropy_over_log_k(row, k):
    """H / log k of softmax(row), in float64, written out: -sum p log p / log k."""
    row = torch.tensor(row, dtype=torch.float64)
    p = torch.exp(row - row.max())
    p = p / p.sum()
    return float(-(p * p.log()).sum() / math.log(k))


def test_topk_entropy_rows_reference_non_finite_rows_in_one_batch():
    logits = torch.tensor([
        [0.5, -1.0, 2.0, 0.0],      # ordinary row
        [INF, 0.0, 1.0, 2.0],       # one +inf entry: all mass on it, H = 0
        [0.0, 0.0, -INF, -INF],     # two -inf entries have p = 0 (0 log 0 = 0): uniform over 2, log 2 / log 4
        [-INF, -INF, -INF, -INF],   # all -inf: 0
        [INF, INF, INF, INF],       # all +inf: uniform over 4, log 4 / log 4 = 1
        [INF, INF, 0.0, -INF],      # two +inf entries: uniform over them, log 2 / log 4
    ], dtype=torch.float64)
    expect = [_entropy_over_log_k([0.5, -1.0, 2.0, 0.0], 4), 0.0, 0.5, 0.0, 1.0, 0.5]
    got = topk_entropy_rows_reference(logits, 4)
    assert got.tolist() == pytest.approx(expect, abs=1e-12)
    # row by row the same (no row's non-finite entries reach another row)
    for i in range(len(expect)):
        assert topk_entropy_rows_reference(logits[i:i + 1], 4).item() == pytest.approx(expect[i], abs=1e-12)
    # (..., V) logits: a 3-D batch keeps its positions apart too
    got3 = topk_entropy_rows_reference(logits.reshape(2, 3, 4), 4)
    assert got3.shape == (2, 3) and got3.flatten().tolist() == pytest.approx(expect, abs=1e-12)


def test_stair_reference_default_scale_at_zero_head_dim():
    # D = 0: every logit is 0, so pi_ref is uniform over the valid slots and the reflection is the identity
    g = torch.Generator().manual_seed(0)
    q, k = torch.zeros(2, 2, 3, 0, dtype=torch.float64), torch.zeros(2, 1, 4, 0, dtype=torch.float64)
    v = torch.randn(2, 1, 4, 5, generator=g, dtype=torch.float64)
    n = torch.zeros(2, 0, dtype=torch.float64)
    lens = torch.tensor([4, 2])
    out = stair_readout_reference(q, k, v, n, bank_lengths=lens, mode="reference")
    mean = torch.stack([v[0, 0].mean(0), v[1, 0, :2].mean(0)])
    torch.testing.assert_close(out, mean[:, None, None, :].expand(2, 2, 3, 5), rtol=1e-12, atol=1e-12)
    assert torch.equal(stair_readout_reference(q, k, v, n, bank_lengths=lens), torch.zeros(2, 2, 3, 5,
                                                                                          dtype=torch.float64))


def test_stair_reference_empty_bank_is_exact_zero_with_zero_gradients():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    n = torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = torch.zeros(1, 1, 0, 4, dtype=torch.float64), torch.zeros(1, 1, 0, 5, dtype=torch.float64)
    out = stair_readout_reference(q, k, v, n, eps=0.3)
    assert torch.equal(out, torch.zeros(1, 2, 3, 5, dtype=torch.float64))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(n.grad, torch.zeros_like(n))


@pytest.mark.parametrize("mode", ["diff", "reflected", "reference"])
def test_stair_reference_runs_on_the_inputs_device(mode):
    # the meta device stands in for a GPU: every tensor the reference makes must be made on q's device
    m = torch.device("meta")
    q, k, v = torch.zeros(2, 2, 3, 4, device=m), torch.zeros(2, 1, 5, 4, device=m), torch.zeros(2, 1, 5, 6, device=m)
    n = torch.ones(2, 4, device=m)
    for lens in (None, torch.tensor([1, 5], device=m), torch.tensor([0, 2], dtype=torch.int32, device=m)):
        out = stair_readout_reference(q, k, v, n, bank_lengths=lens, eps=0.1, mode=mode)
        assert out.device == m and out.shape == (2, 2, 3, 6) and out.dtype == torch.float32


def test_stair_reference_moves_bank_lengths_to_the_inputs_device():
    # the yardstick takes the lengths from anywhere (a host tensor of lengths with the bank on a GPU): it moves
    # them to q's device; the meta device stands in for the GPU (a CPU tensor would not compare with meta ones)
    m = torch.device("meta")
    q, k, v = torch.zeros(2, 2, 3, 4, device=m), torch.zeros(2, 1, 5, 4, device=m), torch.zeros(2, 1, 5, 6, device=m)
    n = torch.ones(2, 4, device=m)
    for lens in (torch.tensor([1, 5]), torch.tensor([0, 2], dtype=torch.int32)):
        out = stair_readout_reference(q, k, v, n, bank_lengths=lens, eps=0.1)
        assert out.device == m and out.shape == (2, 2, 3, 6) and out.dtype == torch.float32

"""Every public op on meta tensors (shapes and dtypes, no values): the result and the gradients have the
shape, dtype and device the same call gives on CPU, with no value check run and no fallback warning."""
import warnings

import pytest
import torch

import treadle.ops as ops


def _cases(dev: str, grad: bool):
    D = torch.device(dev)
    g = torch.Generator().manual_seed(0)

    def T(*s, dtype=torch.float32, rg=False):
        t = torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) if dtype.is_floating_point else torch.ones(*s, dtype=dtype)
        return t.to(D).requires_grad_(rg and grad)

    yes = lambda *s: torch.ones(*s, dtype=torch.bool, device=D)  # noqa: E731
    return {
        "grpo_advantages": lambda: (ops.grpo_advantages(T(9), T(9, dtype=torch.int64)), ()),
        "grpo_advantages_float64_masks": lambda: (ops.grpo_advantages(T(9, dtype=torch.float64), T(9, dtype=torch.int32),
                                                                      valid=yes(9), flags=yes(9)), ()),
        "topk_entropy": lambda: (lambda x: (ops.topk_entropy(x, k=7, mask=yes(3, 5)), (x,)))(T(3, 5, 59, rg=True)),
        "topk_entropy_none": lambda: (lambda x: (ops.topk_entropy(x, k=7, reduction="none"), (x,)))(T(3, 5, 59, rg=True)),
        "topk_entropy_from_hidden": lambda: (lambda h, w: (ops.topk_entropy_from_hidden(h, w, k=7, mask=yes(3, 5)), (h, w)))(
            T(3, 5, 11, rg=True), T(59, 11, rg=True)),
        "stair_readout": lambda: (lambda q, n: (ops.stair_readout(q, T(2, 2, 6, 59), T(2, 2, 6, 13), n, eps=0.1, debug=True,
                                                                  bank_lengths=torch.full((2,), 6, device=D)), (q, n)))(
            T(2, 4, 3, 59, rg=True), T(4, 59, rg=True)),
        "gated_lora": lambda: (lambda x, b, w, gb: (ops.gated_lora(x, b, T(4, 11), T(13, 4), w, gb, scaling=2.0, L=-0.5,
                                                                   U=1.5, tau=1.0), (x, b, w, gb)))(
            T(2, 3, 11, rg=True), T(2, 3, 13, rg=True), T(11, rg=True), T(1, rg=True)),
        "gated_lora_linear": lambda: (lambda x, w, gb: (ops.gated_lora_linear(x, T(13, 11), T(13), T(4, 11), T(13, 4), w, gb,
                                                                              scaling=2.0, L=-0.5, U=1.5, tau=1.0),
                                                        (x, w, gb)))(T(2, 3, 11, rg=True), T(11, rg=True), T(1, rg=True)),
    }


NAMES = list(_cases("cpu", False))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_op_on_meta_tensors_matches_cpu_shapes(name, grad):
    want, want_inputs = _cases("cpu", grad)[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "falls back to the PyTorch reference" warning for meta tensors
        got, inputs = _cases("meta", grad)[name]()
    assert got.is_meta and (got.shape, got.dtype) == (want.shape, want.dtype)
    if grad and inputs:
        got.sum().backward()
        want.sum().backward()
        for a, b in zip(inputs, want_inputs):
            assert a.grad is not None and a.grad.is_meta and (a.grad.shape, a.grad.dtype) == (b.grad.shape, b.grad.dtype)


def test_value_checks_still_run_on_cpu():
    # the meta skip is for tensors without values only: the same bad values on CPU still raise
    with pytest.raises(ValueError, match="NaN/inf"):
        ops.grpo_advantages(torch.tensor([0.0, float("nan")]), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="no True"):
        ops.topk_entropy(torch.randn(2, 9), k=3, mask=torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"bank_lengths must lie in \[0, M=6\]"):
        ops.stair_readout(torch.randn(1, 2, 1, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(2, 8),
                          bank_lengths=torch.tensor([7]))


def test_meta_shapes_check_still_run():
    # only value checks are skipped: shapes, dtypes and devices are still checked on meta tensors
    m = torch.device("meta")
    with pytest.raises(ValueError, match="group_ids must have shape"):
        ops.grpo_advantages(torch.zeros(4, device=m), torch.zeros(3, dtype=torch.int64, device=m))
    with pytest.raises(ValueError, match="mask must have shape"):
        ops.topk_entropy(torch.zeros(2, 9, device=m), k=3, mask=torch.ones(3, dtype=torch.bool, device=m))

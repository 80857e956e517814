"""Test helpers shared by treadle's own tests and by users checking a kernel against its reference.

The tolerance rule (CONVENTIONS.md, after flash-attention's tests): a kernel's error against the
float64 reference may be at most ``factor`` times (2 for outputs, 3 for gradients) the error that
plain PyTorch makes in the same dtype, plus a small absolute floor for exact cases.
"""
from __future__ import annotations

import torch


def assert_close_verbose(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float,
                         name: str = "tensor", max_report: int = 5) -> None:
    """``torch.testing.assert_close`` with a report of the first mismatching elements and NaN/inf.

    Raises:
        AssertionError: shapes differ, NaN/inf patterns differ, or values differ beyond tolerance.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    if not torch.equal(nan_a, nan_e) or not torch.equal(inf_a, inf_e):
        raise AssertionError(f"{name}: NaN/inf mismatch: actual has {int(nan_a.sum())} NaN, {int(inf_a.sum())} inf; "
                             f"expected has {int(nan_e.sum())} NaN, {int(inf_e.sum())} inf")
    finite = torch.isfinite(e)
    diff = (a - e).abs()
    bad = finite & (diff > atol + rtol * e.abs())
    if bool(bad.any()):
        idx = bad.nonzero()[:max_report]
        rows = [f"  at {tuple(i.tolist())}: actual={a[tuple(i)].item():.8g} expected={e[tuple(i)].item():.8g}"
                for i in idx]
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.numel()} elements differ beyond atol={atol} rtol={rtol}; "
                             f"max abs diff {diff[finite].max().item():.3g}\n" + "\n".join(rows))


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference between ``x`` and ``ref`` (computed in float64)."""
    if x.numel() == 0:
        return 0.0
    return (x.detach().to(torch.float64).cpu() - ref.detach().to(torch.float64).cpu()).abs().max().item()


def assert_within_rule(kernel: torch.Tensor, plain: torch.Tensor, ref64: torch.Tensor, *, factor: float = 2.0,
                       floor: float = 1e-12, name: str = "tensor") -> None:
    """Assert ``err(kernel, ref64) <= factor * err(plain, ref64) + floor``.

    ``plain`` is plain PyTorch's result in the kernel's dtype; ``ref64`` the float64 reference.
    Use ``factor=2`` for outputs and ``3`` for gradients.
    """
    ek, ep = max_error(kernel, ref64), max_error(plain, ref64)
    if not ek <= factor * ep + floor:
        raise AssertionError(f"{name}: kernel error {ek:.3g} > {factor} x plain PyTorch error {ep:.3g} (+{floor:g})")

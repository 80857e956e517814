"""Test helpers shared by treadle's own tests and by users checking a kernel against its reference.

The tolerance rule (CONVENTIONS.md, after flash-attention's tests): a kernel's error against the
float64 reference may be at most ``factor`` times (2 for outputs, 3 for gradients) the error that
plain PyTorch makes in the same dtype, plus a small absolute floor for exact cases.

A green run must mean everything ran: :func:`require_backend`, :func:`require_module` and
:func:`skip_or_fail` skip on a developer machine but fail under CI (environment variable ``CI``).
"""
from __future__ import annotations

import os
from typing import NoReturn

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


# ---------------------------------------------------------------------------------------------------
# A green run must mean everything ran: skip locally, fail under CI.

# the warning treadle.dispatch gives once per op when it falls back to the reference (a regex for
# ``warnings.filterwarnings`` / pytest's ``filterwarnings``: no ":" in it, since that separates fields there)
FALLBACK_WARNING = r"treadle. [a-z_0-9]+ falls back to the PyTorch reference"


def in_ci() -> bool:
    """True when the environment variable ``CI`` is set to anything but empty/``0``/``false``/``no``
    (GitHub Actions, GitLab CI and most others set ``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """``pytest.skip(reason)`` on a developer machine; ``pytest.fail`` under CI, where the compiled
    extension, Triton and the dev dependencies are always installed, so a missing one is a bug."""
    import pytest

    if in_ci():
        pytest.fail(f"{reason} (CI is set: a missing backend or dependency fails instead of skipping)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def backend_missing(op: str, backend: str, device: str = "cpu") -> str | None:
    """None if ``backend`` can run the treadle op ``op`` on ``device`` tensors here, else why not.

    Raises:
        KeyError: ``op`` is not a registered treadle op.
    """
    from treadle import dispatch, ops  # noqa: F401  (importing ops registers them)

    try:
        dispatch.choose(op, device, backend)
    except dispatch.BackendUnavailableError as err:
        return str(err)
    return None


def require_backend(op: str, backend: str = "cpp", device: str = "cpu"):
    """A pytest mark for tests of one backend of one op: nothing when the backend is there; a skip
    naming the reason when it is not; under CI a ``treadle_missing`` mark that tests/conftest.py
    turns into a failure (so the run is red, never green with the backend untested).

    Use as ``@require_backend("stair_readout")`` or ``pytest.param("cpp", marks=require_backend(op))``.
    """
    import pytest

    why = backend_missing(op, backend, device)
    if why is None:
        return pytest.mark.treadle_requires(op=op, backend=backend)
    reason = f"the {backend} backend of {op} is unavailable on {device}: {why}"
    if in_ci():
        return pytest.mark.treadle_missing(reason=reason)
    return pytest.mark.skip(reason=reason)


def sandbox_unavailable() -> str | None:
    """Why :mod:`treadle.sandbox` cannot isolate code on this machine (e.g. unprivileged user namespaces
    disabled), or None where it can: the one check tests that need the sandbox skip on."""
    from treadle.sandbox import SandboxUnavailableError, isolation_mode

    try:
        isolation_mode()
    except SandboxUnavailableError as err:
        return str(err)
    return None


def require_module(name: str):
    """Import and return the optional dependency ``name`` (a module or a submodule of it).

    If the distribution's top-level package (``verl`` for ``verl.trainer.ppo.core_algos``) is not
    installed: skip, naming it, or fail under CI. Any other import error (the package is there but a
    submodule is missing, or its own imports break) propagates, so a broken or incompatible install is
    never mistaken for "not installed".
    """
    import importlib

    top = name.split(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == top:
            skip_or_fail(f"optional dependency {top!r} is not installed (needed for {name!r})")
        raise


def assert_usage_error(result, *words: str) -> str:
    """Check that a CLI call (a ``typer.testing.CliRunner`` result) ended the way every treadle usage error
    must: exit code 2, no Python exception or traceback, exactly one non-empty output line starting with
    ``Error: `` and containing each of ``words`` (e.g. the flag's name). Returns that line.

    Raises:
        AssertionError: any of the above does not hold (the message shows the output)."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


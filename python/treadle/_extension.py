"""Lazy loading of the compiled extension ``treadle._C``.

``import treadle`` never needs the extension. The first op that wants the C++ (or CUDA) backend
calls :func:`load`; if the import fails, the reason is kept for :func:`treadle.backends` and the
ops fall back to their reference with one warning.
"""
from __future__ import annotations

import functools
import importlib

import torch

NAMESPACE = "treadle_C"


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str]:
    try:
        importlib.import_module("treadle._C")
    except ImportError as err:  # not built, or built against another torch
        return False, f"treadle._C is not importable ({err}); build it with `pip install --no-build-isolation -e .`"
    return True, "treadle._C loaded"


def available() -> bool:
    """True when ``treadle._C`` imports (so ``torch.ops.treadle_C.*`` CPU kernels exist)."""
    return _load()[0]


def status() -> str:
    """One line: loaded, or why not."""
    return _load()[1]


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether ``torch.ops.treadle_C.<op>`` has a kernel for ``dispatch_key`` ("CPU", "CUDA")."""
    if not available():
        return False
    name = f"{NAMESPACE}::{op}"
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key))
    except RuntimeError:
        return False


def op(name: str):
    """``torch.ops.treadle_C.<name>``; raises RuntimeError naming the build problem if missing."""
    if not available():
        raise RuntimeError(status())
    return getattr(getattr(torch.ops, NAMESPACE), name)

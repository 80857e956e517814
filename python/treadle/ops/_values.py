"""When an op may read tensor values in its argument checks.

Checks that look at values (NaN/inf rewards, an all-False mask, bank lengths in range) need data on
the host. Two cases have none: tracing under ``torch.compile`` (fake tensors) and meta tensors
(``device="meta"``: shapes and dtypes only, used to plan memory or build models without allocating).
In both every op skips its value checks and returns a result of the right shape, dtype and device,
exactly as the registered fake implementations do; the argument checks on types, shapes and devices
still run.
"""
from __future__ import annotations

import torch


def values_readable(*tensors: torch.Tensor | None) -> bool:
    """False under ``torch.compile`` tracing or when any given tensor is a meta tensor, else True."""
    if torch.compiler.is_compiling():
        return False
    return not any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)

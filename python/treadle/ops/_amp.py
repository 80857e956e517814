"""Autocast policy helpers shared by the ops (one place, so every op and backend follows one rule).

Policy, per op (each op's docstring states its own):

* Every op's custom-op bodies and backward functions run with autocast *disabled*: the kernels
  (C++, Triton, the reference maths) see exactly the dtypes the public function decided on, so no
  ``at::mm`` inside a C++ kernel is silently recast and no backend's result moves under autocast.
* The public function decides the dtypes, once, before the custom op: ops that are matrix products
  (``stair_readout``'s q/k/v, ``gated_lora``'s x/base_out/A/B and base weight, the GEMM of
  ``topk_entropy_from_hidden``) cast their float16/bfloat16/float32 inputs to the autocast dtype,
  as ``torch.nn.functional.linear`` / ``scaled_dot_product_attention`` do under autocast; reductions
  that autocast runs in float32 (``topk_entropy``, like ``log_softmax``) and ``grpo_advantages``
  take their inputs as given. float64 inputs are never cast (autocast leaves float64 alone too).
* The casts are ordinary differentiable ``Tensor.to`` calls, so gradients flow back to the caller's
  tensors in their own dtypes.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for ``device_type`` ("cpu", "cuda"), or None when autocast is off."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t.to(dtype)`` for a float16/bfloat16/float32 tensor when ``dtype`` is set; else ``t`` as is."""
    if t is None or dtype is None or t.dtype not in _CASTABLE or t.dtype == dtype:
        return t
    return t.to(dtype)


@contextlib.contextmanager
def disabled():
    """Autocast off for CPU and CUDA for the duration (a no-op when it is already off)."""
    with contextlib.ExitStack() as stack:
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                stack.enter_context(torch.autocast(dev, enabled=False))
        yield


def no_autocast(fn):
    """Decorator: run ``fn`` (a custom op body or a backward) with autocast disabled."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return fn(*args, **kwargs)  # the common case: no context manager to enter
        with disabled():
            return fn(*args, **kwargs)
    return wrapper

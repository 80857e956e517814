"""Which backend runs an op, and why.

Rule (DESIGN.md, "Dispatch rule"), applied per call from the device of the inputs:

* ``backend=`` argument, else the ``TREADLE_BACKEND`` environment variable: used if that backend
  implements the op on that device, else :class:`BackendUnavailableError`.
* CUDA tensor: the op's preferred GPU kernels in order (``"cuda"`` needs ``treadle._C`` built with
  CUDA; ``"triton"`` needs an importable triton), else the reference.
* CPU tensor: ``"triton"`` when ``TRITON_INTERPRET=1`` (the Triton interpreter, for tests), else
  ``"cpp"`` from ``treadle._C``, else the reference with one warning.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass

import torch

from treadle import _extension

BACKENDS = ("reference", "cpp", "cuda", "triton")


class BackendUnavailableError(RuntimeError):
    """A backend was asked for that does not implement the op on the given device here."""


class UnknownBackendError(BackendUnavailableError, ValueError):
    """``backend=`` (or ``TREADLE_BACKEND``) is not a backend name at all: a bad argument value, so also a
    ValueError (and still a BackendUnavailableError for code that catches that)."""


@dataclass(frozen=True)
class OpSpec:
    name: str
    cpu: tuple[str, ...]   # backends implementing the op on CPU tensors (besides the reference)
    gpu: tuple[str, ...]   # backends for CUDA tensors, in order of preference
    note: str = ""         # what runs when the op has no kernel at all (cpu == gpu == ())


_REGISTRY: dict[str, OpSpec] = {}
_warned: set[str] = set()


def register(name: str, *, cpu: tuple[str, ...] = ("cpp",), gpu: tuple[str, ...] = ("triton",),
             note: str = "") -> OpSpec:
    """Declare an op and the backends it has (called once by each ``treadle/ops`` module).

    An op with no kernel (``cpu=()``, ``gpu=()``) runs its PyTorch path everywhere; ``note`` says
    exactly what that is, and :func:`table` shows it as the reason."""
    spec = OpSpec(name, tuple(cpu), tuple(gpu), note)
    _REGISTRY[name] = spec
    return spec


def registered() -> dict[str, OpSpec]:
    return dict(_REGISTRY)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: why meta tensors run the reference: no fallback, nothing to warn about
_META = "meta tensors hold no values: the reference gives the result's shape, dtype and device"


def _why_not(op: str, backend: str, device_type: str) -> str | None:
    """None if ``backend`` can run ``op`` on ``device_type`` here, else the reason it cannot."""
    spec = _REGISTRY[op]
    if backend == "reference":
        return None
    if backend == "cpp":
        if "cpp" not in spec.cpu:
            return f"{op} has no C++ kernel" + (f" ({spec.note})" if spec.note else "")
        if device_type != "cpu":
            return f"the C++ backend of {op} runs on CPU tensors only"
        return None if _extension.has_kernel(op, "CPU") else _extension.status()
    if backend == "cuda":
        if device_type != "cuda" or "cuda" not in spec.gpu:
            return f"{op} has no CUDA kernel for {device_type} tensors"
        if not _extension.has_kernel(op, "CUDA"):
            return "treadle._C was built without CUDA kernels (needs nvcc and a CUDA build of torch)"
        return None
    if backend == "triton":
        if "triton" not in spec.gpu and "triton" not in spec.cpu:
            return f"{op} has no Triton kernel" + (f" ({spec.note})" if spec.note else "")
        if not triton_available():
            return "triton is not installed"
        if device_type == "cpu" and not triton_interpret():
            return "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
        if device_type not in ("cpu", "cuda"):
            return f"Triton kernels take CPU (interpreter) or CUDA tensors, not {device_type}"
        return None
    return f"unknown backend {backend!r}; expected one of {BACKENDS}"


def choose(op: str, device: torch.device | str, backend: str | None = None) -> tuple[str, str]:
    """Return ``(backend, reason)`` for running ``op`` on tensors of ``device``.

    Raises:
        KeyError: ``op`` is not a registered treadle op.
        BackendUnavailableError: ``backend`` (or ``TREADLE_BACKEND``) names a backend that cannot
            run the op on that device here; the message says why. A name that is no backend at all
            raises its subclass :class:`UnknownBackendError`, also a ValueError.
    """
    if op not in _REGISTRY:
        raise KeyError(f"unknown treadle op {op!r}; registered: {sorted(_REGISTRY)}")
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _choose(op, device_type, backend, os.environ.get("TREADLE_BACKEND") or None, triton_interpret())


@functools.lru_cache(maxsize=256)
def _choose(op: str, device_type: str, backend: str | None, env_backend: str | None,
            interpret: bool) -> tuple[str, str]:
    # cached per (op, device, request, environment): the extension and triton do not come and go
    requested = backend or env_backend
    if requested:
        why = _why_not(op, requested, device_type)
        if why is not None:
            cls = UnknownBackendError if requested not in BACKENDS else BackendUnavailableError
            raise cls(f"backend {requested!r} cannot run {op} on {device_type}: {why}")
        return requested, "requested" if backend else "TREADLE_BACKEND"
    spec = _REGISTRY[op]
    if not spec.cpu and not spec.gpu and spec.note:
        return "reference", spec.note
    if device_type == "cuda":
        for cand in spec.gpu:
            if _why_not(op, cand, "cuda") is None:
                return cand, f"{cand} kernel for CUDA tensors"
        return "reference", "no GPU kernel available (" + "; ".join(
            f"{c}: {_why_not(op, c, 'cuda')}" for c in spec.gpu) + ")"
    if device_type == "cpu":
        if "triton" in spec.cpu + spec.gpu and _why_not(op, "triton", "cpu") is None:
            return "triton", "TRITON_INTERPRET=1 forces the Triton kernel on CPU tensors"
        if "cpp" in spec.cpu:
            why = _why_not(op, "cpp", "cpu")
            if why is None:
                return "cpp", "C++ kernel from treadle._C"
            return "reference", why
    if device_type == "meta":
        return "reference", _META
    return "reference", f"no kernel for {device_type} tensors"


@torch.compiler.assume_constant_result  # evaluated once at trace time: no graph break under torch.compile
def resolve(op: str, device: torch.device | str, backend: str | None = None) -> str:
    """Like :func:`choose` but returns the backend only, warning once per op on a fallback."""
    name, reason = choose(op, device, backend)
    if name == "reference" and backend is None and op not in _warned and reason != _META:
        spec = _REGISTRY[op]
        if spec.cpu or spec.gpu:
            _warned.add(op)
            warnings.warn(f"treadle: {op} falls back to the PyTorch reference: {reason}", stacklevel=3)
    return name


def table() -> dict[str, dict[str, dict[str, str]]]:
    """Per op, per device type, the backend a tensor there will use and why."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for op in sorted(_REGISTRY):
        out[op] = {}
        for dev in ("cpu", "cuda"):
            name, reason = choose(op, dev)
            out[op][dev] = {"backend": name, "reason": reason}
    return out

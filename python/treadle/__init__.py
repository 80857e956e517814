"""treadle: fused kernels and training-side machinery for LLM post-training.

``import treadle`` is cheap and works without the compiled extension; ops load their backend on
first use. :func:`backends` says which backend each op uses for CPU and CUDA tensors, and why.
"""
from treadle._version import __version__


def backends() -> dict:
    """Per op: ``{"cpu": {"backend", "reason"}, "cuda": {...}}`` as the dispatcher would choose now."""
    from treadle import dispatch, ops  # noqa: F401  (importing ops registers them)

    return dispatch.table()


def __getattr__(name):  # lazy subpackages: treadle.ops, treadle.grpo, ...
    import importlib

    if name in {"ops", "reference", "grpo", "dispatch", "models", "data", "stair", "scale", "weft", "rsi", "llm"}:
        return importlib.import_module(f"treadle.{name}")
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")


__all__ = ["__version__", "backends"]

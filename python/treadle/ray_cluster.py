"""Connecting to Ray (the optional ``[ray]`` extra) for the scale-out paths.

Nothing in treadle imports ``ray`` unless a Ray address is given: ``--ray auto`` (join the cluster that
``ray start --head`` made on this machine, or ``RAY_ADDRESS``), ``--ray local`` (start a private local
instance), or an address such as ``ray://head:10001`` / ``head:6379``. When Ray is already initialised in
this process (a test fixture, a notebook), that instance is used as is.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RayUnavailableError", "check_address", "check_ray_option", "no_cluster_message", "ensure_ray"]


class RayUnavailableError(RuntimeError):
    """Ray was asked for but is not installed (``pip install 'treadle[ray]'``)."""


def check_address(address: str) -> str:
    """``address`` if it names a Ray cluster; ValueError otherwise (before anything connects).

    Accepted: ``auto``, ``local``, ``ray://HOST:PORT``, ``HOST:PORT``.
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"a Ray address must be 'auto', 'local', 'ray://HOST:PORT' or 'HOST:PORT', got {address!r}")
    a = address.strip()
    if a in ("auto", "local"):
        return a
    host, sep, port = a.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a Ray address must be 'auto', 'local', 'ray://HOST:PORT' or 'HOST:PORT', got {address!r}")
    return a


def check_ray_option(address: str) -> str:
    """The checks of a CLI's ``--ray`` value, before any work (no connection is made): a well-formed
    address (:func:`check_address`) and Ray installed.

    Returns:
        The address, stripped.

    Raises:
        ValueError: a malformed address. RayUnavailableError: Ray is not installed. The message does not
            name the flag: the CLI prefixes it (``--ray: ...``).
    """
    import importlib.util

    a = check_address(address)
    if importlib.util.find_spec("ray") is None:
        raise RayUnavailableError("Ray is not installed; pip install 'treadle[ray]'")
    return a


def no_cluster_message(address: str, err: BaseException) -> str:
    """One line for a ``ConnectionError`` from :func:`ensure_ray`: no Ray cluster answered at ``address``."""
    return " ".join(f"no Ray cluster answered at {address!r}: {err}".split())


def ensure_ray(address: str | None = "auto", **init_kwargs: Any) -> Any:
    """The ``ray`` module, connected: the running instance of this process, else ``ray.init(address)``.

    ``address="local"`` (or None) starts a private local instance (``init_kwargs`` such as ``num_cpus`` apply).

    Raises:
        RayUnavailableError: ray is not installed.
        ValueError: a malformed address (see :func:`check_address`).
        ConnectionError: ray's own error when no cluster answers at ``address``.
    """
    try:
        import ray
    except ModuleNotFoundError as err:
        raise RayUnavailableError("Ray is not installed; pip install 'treadle[ray]' (or pip install ray)") from err
    if ray.is_initialized():
        return ray
    a = None if address is None else check_address(address)
    if a in (None, "local"):
        init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", False)
    ray.init(address=None if a in (None, "local") else a, **init_kwargs)
    return ray

"""Content-addressed registry of WEFT server modules (seed: WEFT 4.1, MegaMCP registry).

A server is registered once, from its module source, and referenced afterwards by its hash:
``sha256`` of the canonical JSON of (source code, server name, backend, schema, tool definitions:
names, descriptions, JSON input schemas and contracts). Registering the same code again returns the
same hash. At registration the module is imported once (in a fresh, independent module object) to
read its tool definitions, and :func:`treadle.weft.runtime.isolation.check_source` decides whether sessions
may share one imported copy (``shared``) or each need their own (``isolated``).
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import sys
import threading
import types
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from treadle.weft.runtime.errors import ServerImportError, UnknownServerError
from treadle.weft.runtime.isolation import SideEffectReport, check_source
from treadle.weft.runtime.object_state import SERVER_MODULE_PREFIX
from treadle.weft.runtime.server import WeftServer
from treadle.weft.runtime.state import BackendKind

Isolation = Literal["shared", "isolated"]
_counter = itertools.count()
_lock = threading.Lock()


class ServerSpec(BaseModel):
    """A registered server: identity, code, tool definitions and isolation level."""

    model_config = ConfigDict(frozen=True)

    hash: str
    name: str
    backend: BackendKind
    filename: str
    source: str
    tools: list[dict[str, Any]]
    report: SideEffectReport
    isolation: Isolation

    @property
    def tool_names(self) -> list[str]:
        return [t["name"] for t in self.tools]

    def tool(self, name: str) -> dict[str, Any] | None:
        return next((t for t in self.tools if t["name"] == name), None)


def import_server_module(source: str, filename: str = "<server>",
                         tag: str = "anon") -> tuple[types.ModuleType, WeftServer]:
    """Import ``source`` as a new, independent module object and return it with its ``server``.

    Each call executes the module afresh under a unique name (``treadle_weft_server_<tag>_<n>``), so
    module globals and class attributes are private to the returned module. The module stays in
    ``sys.modules`` (pickle/pydantic need it) until :func:`release_module`.

    Raises:
        ServerImportError: the code raises on import, or defines no ``WeftServer`` named ``server``.
    """
    with _lock:
        name = f"{SERVER_MODULE_PREFIX}{tag}_{next(_counter)}"
    mod = types.ModuleType(name)
    mod.__file__ = filename
    sys.modules[name] = mod
    try:
        # registered server code (never model output) runs as the body of a fresh module
        exec(compile(source, filename, "exec"), mod.__dict__)  # noqa: S102
    except BaseException as err:  # noqa: BLE001  (any import failure, incl. SystemExit, is reported typed)
        sys.modules.pop(name, None)
        raise ServerImportError(f"server module {filename} failed to import: {type(err).__name__}: {err}") from err
    server = getattr(mod, "server", None)
    if not isinstance(server, WeftServer):
        sys.modules.pop(name, None)
        raise ServerImportError(f"server module {filename} must define `server = WeftServer(...)`, "
                                f"got {type(server).__name__}")
    return mod, server


def release_module(module: types.ModuleType) -> None:
    """Drop an imported server module from ``sys.modules`` (its objects live while referenced)."""
    if sys.modules.get(module.__name__) is module:
        del sys.modules[module.__name__]


def _read_source(server: str | Path | types.ModuleType) -> tuple[str, str]:
    if isinstance(server, types.ModuleType):
        filename = getattr(server, "__file__", None) or f"<{server.__name__}>"
        try:
            return inspect.getsource(server), filename
        except (OSError, TypeError) as err:
            raise ServerImportError(f"cannot read the source of module {server.__name__}: {err}") from err
    if isinstance(server, Path):
        try:
            return server.read_text(encoding="utf-8"), str(server)
        except OSError as err:
            raise ServerImportError(f"cannot read server file {server}: {err}") from err
    if isinstance(server, str):
        return server, "<server source>"
    raise TypeError(f"server must be Python source (str), a pathlib.Path to a .py file or a module, "
                    f"got {type(server).__name__}")


def server_hash(source: str, server: WeftServer, tools: list[dict[str, Any]]) -> str:
    """sha256 hex of the canonical JSON of code + name + backend + schema + tool definitions."""
    payload = {"source": source, "name": server.name, "backend": server.backend, "schema": server.schema,
               "state_class": getattr(server.state_class, "__qualname__", None), "tools": tools}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


class Registry:
    """Servers by content hash. Thread-safe for registration and lookup."""

    def __init__(self) -> None:
        self._specs: dict[str, ServerSpec] = {}
        self._lock = threading.Lock()

    def register(self, server: str | Path | types.ModuleType, *, isolation: Isolation | None = None) -> str:
        """Register a server module (source str, ``Path`` or module); return its hash (idempotent).

        Args:
            server: the module's Python source, a ``pathlib.Path`` to it, or an imported module.
            isolation: ``None`` (decide from the static check), or force ``"isolated"``; forcing
                ``"shared"`` on a module with findings is allowed for experiments (sessions may then leak).

        Raises:
            TypeError: ``server`` or ``isolation`` has the wrong type.
            ServerImportError: the source cannot be read or the module fails to import.
            ValueError: the same code is already registered with a different forced isolation.
        """
        if isolation not in (None, "shared", "isolated"):
            raise TypeError(f"isolation must be None, 'shared' or 'isolated', got {isolation!r}")
        source, filename = _read_source(server)
        module, weft = import_server_module(source, filename, tag="reg")
        try:
            tools = weft.tool_definitions()
        finally:
            release_module(module)
        h = server_hash(source, weft, tools)
        report = check_source(source, filename)
        level: Isolation = isolation or report.isolation
        with self._lock:
            old = self._specs.get(h)
            if old is not None:
                if isolation is not None and old.isolation != level:
                    raise ValueError(f"server {h[:12]} is registered as {old.isolation!r}; cannot re-register as "
                                     f"{level!r}")
                return h
            self._specs[h] = ServerSpec(hash=h, name=weft.name, backend=weft.backend, filename=filename,
                                        source=source, tools=tools, report=report, isolation=level)
        return h

    def spec(self, server_hash: str) -> ServerSpec:
        """The :class:`ServerSpec` of a hash (a unique prefix of >= 8 hex digits also works).

        Raises:
            UnknownServerError: no such server.
        """
        spec = self._specs.get(server_hash)
        if spec is None and isinstance(server_hash, str) and len(server_hash) >= 8:
            hits = [s for h, s in self._specs.items() if h.startswith(server_hash)]
            spec = hits[0] if len(hits) == 1 else None
        if spec is None:
            raise UnknownServerError(f"no registered server with hash {server_hash!r}; have "
                                     f"{[h[:12] for h in self._specs]}")
        return spec

    def load(self, server_hash: str) -> tuple[types.ModuleType, WeftServer]:
        """A fresh, independent import of a registered server module."""
        spec = self.spec(server_hash)
        return import_server_module(spec.source, spec.filename, tag=spec.hash[:12])

    def hashes(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, server_hash: object) -> bool:
        return server_hash in self._specs

    def __len__(self) -> int:
        return len(self._specs)

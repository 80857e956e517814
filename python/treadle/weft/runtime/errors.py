"""Error kinds and exceptions of the WEFT runtime.

Tool-call failures are *values* (a :class:`ErrorKind` on a ``ToolOutcome``), recorded in the session
log and the per-tool statistics, never exceptions that stop the runtime: the agent reads them and the
verifier attributes them (policy vs environment vs infrastructure, seed: WEFT section 4.1). The
exceptions below are for misuse of the runtime API itself (unknown session, bad snapshot, ...).
"""
from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    """Closed set of tool-call error kinds (OpenEnv-style taxonomy).

    - ``invalid_args``: arguments fail the tool's input schema, or the call string is not a call.
    - ``unknown_tool``: no tool of that name on the session's server.
    - ``execution_error``: the tool ran and reported an error (``isError`` result).
    - ``timeout``: the call exceeded the runtime's per-call limit.
    - ``crash``: the server process or connection died during the call.
    - ``infrastructure``: the runtime failed around the call (server import, checkpoint store, ...).
    """

    invalid_args = "invalid_args"
    unknown_tool = "unknown_tool"
    execution_error = "execution_error"
    timeout = "timeout"
    crash = "crash"
    infrastructure = "infrastructure"


class WeftError(Exception):
    """Base class of the runtime's exceptions."""


class SnapshotSchemaError(WeftError, ValueError):
    """A snapshot does not match the schema its server declares (lists each difference)."""


class ServerImportError(WeftError, RuntimeError):
    """A server module failed to import or does not define a ``WeftServer`` named ``server``."""


class UnknownServerError(WeftError, KeyError):
    """No server with that hash is registered."""


class UnknownSessionError(WeftError, KeyError):
    """No open session with that id."""


class SessionClosedError(WeftError, RuntimeError):
    """The session was closed."""


class SessionBusyError(WeftError, RuntimeError):
    """A view of a session's state (snapshot, diff, state) was asked while a tool call is in flight."""


class CallParseError(WeftError, ValueError):
    """A call string is not a single well-formed call with literal arguments."""


class StaleGenerationError(WeftError, RuntimeError):
    """A checkpoint write carried a generation older than the session's current one (stale worker)."""


class CheckpointStoreError(WeftError, OSError):
    """The checkpoint object store could not be read or written."""


class CheckpointIntegrityError(CheckpointStoreError):
    """A checkpoint failed authentication (missing/wrong MAC, digest mismatch) or holds objects the
    restricted unpickler refuses: nothing of it was deserialised or run."""


class UnsupportedOperationError(WeftError, NotImplementedError):
    """The operation needs in-process state access (e.g. fork/diff of a stdio/HTTP session)."""

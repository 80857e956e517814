"""What the runtime hands back: tool-call outcomes and session log entries."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime.errors import ErrorKind


class ToolOutcome(BaseModel):
    """Result of one tool call as the agent and the verifier see it.

    Attributes:
        session_id, seq: the session and the call's position in its log.
        call: the structured call (name ``"<unparsed>"`` when a call string did not parse).
        ok: True when the tool ran and returned normally.
        result: the parsed return value (JSON when the tool returned JSON), None on error.
        text: the text content the server returned (error message on failure).
        error_kind: None on success, else the typed :class:`ErrorKind`.
        latency_ms: wall time of the dispatch in milliseconds (None if never dispatched).
    """

    session_id: str
    seq: int
    call: ToolCall
    ok: bool
    result: Any = None
    text: str = ""
    error_kind: ErrorKind | None = None
    latency_ms: float | None = None


class LogEntry(BaseModel):
    """One event of a session (or of the runtime when ``session_id`` is None)."""

    seq: int
    time: float
    session_id: str | None
    event: Literal["create", "call", "reset", "fork", "restore", "checkpoint", "close", "error", "register"]
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    ok: bool = True
    error_kind: ErrorKind | None = None
    message: str = ""
    latency_ms: float | None = None
    generation: int | None = None

"""Frozen records of model calls: what was asked, what came back, what failed and why.

All are pydantic models with ``extra="forbid"``; results and failures are plain data a batch can
store as JSON (cache entries, ledgers, run folders).
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from treadle.untrusted import mask_secrets

__all__ = ["ToolCall", "Usage", "TokenLogprob", "ChatResult", "FailureKind", "Failure", "StructuredResult",
           "LLMCallError"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolCall(_Record):
    """A native tool call the model asked for (OpenAI ``tool_calls`` entry)."""

    id: str = Field(description="Call id, echoed back in the tool message.")
    name: str = Field(description="Function name.")
    arguments: str = Field(description="Arguments exactly as the model wrote them (a JSON string, maybe invalid).")


class Usage(_Record):
    """Token counts reported by the endpoint (0 when it reports none)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class TokenLogprob(_Record):
    """One generated token's log-probability (and the top alternatives when asked)."""

    token: str
    logprob: float
    top: dict[str, float] | None = Field(None, description="Top-k alternatives: token -> logprob.")


class ChatResult(_Record):
    """One sample of a chat or text completion.

    ``finish_reason`` is always kept: ``"length"`` means the turn was cut by ``max_tokens``.
    ``prompt_token_ids`` / ``token_ids`` / ``logprobs`` are what the endpoint returned (vLLM, SGLang),
    never a re-tokenisation; ``None`` when it returned none.
    """

    schema_version: Literal[1] = 1
    kind: Literal["chat", "completion"] = Field(description="Chat completion or text completion.")
    model: str = Field(description="Model name the endpoint reported (or was asked for).")
    text: str = Field(description="Generated text ('' when the model only called tools).")
    tool_calls: tuple[ToolCall, ...] = Field((), description="Native tool calls, in order.")
    finish_reason: str = Field(description="'stop', 'length', 'tool_calls', 'content_filter' or what the server said.")
    usage: Usage = Field(default_factory=Usage)
    prompt_token_ids: tuple[int, ...] | None = Field(None,
                                                     description="Prompt token ids, when the endpoint returns them.")
    token_ids: tuple[int, ...] | None = Field(None, description="Generated token ids, when the endpoint returns them.")
    logprobs: tuple[TokenLogprob, ...] | None = Field(None, description="Per generated token, when returned.")
    key: str = Field(description="Cache key (hash of the canonical request incl. sample index).")
    sample_index: int = Field(0, description="Index of this sample in its group.")
    latency_s: float = Field(0.0, description="Wall time of the call that produced it (0 for cache hits).")
    cached: bool = Field(False, description="Served from the on-disk cache.")
    recorded: bool = Field(False, description="Replayed by a RecordedBackend (fixtures), not a live model.")


class FailureKind(str, Enum):
    """Closed set of reasons a call produced no usable result. ``blame`` says whose fault it is."""

    connection = "connection"          # unreachable / reset / DNS: provider side or misconfigured URL
    timeout = "timeout"                # no answer within timeout_s
    rate_limited = "rate_limited"      # 429 after all retries
    server_error = "server_error"      # 5xx after all retries
    bad_request = "bad_request"        # other 4xx (wrong model name, too long prompt...): never retried
    auth = "auth"                      # 401/403
    bad_response = "bad_response"      # unparseable body, empty choices, missing fields
    invalid_output = "invalid_output"  # structured output never validated within max_repairs
    budget_exhausted = "budget_exhausted"  # a UsageLimits budget was spent before this call: not sent

    @property
    def blame(self) -> str:
        return {"bad_request": "user", "auth": "user", "budget_exhausted": "user",
                "invalid_output": "model"}.get(self.value, "provider")

    @property
    def retryable(self) -> bool:
        return self in (FailureKind.connection, FailureKind.timeout, FailureKind.rate_limited, FailureKind.server_error)


class Failure(_Record):
    """A call that produced no usable result (returned in place of a result by batch calls and
    :meth:`LLMClient.structured`)."""

    schema_version: Literal[1] = 1
    kind: FailureKind
    blame: str = Field(description="'provider', 'user' (misuse/config) or 'model' (the output itself).")
    message: str = Field(description="What went wrong, for humans (never contains the API key).")
    role: str
    key: str | None = Field(None, description="Cache key of the request, when one was built.")
    status_code: int | None = Field(None, description="HTTP status, when there was one.")
    attempts: int = Field(1, description="Attempts made (1 + retries, or 1 + repairs for invalid_output).")
    last_output: str | None = Field(None, description="invalid_output: the model's last text.")

    @field_validator("message", "last_output")
    @classmethod
    def _masked(cls, v: str | None) -> str | None:
        # the boundary every failure crosses on its way to a message, a trajectory or a run folder
        return None if v is None else mask_secrets(v)

    @classmethod
    def of(cls, kind: FailureKind, message: str, role: str, **kw) -> "Failure":
        return cls(kind=kind, blame=kind.blame, message=message, role=role, **kw)


class StructuredResult(_Record):
    """A structured-output call whose answer validated: ``value`` is the parsed pydantic model."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    value: Any = Field(description="Instance of the requested pydantic model.")
    result: ChatResult = Field(description="The call whose text validated.")
    attempts: int = Field(description="1 + repair re-asks used.")


class LLMCallError(RuntimeError):
    """Raised by :meth:`LLMClient.chat` / :meth:`complete` when a call fails; ``.failure`` is the record.
    Batch calls (:meth:`LLMClient.gather`) return the :class:`Failure` instead of raising."""

    def __init__(self, failure: Failure):
        super().__init__(f"[{failure.kind.value}] {failure.message}")
        self.failure = failure

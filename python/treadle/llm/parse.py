"""Raw OpenAI-compatible response bodies -> :class:`ChatResult` (chat and text completions), keeping
``finish_reason``, native tool calls, usage, and token ids / logprobs where the endpoint returned them
(vLLM ``return_token_ids``: ``prompt_token_ids`` on the body, ``token_ids`` on the choice; SGLang alike)."""
from __future__ import annotations

import json

from treadle.llm.backends import BadResponseError
from treadle.llm.records import ChatResult, TokenLogprob, ToolCall, Usage
from treadle.untrusted import as_count, clip

__all__ = ["parse_response"]


def _ints(v) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
        raise BadResponseError(f"token ids must be a list of ints, got {clip(v, 80)}")
    return tuple(v)


def _chat_logprobs(lp) -> tuple[TokenLogprob, ...] | None:
    if not lp or not lp.get("content"):
        return None
    return tuple(TokenLogprob(token=t["token"], logprob=t["logprob"],
                              top={a["token"]: a["logprob"] for a in t.get("top_logprobs") or []} or None)
                 for t in lp["content"])


def _completion_logprobs(lp) -> tuple[TokenLogprob, ...] | None:
    if not lp or not lp.get("tokens"):
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return tuple(TokenLogprob(token=t, logprob=l, top=top or None)
                 for t, l, top in zip(lp["tokens"], lp["token_logprobs"], tops))


def parse_response(data: dict, *, kind: str, model: str, key: str, sample_index: int, latency_s: float,
                   recorded: bool) -> ChatResult:
    """Parse one response body. Raises :class:`BadResponseError` on an empty choice list or missing fields."""
    if not isinstance(data, dict):
        raise BadResponseError(f"response body is a {type(data).__name__}, expected a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise BadResponseError(f"response has no choices (got {clip(choices, 80)})")
    ch = choices[0]
    try:
        if kind == "chat":
            msg = ch["message"]
            text = msg.get("content") or ""
            calls = []
            for tc in msg.get("tool_calls") or []:
                fn = tc["function"]
                args = fn.get("arguments", "")
                calls.append(ToolCall(id=tc.get("id") or f"call_{len(calls)}", name=fn["name"],
                                      arguments=args if isinstance(args, str) else json.dumps(args)))
            logprobs = _chat_logprobs(ch.get("logprobs"))
        else:
            text, calls = ch["text"], []
            logprobs = _completion_logprobs(ch.get("logprobs"))
        usage = data.get("usage") or {}
        prompt_ids = data.get("prompt_token_ids", ch.get("prompt_token_ids"))
        return ChatResult(kind=kind, model=data.get("model") or model, text=text, tool_calls=tuple(calls),
                          finish_reason=ch.get("finish_reason") or "unknown",
                          usage=Usage(prompt_tokens=as_count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
                                      completion_tokens=as_count(usage.get("completion_tokens"),
                                                                 "usage.completion_tokens")),
                          prompt_token_ids=_ints(prompt_ids), token_ids=_ints(ch.get("token_ids")),
                          logprobs=logprobs, key=key, sample_index=sample_index, latency_s=latency_s,
                          recorded=recorded)
    except BadResponseError:
        raise
    except Exception as err:  # noqa: BLE001 -- any shape of a hostile body is a bad response, never a raise
        try:
            shown = json.dumps(data)
        except (ValueError, TypeError, RecursionError):
            shown = f"({type(data).__name__} body not printable)"
        raise BadResponseError(f"malformed {kind} response ({type(err).__name__}: {clip(err, 200)}): "
                               f"{clip(shown, 200)}") from None

"""Where requests go: a live OpenAI-compatible endpoint (:class:`OpenAIBackend`, over the official
``openai`` SDK) or recorded responses replayed by request hash (:class:`RecordedBackend`).

A backend sends one wire payload and returns the endpoint's raw JSON body as a dict; parsing,
retries, caching and accounting live in :class:`treadle.llm.client.LLMClient`.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Protocol

from treadle.llm.config import RoleConfig
from treadle.untrusted import UntrustedInputError, clip, loads_json

__all__ = ["Backend", "OpenAIBackend", "RecordedBackend", "Recorder", "EndpointError", "UnrecordedRequestError",
           "BadResponseError"]


class EndpointError(RuntimeError):
    """The endpoint of a role cannot serve it (unreachable URL, unknown model, bad key): found by
    :meth:`LLMClient.probe` before a batch starts."""


class UnrecordedRequestError(LookupError):
    """:class:`RecordedBackend` was asked for a request that was never recorded (fixtures out of date)."""


class BadResponseError(ValueError):
    """The endpoint answered 2xx with a body that is not a usable completion (garbage, truncated JSON,
    no choices, missing fields)."""


class Backend(Protocol):
    recorded: bool

    async def send(self, cfg: RoleConfig, kind: str, payload: dict, key: str) -> dict:
        """POST ``payload`` to ``/chat/completions`` (kind ``chat``) or ``/completions``; the raw JSON body."""

    async def probe(self, cfg: RoleConfig) -> None:
        """Raise :class:`EndpointError` when ``cfg``'s endpoint cannot serve ``cfg.model``."""


def _body(raw) -> dict:
    try:
        text = raw.http_response.text
        data = loads_json(text, what="response body")  # nesting bounded, duplicated keys and huge ints refused
    except (UntrustedInputError, UnicodeDecodeError) as err:
        raise BadResponseError(f"response body is not JSON ({clip(err, 200)}): {clip(text, 200)!r}") from None
    if not isinstance(data, dict):
        raise BadResponseError(f"response body is a JSON {type(data).__name__}, expected an object")
    return data


class OpenAIBackend:
    """Live endpoints through ``openai.AsyncOpenAI`` (one client per base URL and key variable; the SDK's
    own retries are off: :class:`LLMClient` retries with its policy)."""

    recorded = False

    def __init__(self):
        self._clients: dict[tuple[str, str | None], object] = {}

    def _client(self, cfg: RoleConfig):
        k = (cfg.base_url, cfg.api_key_env)
        c = self._clients.get(k)
        if c is None:
            from openai import AsyncOpenAI

            c = self._clients[k] = AsyncOpenAI(base_url=cfg.base_url, api_key=cfg.api_key(), max_retries=0)
        return c

    async def send(self, cfg: RoleConfig, kind: str, payload: dict, key: str) -> dict:
        client = self._client(cfg)
        body = {k: v for k, v in payload.items() if k not in ("model", "messages", "prompt")}
        if kind == "chat":
            raw = await client.chat.completions.with_raw_response.create(
                model=payload["model"], messages=payload["messages"], extra_body=body, timeout=cfg.timeout_s)
        else:
            raw = await client.completions.with_raw_response.create(
                model=payload["model"], prompt=payload["prompt"], extra_body=body, timeout=cfg.timeout_s)
        return _body(raw)

    async def probe(self, cfg: RoleConfig) -> None:
        import openai

        client = self._client(cfg)
        where = f"{cfg.base_url} (model {cfg.model!r})"
        try:
            page = await client.models.list(timeout=min(cfg.timeout_s, 30.0))
            ids = [str(m.id) for m in page.data]
        except openai.APIConnectionError as err:
            raise EndpointError(f"cannot reach {where}: {type(err).__name__}: {clip(err, 300)}") from None
        except openai.AuthenticationError:
            raise EndpointError(f"{where}: the API key in ${cfg.api_key_env} was rejected (401)") from None
        except (openai.APIStatusError, ValueError, TypeError, AttributeError, RecursionError):
            ids = None  # no /models listing here: fall back to a one-token call
        if ids is not None:
            if cfg.model not in ids:
                raise EndpointError(f"model {cfg.model!r} is not served at {cfg.base_url}; "
                                    f"it serves {clip(ids, 500)}")
            return
        try:
            await client.chat.completions.with_raw_response.create(
                model=cfg.model, messages=[{"role": "user", "content": "ping"}], extra_body={"max_tokens": 1},
                timeout=cfg.timeout_s)
        except openai.APIConnectionError as err:
            raise EndpointError(f"cannot reach {where}: {type(err).__name__}: {clip(err, 300)}") from None
        except openai.APIStatusError as err:
            raise EndpointError(f"{where} refused a one-token probe: HTTP {err.status_code}: "
                                f"{clip(err.message, 300)}") from None

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()


class Recorder:
    """Appends every live response as ``{"key", "kind", "request", "response"}`` JSONL (the fixture format
    :class:`RecordedBackend` replays)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def add(self, key: str, kind: str, payload: dict, response: dict) -> None:
        line = json.dumps({"key": key, "kind": kind, "request": payload, "response": response}, sort_keys=True) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


class RecordedBackend:
    """Replays responses recorded by :class:`Recorder` (``LLMClient(..., record_to=path)``), keyed by request
    hash. Every result it produces has ``recorded=True``; an unrecorded request raises
    :class:`UnrecordedRequestError` (it never falls through to a live model)."""

    recorded = True

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no recorded responses at {self.path}")
        self._responses: dict[str, dict] = {}
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    self._responses[row["key"]] = row["response"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{self.path}:{n}: not a recorded response line ({err})") from None

    def __len__(self) -> int:
        return len(self._responses)

    async def send(self, cfg: RoleConfig, kind: str, payload: dict, key: str) -> dict:
        try:
            return self._responses[key]
        except KeyError:
            raise UnrecordedRequestError(
                f"request {key[:16]}... ({kind}, model {payload.get('model')!r}) is not in {self.path}; "
                f"re-record the fixtures against a live endpoint") from None

    async def probe(self, cfg: RoleConfig) -> None:
        return None

    async def aclose(self) -> None:
        return None

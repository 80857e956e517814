"""A scripted fake OpenAI-compatible endpoint for tests: a real HTTP server (``http.server`` in a thread
on 127.0.0.1), so a client's whole HTTP stack runs and nothing is mocked.

Shared by the tests of :mod:`treadle.llm`, RSI and WEFT (one fixture, not one copy per area), and usable
for offline tests of your own pipelines. Answers, in order of precedence:

1. ``script``: a list of :class:`Step` consumed in order (status, body, headers, delay);
2. ``responder``: ``responder(request_json) -> str | int | dict | None`` (a reply text sent as a chat
   completion, an HTTP error status, a raw body, or None for the default);
3. the default :func:`echo_completion` (echoes the last message, the seed and the temperature).

Example::

    ep = FakeEndpoint()
    ep.responder = lambda req: "4" if req["model"] == "solver" else None
    cfg = LLMConfig.single("solver", ep.base_url)
    ...
    ep.close()
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

__all__ = ["FAKE_MODEL", "FakeEndpoint", "Step", "chat_reply", "echo_completion"]

FAKE_MODEL = "fake-model"


@dataclass
class Step:
    """One scripted answer: HTTP ``status``, ``body`` (dict -> JSON, str/bytes sent raw, a callable
    ``body(request_json) -> dict``, None -> the default echo completion), extra ``headers``, ``delay``
    seconds before answering."""

    status: int = 200
    body: object = None
    headers: dict = field(default_factory=dict)
    delay: float = 0.0


def chat_reply(text: str, model: str = "m", prompt_tokens: int = 10) -> dict:
    """A chat completion whose message is ``text`` (usage: ``prompt_tokens`` in, ``len(text)`` out)."""
    return {"id": "c", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(text),
                      "total_tokens": prompt_tokens + len(text)}}


def echo_completion(req: dict, path: str) -> dict:
    """Default answer: echoes the last message (or prompt), the seed and the sample parameters, with usage
    counted as characters, so tests can tell requests apart."""
    if path.endswith("/chat/completions"):
        last = req["messages"][-1].get("content") or ""
        text = f"echo:{last}|seed={req.get('seed')}|T={req.get('temperature')}"
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        n_in = sum(len(str(m.get("content") or "")) for m in req["messages"])
    else:
        text = f"echo:{req['prompt']}|seed={req.get('seed')}"
        choice = {"index": 0, "text": text, "finish_reason": "stop"}
        n_in = len(req["prompt"])
    return {"id": "cmpl-1", "object": "chat.completion", "model": req.get("model"), "choices": [choice],
            "usage": {"prompt_tokens": n_in, "completion_tokens": len(text), "total_tokens": n_in + len(text)}}


class FakeEndpoint:
    """The fake endpoint (see the module docstring).

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1``.
        script: :class:`Step` list consumed in order before anything else.
        responder: ``req -> str | int | dict | None`` used once the script is empty.
        requests: every POST as ``(path, headers with lower-case names, json)``; :attr:`bodies` has the json only.
        models: ids listed by ``GET /models`` (None: no such route, 404).
        max_in_flight: most requests seen at once; ``default_delay``: seconds before each default answer.
    """

    def __init__(self, models=(FAKE_MODEL,), responder: Callable[[dict], object] | None = None):
        self.script: list[Step] = []
        self.responder = responder
        self.requests: list[tuple[str, dict, dict]] = []
        self.models = None if models is None else list(models)
        self.default_delay = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        ep = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls between headers and body

            def log_message(self, *a):  # quiet
                pass

            def _send(self, status, body, headers=None):
                text = body if isinstance(body, (str, bytes)) else json.dumps(body)
                data = text if isinstance(text, bytes) else text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                if self.path.endswith("/models") and ep.models is not None:
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in ep.models]})
                elif self.path.endswith("/health"):
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                req = json.loads(self.rfile.read(n) or b"{}")
                with ep._lock:
                    ep.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, req))
                    step = ep.script.pop(0) if ep.script else None
                    ep.in_flight += 1
                    ep.max_in_flight = max(ep.max_in_flight, ep.in_flight)
                try:
                    status, body, headers = ep._answer(step, req, self.path)
                    self._send(status, body, headers)
                finally:
                    with ep._lock:
                        ep.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def bodies(self) -> list[dict]:
        """The JSON body of every POST, in arrival order."""
        return [r[2] for r in self.requests]

    def _answer(self, step: Step | None, req: dict, path: str) -> tuple[int, object, dict]:
        if step is None and self.responder is not None:
            out = self.responder(req)
            if isinstance(out, bool):
                raise TypeError("responder must return str, int, dict or None, got a bool")
            if isinstance(out, int):
                return out, {"error": {"message": "scripted"}}, {}
            if isinstance(out, str):
                return 200, chat_reply(out, req.get("model", "m")), {}
            if isinstance(out, dict):
                return 200, out, {}
        step = step or Step(delay=self.default_delay)
        if step.delay:
            time.sleep(step.delay)
        body = step.body
        if body is None:
            body = echo_completion(req, path) if step.status == 200 else {"error": {"message": "scripted"}}
        elif callable(body):
            body = body(req)
        return step.status, body, step.headers

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeEndpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

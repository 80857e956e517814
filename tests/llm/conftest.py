"""Fixtures for treadle.llm tests: a scripted fake OpenAI-compatible endpoint (a real HTTP server on
127.0.0.1, http.server in a thread: the client's whole HTTP stack is exercised, nothing is mocked)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

FAKE_MODEL = "fake-model"


@dataclass
class Step:
    """One scripted answer: HTTP ``status``, ``body`` (dict -> JSON, str/bytes sent raw, None -> the default
    echo completion), extra ``headers``, ``delay`` seconds before answering."""

    status: int = 200
    body: object = None
    headers: dict = field(default_factory=dict)
    delay: float = 0.0


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
    """``base_url``; ``script`` (a list of :class:`Step` consumed in order, then the echo answer);
    ``requests`` (every POST as ``(path, headers with lower-case names, json)``); ``models`` (None: no
    ``/models`` route, 404); ``max_in_flight`` seen; ``default_delay``."""

    def __init__(self, models=(FAKE_MODEL,)):
        self.script: list[Step] = []
        self.requests: list[tuple[str, dict, dict]] = []
        self.models = list(models)
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
                    step = ep.script.pop(0) if ep.script else Step(delay=ep.default_delay)
                    ep.in_flight += 1
                    ep.max_in_flight = max(ep.max_in_flight, ep.in_flight)
                try:
                    if step.delay:
                        time.sleep(step.delay)
                    body = step.body
                    if body is None:
                        ok = step.status == 200
                        body = echo_completion(req, self.path) if ok else {"error": {"message": "scripted"}}
                    elif callable(body):
                        body = body(req)
                    self._send(step.status, body, step.headers)
                finally:
                    with ep._lock:
                        ep.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    ep = FakeEndpoint()
    yield ep
    ep.close()


@pytest.fixture
def make_config(fake):
    """``make_config(**role_fields)``: an LLMConfig with role 'default' (and 'judge') on the fake endpoint,
    fast retries."""
    from treadle.llm import LLMConfig

    def make(roles=("default",), **fields):
        fields.setdefault("backoff_s", 0.01)
        fields.setdefault("timeout_s", 5.0)
        return LLMConfig.single(FAKE_MODEL, fake.base_url, roles=roles, **fields)

    return make


def save_tiny_checkpoint(path):
    from treadle.llm.tiny_checkpoint import save_untrained_checkpoint

    return save_untrained_checkpoint(path)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """One real `transformers serve` over a tiny untrained checkpoint for the whole session:
    ``(LocalServer, tokenizer)``."""
    from treadle.llm import local_server

    path, tok = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llm"))
    with local_server(path, startup_timeout_s=300) as srv:
        yield srv, tok

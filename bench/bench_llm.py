"""treadle.llm client vs the bare ``openai`` SDK (peers side by side in one run).

    treadle bench --ops llm          (or: pytest bench/bench_llm.py --benchmark-enable)

Cases:
- ``chat call, instant endpoint``: one chat completion against a local endpoint that answers at once
  (a ``http.server`` echo endpoint in its own process on 127.0.0.1), so the difference is the client's
  own cost: bare ``AsyncOpenAI.chat.completions.create`` vs ``LLMClient.chat`` (cache key, cache write,
  ledger line, parsing). Target: overhead < 1 ms per call.
- ``cache hit``: ``LLMClient.chat`` answered from the SQLite cache (ledger line included). Target < 0.2 ms.
- ``N requests, transformers serve [--continuous-batching]``: ``LLM_BENCH_N`` (default 64) chat requests
  (max_tokens 2) to a real ``transformers serve`` over a tiny untrained Qwen3, sequential vs concurrent
  (``gather``, max_concurrency = N); without continuous batching the server decodes one request at a time,
  so concurrency cannot help there.

Last measured (2026-11-30, this 2-core shared "Intel(R) Xeon(R) Processor" machine, load average ~19 from
other jobs; medians): per-call overhead over the bare SDK 0.65 ms (20.05 ms vs 21.05 ms per call; the
instant endpoint's round trip dominates on this loaded machine; target < 1 ms); cache hit 0.10 ms (target
< 0.2 ms); 64 requests to transformers serve 43.1 s sequential vs 33.0 s concurrent (1.3x), and with
--continuous-batching 39.1 s vs 5.97 s (6.6x).
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from treadle.llm import LLMClient, LLMConfig, local_server
from treadle.llm.server import free_port

N = int(os.environ.get("LLM_BENCH_N", "64"))
MSG = [{"role": "user", "content": "hi"}]

ECHO = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
BODY = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "echo",
                   "choices": [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "ok"}}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def log_message(self, *a): pass
    def _send(self, data):
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self): self._send(json.dumps({"data": [{"id": "echo"}]}).encode())
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0)); self._send(BODY)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture(scope="module")
def echo_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", ECHO, str(port)])
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/models", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_chat_call_overhead(benchmark, peer_table, echo_url, loop, tmp_path):
    """Bare SDK and treadle calls interleaved pair by pair (the machine's load drifts; pairs see the same
    load), medians of each and the median of the per-pair differences."""
    import statistics

    from openai import AsyncOpenAI

    bare = AsyncOpenAI(base_url=echo_url, api_key="EMPTY", max_retries=0)
    cfg = LLMConfig.single("echo", echo_url, sampling={"max_tokens": 4})
    llm = LLMClient(cfg, cache=tmp_path / "c.sqlite", cache_mode="refresh", ledger=tmp_path / "l.jsonl")

    def bare_call():
        return loop.run_until_complete(bare.chat.completions.create(model="echo", messages=MSG, max_tokens=4))

    def treadle_call():
        return loop.run_until_complete(llm.chat(MSG, tag="bench"))

    for _ in range(20):
        bare_call(), treadle_call()
    t_bare, t_ours = [], []
    for i in range(int(os.environ.get("LLM_BENCH_PAIRS", "400"))):
        order = (bare_call, treadle_call) if i % 2 else (treadle_call, bare_call)
        for fn in order:
            t0 = time.perf_counter()
            fn()
            (t_bare if fn is bare_call else t_ours).append(time.perf_counter() - t0)
    benchmark.pedantic(treadle_call, rounds=5)
    diff = statistics.median(o - b for o, b in zip(t_ours, t_bare))
    peer_table.record("chat call, instant endpoint", "openai_sdk", seconds=statistics.median(t_bare))
    peer_table.record("chat call, instant endpoint", "treadle_llm", seconds=statistics.median(t_ours),
                      overhead_ms=round(diff * 1e3, 3))
    loop.run_until_complete(bare.close())
    loop.run_until_complete(llm.aclose())


def test_cache_hit(benchmark, peer_table, echo_url, loop, tmp_path):
    cfg = LLMConfig.single("echo", echo_url, sampling={"max_tokens": 4})
    llm = LLMClient(cfg, cache=tmp_path / "c.sqlite", ledger=tmp_path / "l.jsonl")
    loop.run_until_complete(llm.chat(MSG))

    def call():
        r = loop.run_until_complete(llm.chat(MSG, tag="bench"))
        assert r.cached
        return r

    benchmark.pedantic(call, rounds=2000, warmup_rounds=50)
    peer_table.record("cache hit", "treadle_llm", benchmark)
    loop.run_until_complete(llm.aclose())


@pytest.fixture(scope="module")
def tiny_checkpoint():
    from treadle.llm.tiny_checkpoint import save_untrained_checkpoint

    with tempfile.TemporaryDirectory() as d:
        yield save_untrained_checkpoint(Path(d) / "tiny")[0]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "continuous_batching"])
def tiny_server(request, tiny_checkpoint):
    with local_server(tiny_checkpoint, startup_timeout_s=300, continuous_batching=request.param) as srv:
        cfg = LLMConfig.single(srv.model, srv.base_url, timeout_s=600, sampling={"max_tokens": 2})

        async def warm():
            async with LLMClient(cfg) as llm:
                await llm.chat([{"role": "user", "content": "warm up"}])

        asyncio.run(warm())  # the continuous-batching server's first request compiles/allocates for seconds
        yield request.param, srv


@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
def test_n_requests_transformers_serve(benchmark, peer_table, tiny_server, mode):
    cb, srv = tiny_server
    cfg = LLMConfig.single(srv.model, srv.base_url, max_concurrency=N, timeout_s=600,
                           sampling={"max_tokens": 2, "temperature": 0.0})

    async def batch():
        async with LLMClient(cfg) as llm:
            msgs = [[{"role": "user", "content": f"{i}+{i}="}] for i in range(N)]
            if mode == "sequential":
                return [await llm.chat(m) for m in msgs]
            return await llm.gather([llm.chat(m) for m in msgs])

    out = benchmark.pedantic(lambda: asyncio.run(batch()), rounds=1, warmup_rounds=0)
    assert len(out) == N and all(r.finish_reason in ("length", "stop") for r in out)
    impl = "treadle_llm" if mode == "concurrent" else "sequential"
    server = "transformers serve --continuous-batching" if cb else "transformers serve"
    peer_table.record(f"{N} requests, {server}", impl, benchmark)

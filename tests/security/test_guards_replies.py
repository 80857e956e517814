"""Model and endpoint output that used to raise raw exceptions or slip past a guard: each is now a typed
failure (a :class:`Failure`, a :class:`ParseFailure`, a :class:`CallParseError`) and never a stall."""
import asyncio
import json
import socket
import threading
import time

import pytest
from pydantic import BaseModel

from treadle.llm import LLMCallError, LLMClient, LLMConfig
from treadle.llm.config import UsageLimits
from treadle.llm.fake_endpoint import FAKE_MODEL, FakeEndpoint, Step, chat_reply
from treadle.llm.records import Failure, FailureKind
from treadle.llm.records import ToolCall as NativeCall
from treadle.weft.runtime.callparse import parse_call, parse_calls
from treadle.weft.runtime.errors import CallParseError
from treadle.weft.rollouts import harnesses  # noqa: F401  (registers the harnesses)
from treadle.weft.rollouts.records import PolicyOutput
from treadle.weft.rollouts.registry import HARNESSES

MSG = [{"role": "user", "content": "hi"}]
DEEP = "[" * 100_000
BIG_INT = "1" * 5000


@pytest.fixture
def fake():
    ep = FakeEndpoint()
    yield ep
    ep.close()


def _cfg(base_url, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    kw.setdefault("timeout_s", 5.0)
    return LLMConfig.single(FAKE_MODEL, base_url, **kw)


def _one(cfg, **client_kw):
    async def go():
        async with LLMClient(cfg, **client_kw) as llm:
            out = (await llm.gather([llm.chat(MSG)]))[0]
            return out, dict(llm.usage)
    return asyncio.run(go())


def _body_with(usage=None, tool_args=None) -> dict:
    body = chat_reply("ok", FAKE_MODEL)
    if usage is not None:
        body["usage"] = usage
    if tool_args is not None:
        body["choices"][0]["message"]["tool_calls"] = [
            {"id": "c0", "type": "function", "function": {"name": "f", "arguments": tool_args}}]
    return body


@pytest.mark.parametrize("raw", [
    DEEP,                                                              # RecursionError in json.loads
    '{"choices": [{"message": {"content": "x"}}], "n": ' + BIG_INT + "}",  # int-str digit limit ValueError
    '{"choices": [], "choices": [{"message": {"content": "x"}}]}',          # duplicated key
    '{"choices": [{"message": {"content": "x"}}], "usage": ' + "[" * 150 + "]" * 150 + "}",
])
def test_hostile_bodies_are_bad_response_failures(fake, raw):
    fake.script = [Step(200, raw)]
    out, _ = _one(_cfg(fake.base_url, max_retries=0))
    assert isinstance(out, Failure) and out.kind == FailureKind.bad_response, out


@pytest.mark.parametrize("usage", [{"prompt_tokens": -10 ** 6, "completion_tokens": 1},
                                   {"prompt_tokens": 1.5, "completion_tokens": 1},
                                   {"prompt_tokens": "12", "completion_tokens": 1},
                                   {"prompt_tokens": True, "completion_tokens": 1},
                                   {"prompt_tokens": 10 ** 30, "completion_tokens": 1}])
def test_bad_token_counts_cannot_defeat_the_usage_limits(fake, usage):
    fake.script = [Step(200, _body_with(usage=usage))]
    out, spent = _one(_cfg(fake.base_url, max_retries=0), limits=UsageLimits(max_tokens=100))
    assert isinstance(out, Failure) and out.kind == FailureKind.bad_response
    assert spent["tokens"] >= 0


@pytest.mark.parametrize("value", ["garbage", "nan", "inf", "-5", "1e999", "Fri, 99 Foo 2026 99:99:99 GMT",
                                   "Mon, 01 Jan 2024 00:00:00", "9" * 5000, "\x00"])
def test_a_garbage_retry_after_is_ignored_not_raised(fake, value):
    fake.script = [Step(429, headers={"Retry-After": value})]
    out, _ = _one(_cfg(fake.base_url, max_retries=1))
    assert not isinstance(out, Failure) and out.text.startswith("echo:")


class _Answer(BaseModel):
    x: int


@pytest.mark.parametrize("text", [DEEP, "{" * 50_000, '{"x": ' + BIG_INT + "}", '{"x": 1, "x": 2}',
                                  "```json\n" + " " * 20_000, "```" * 5000, "\x00\ud800",
                                  '[1,' * 20_000])
def test_structured_on_garbage_is_invalid_output(fake, text):
    fake.responder = lambda req: text

    async def go():
        async with LLMClient(_cfg(fake.base_url, max_repairs=0)) as llm:
            return await llm.structured(MSG, _Answer)

    out = asyncio.run(go())
    assert isinstance(out, Failure) and out.kind == FailureKind.invalid_output


class _Trickle:
    """An HTTP server that sends a valid reply one byte every ``gap`` seconds (each byte resets an HTTP
    client's read timeout, so only a whole-attempt deadline ends the call)."""

    def __init__(self, gap: float = 0.05):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.gap, self.stop = gap, threading.Event()
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, rest = data.split(b"\r\n\r\n", 1)
            n = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length")), 0)
            while len(rest) < n:
                rest += conn.recv(65536)
            body = json.dumps(chat_reply("slow " * 40, FAKE_MODEL)).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n")
            for i in range(len(body)):
                if self.stop.is_set():
                    break
                conn.sendall(body[i:i + 1])
                time.sleep(self.gap)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


def test_timeout_is_a_deadline_per_attempt_not_per_byte():
    srv = _Trickle()  # the whole reply would take ~15 s
    try:
        out, _ = _one(_cfg(srv.base_url, timeout_s=0.5, max_retries=1))
    finally:
        srv.close()
    assert isinstance(out, Failure) and out.kind == FailureKind.timeout and out.attempts == 2


@pytest.mark.parametrize("name", ["hermes", "react", "native"])
def test_tool_calls_nested_deep_or_with_huge_ints_are_parse_failures(name):
    h = HARNESSES.build(name)
    for args in (DEEP, '{"a": ' + BIG_INT + "}", '{"a": ' + "[" * 5000 + "]" * 5000 + "}"):
        if name == "hermes":
            out = PolicyOutput(text='<tool_call>{"name": "f", "arguments": ' + args + "}</tool_call>")
        elif name == "react":
            out = PolicyOutput(text="Thought: t\nAction: f\nAction Input: " + args)
        else:
            out = PolicyOutput(tool_calls=(NativeCall(id="c0", name="f", arguments=args),))
        p = h.parse(out)
        assert p.calls == () and len(p.failures) == 1, (name, p)


@pytest.mark.parametrize("name", ["hermes", "react", "native"])
def test_duplicated_argument_keys_are_rejected(name):
    h = HARNESSES.build(name)
    args = '{"amount": 1, "amount": 1000}'
    out = {"hermes": PolicyOutput(text='<tool_call>{"name": "pay", "arguments": ' + args + "}</tool_call>"),
           "react": PolicyOutput(text="Action: pay\nAction Input: " + args),
           "native": PolicyOutput(tool_calls=(NativeCall(id="c0", name="pay", arguments=args),))}[name]
    p = h.parse(out)
    assert p.calls == () and "duplicated key" in p.failures[0].message
    # a duplicated top-level "name" is no call either
    if name == "hermes":
        p = h.parse(PolicyOutput(text='<tool_call>{"name": "a", "name": "b", "arguments": {}}</tool_call>'))
        assert p.calls == ()


def test_call_strings_with_duplicated_keys_or_hostile_literals_are_call_parse_errors():
    for text in ('pay(x={"amount": 1, "amount": 1000})', "pay(amount=1, amount=2)", "f(a=" + BIG_INT + ")",
                 "f(a=" + "[" * 5000 + "]" * 5000 + ")", "f(a='\x00')", "[" + "f()," * 30_000 + "]"):
        with pytest.raises(CallParseError):
            parse_calls(text)
    assert parse_call('f(a=[{"k": 1}, {"k": 2}])').arguments == {"a": [{"k": 1}, {"k": 2}]}


def test_hostile_tool_results_read_by_the_runtime_are_text_not_a_raise():
    from treadle.weft.runtime.sessions import result_payload

    class Res:
        structured_content = None

        def __init__(self, text):
            self.content = [type("C", (), {"text": text})()]

    for text in (DEEP, '{"n": ' + BIG_INT + "}"):
        value, raw = result_payload(Res(text))
        assert value == text == raw


def test_llm_call_error_for_single_calls_is_typed(fake):
    fake.script = [Step(200, DEEP)]

    async def go():
        async with LLMClient(_cfg(fake.base_url, max_retries=0)) as llm:
            return await llm.chat(MSG)

    with pytest.raises(LLMCallError) as ei:
        asyncio.run(go())
    assert ei.value.failure.kind == FailureKind.bad_response

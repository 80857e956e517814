"""LLMClient against a real local HTTP endpoint scripted to misbehave: retries, typed failures, probes,
keys kept secret. (The fake endpoint is a real server on 127.0.0.1; nothing in the client is mocked.)"""
import asyncio
import json
import logging
import time

import pytest

from treadle.llm import EndpointError, FailureKind, LLMCallError, LLMClient, LLMConfig

from .conftest import Step

MSG = [{"role": "user", "content": "hi"}]


def run(coro):
    return asyncio.run(coro)


async def _chat(cfg, **kw):
    async with LLMClient(cfg, **kw) as llm:
        return await llm.chat(MSG)


def test_500_then_success_is_retried(fake, make_config):
    fake.script = [Step(500), Step(503)]
    r = run(_chat(make_config(max_retries=3)))
    assert r.text.startswith("echo:hi")
    assert len(fake.requests) == 3


def test_5xx_exhausts_retries_into_typed_failure(fake, make_config, tmp_path):
    fake.script = [Step(500)] * 3
    cfg = make_config(max_retries=2)
    with pytest.raises(LLMCallError) as ei:
        run(_chat(cfg, ledger=tmp_path / "l.jsonl"))
    f = ei.value.failure
    assert (f.kind, f.status_code, f.attempts, f.blame) == (FailureKind.server_error, 500, 3, "provider")
    assert len(fake.requests) == 3
    rec = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["ok"] is False and rec[0]["failure"] == "server_error" and rec[0]["attempts"] == 3


def test_4xx_is_never_retried(fake, make_config):
    fake.script = [Step(400, {"error": {"message": "prompt too long"}}), Step(200)]
    with pytest.raises(LLMCallError) as ei:
        run(_chat(make_config(max_retries=5)))
    assert ei.value.failure.kind == FailureKind.bad_request and ei.value.failure.status_code == 400
    assert ei.value.failure.blame == "user"
    assert "prompt too long" in ei.value.failure.message
    assert len(fake.requests) == 1


def test_401_is_auth_failure_not_retried(fake, make_config):
    fake.script = [Step(401, {"error": {"message": "bad key"}})]
    with pytest.raises(LLMCallError) as ei:
        run(_chat(make_config(max_retries=5)))
    assert ei.value.failure.kind == FailureKind.auth and len(fake.requests) == 1


def test_429_honours_retry_after(fake, make_config):
    fake.script = [Step(429, headers={"Retry-After": "1"})]
    t0 = time.perf_counter()
    r = run(_chat(make_config(max_retries=1, backoff_s=0.0)))
    assert time.perf_counter() - t0 >= 0.95  # backoff_s=0: only Retry-After can make it wait
    assert r.finish_reason == "stop" and len(fake.requests) == 2


@pytest.mark.parametrize("body,what", [
    ("<html>502 Bad Gateway</html>", "not JSON"),
    ('{"id": "x", "choices": [{"index": 0, "message": {"role": "assi', "not JSON"),
    ({"id": "x", "choices": [], "usage": {}}, "no choices"),
    ({"id": "x"}, "no choices"),
    ({"id": "x", "choices": [{"index": 0, "finish_reason": "stop"}]}, "malformed"),
    ([1, 2], "JSON list"),
])
def test_bad_bodies_are_typed_failures(fake, make_config, body, what):
    fake.script = [Step(200, body)]
    with pytest.raises(LLMCallError) as ei:
        run(_chat(make_config(max_retries=3)))
    f = ei.value.failure
    assert f.kind == FailureKind.bad_response and what in f.message
    assert len(fake.requests) == 1  # a bad body is not retried


def test_hang_past_timeout(fake, make_config):
    fake.script = [Step(delay=3.0)]
    t0 = time.perf_counter()
    with pytest.raises(LLMCallError) as ei:
        run(_chat(make_config(timeout_s=0.3, max_retries=0)))
    assert ei.value.failure.kind == FailureKind.timeout
    assert time.perf_counter() - t0 < 2.5


def test_hang_then_success_with_retry(fake, make_config):
    fake.script = [Step(delay=3.0)]
    r = run(_chat(make_config(timeout_s=0.3, max_retries=1)))
    assert r.text.startswith("echo:hi") and len(fake.requests) == 2


def test_unreachable_url_probe_and_call():
    from treadle.llm.server import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    cfg = LLMConfig.single("m", url, max_retries=1, backoff_s=0.01, timeout_s=2)

    async def go():
        async with LLMClient(cfg) as llm:
            with pytest.raises(EndpointError, match="cannot reach"):
                await llm.probe()
            with pytest.raises(LLMCallError) as ei:
                await llm.chat(MSG)
            return ei.value.failure

    f = run(go())
    assert f.kind == FailureKind.connection and f.attempts == 2


def test_wrong_model_name_probe_names_what_is_served(fake, make_config):
    cfg = LLMConfig.single("no-such-model", fake.base_url)

    async def go():
        async with LLMClient(cfg) as llm:
            calls = [llm.chat(MSG, sample_index=i) for i in range(4)]
            with pytest.raises(EndpointError, match=r"'no-such-model' is not served .*fake-model"):
                await llm.gather(calls, probe=["default"])

    run(go())
    assert fake.requests == []  # the batch never started


def test_probe_falls_back_to_one_token_call(fake, make_config):
    fake.models = None  # this server has no /models listing

    async def go(cfg):
        async with LLMClient(cfg) as llm:
            await llm.probe()

    run(go(make_config()))
    assert len(fake.requests) == 1 and fake.requests[0][2]["max_tokens"] == 1
    fake.script = [Step(404, {"error": {"message": "The model `x` does not exist."}})]
    with pytest.raises(EndpointError, match="refused a one-token probe: HTTP 404.*does not exist"):
        run(go(make_config()))


def test_gather_keeps_siblings_alive(fake, make_config):
    fake.script = [Step(400)]

    async def go():
        async with LLMClient(make_config(max_concurrency=1)) as llm:
            return await llm.gather([llm.chat([{"role": "user", "content": str(i)}]) for i in range(5)])

    out = run(go())
    kinds = [getattr(o, "kind", None) for o in out]
    assert kinds.count(FailureKind.bad_request) == 1
    assert sum(o.__class__.__name__ == "ChatResult" for o in out) == 4


def test_concurrency_limit_per_endpoint(fake, make_config):
    fake.default_delay = 0.15

    async def go():
        async with LLMClient(make_config(roles=("a", "b"), max_concurrency=3)) as llm:
            return await llm.gather([llm.chat([{"role": "user", "content": str(i)}], role="ab"[i % 2])
                                     for i in range(12)])

    out = run(go())
    assert all(o.finish_reason == "stop" for o in out)
    assert fake.max_in_flight == 3


def test_api_key_sent_but_never_logged_or_stored(fake, make_config, tmp_path, monkeypatch, caplog):
    secret = "sk-test-SECRET-0123456789"
    monkeypatch.setenv("TREADLE_TEST_KEY", secret)
    cfg = make_config(api_key_env="TREADLE_TEST_KEY", max_retries=1)
    fake.script = [Step(500), Step(200), Step(401, {"error": {"message": f"Incorrect API key provided: {secret}"}})]
    caplog.set_level(logging.DEBUG)

    async def go():
        async with LLMClient(cfg, cache=tmp_path / "c.sqlite", ledger=tmp_path / "l.jsonl",
                             record_to=tmp_path / "r.jsonl") as llm:
            ok = await llm.chat(MSG)
            with pytest.raises(LLMCallError) as ei:
                await llm.chat([{"role": "user", "content": "other"}])
            return ok, ei.value

    ok, err = run(go())
    assert fake.requests[0][1].get("authorization") == f"Bearer {secret}"
    assert err.failure.kind == FailureKind.auth and "Incorrect API key provided: ***" in err.failure.message
    for text in (caplog.text, str(err), repr(err.failure), ok.model_dump_json(), repr(cfg),
                 (tmp_path / "l.jsonl").read_text(), (tmp_path / "r.jsonl").read_text(),
                 (tmp_path / "c.sqlite").read_bytes().decode("latin-1")):
        assert secret not in text


def test_missing_key_variable_is_a_config_error(make_config, monkeypatch):
    from treadle.llm import ConfigError

    monkeypatch.delenv("TREADLE_TEST_UNSET_KEY", raising=False)
    cfg = make_config(api_key_env="TREADLE_TEST_UNSET_KEY")
    with pytest.raises(ConfigError, match="TREADLE_TEST_UNSET_KEY"):
        run(_chat(cfg))


def test_bad_input_raises_before_any_request(fake, make_config):
    async def go(messages, **kw):
        async with LLMClient(make_config()) as llm:
            await llm.chat(messages, **kw)

    for bad, kw in [([], {}), ("hi", {}), ([{"content": "x"}], {}), (MSG, {"role": "nobody"}),
                    (MSG, {"sample_index": -1})]:
        with pytest.raises(ValueError):
            run(go(bad, **kw))
    assert fake.requests == []


def test_usage_limits_stop_calls_before_sending(fake, make_config, tmp_path):
    from treadle.llm import Failure, Prices, UsageLimits

    cfg = make_config(prices=Prices(input_per_million=1e6, output_per_million=0.0))  # 1 USD per prompt token

    async def go(limits, n=5):
        async with LLMClient(cfg, limits=limits, cache=tmp_path / "c.sqlite", ledger=tmp_path / "l.jsonl") as llm:
            out = await llm.gather([llm.chat([{"role": "user", "content": f"q{i}"}]) for i in range(n)])
            return out, dict(llm.usage)

    llm_calls = len(fake.requests)
    out, usage = run(go(UsageLimits(max_calls=2)))
    sent = len(fake.requests) - llm_calls
    exhausted = [o for o in out if isinstance(o, Failure)]
    assert sent == 2 and usage["calls"] == 2 and len(exhausted) == 3
    assert all(f.kind == FailureKind.budget_exhausted and f.blame == "user" and f.attempts == 0 for f in exhausted)
    assert "max_calls=2" in exhausted[0].message
    # cache hits are free: the two answered requests come back even with a zero budget
    out, usage = run(go(UsageLimits(max_calls=0)))
    assert sum(getattr(o, "cached", False) for o in out) == 2 and usage["calls"] == 0
    assert len(fake.requests) - llm_calls == 2
    # cost budget: a prompt of 2 characters costs 2 USD here; sequential calls stop once 3 USD are spent
    async def seq(limits):
        async with LLMClient(cfg, limits=limits) as llm:
            return [await llm.gather([llm.chat([{"role": "user", "content": f"z{i}"}])]) for i in range(4)], llm.usage

    out, usage = run(seq(UsageLimits(max_cost_usd=3.0)))
    kinds = [o[0].kind if isinstance(o[0], Failure) else None for o in out]
    assert kinds == [None, None, FailureKind.budget_exhausted, FailureKind.budget_exhausted]
    assert usage["cost_usd"] == 4.0 and usage["calls"] == 2
    with pytest.raises(TypeError, match="UsageLimits"):
        LLMClient(cfg, limits={"max_calls": 1})


def test_client_closes_only_what_it_opened(make_config, tmp_path):
    from treadle.llm import Ledger

    own = Ledger(tmp_path / "mine.jsonl")

    async def go():
        async with LLMClient(make_config(), ledger=own) as llm:
            await llm.chat(MSG)
        async with LLMClient(make_config(), ledger=tmp_path / "opened.jsonl") as llm2:
            await llm2.chat(MSG)
        return llm2

    llm2 = run(go())
    own.record(role="x", tag="", model="m", kind="chat", key=None, tokens_in=0, tokens_out=0, latency_s=0.0,
               cache_hit=False, cost_usd=0.0, ok=True)  # still usable: the client did not close it
    assert len(own.records()) == 2
    assert llm2.ledger._f is None and len(llm2.ledger.records()) == 1

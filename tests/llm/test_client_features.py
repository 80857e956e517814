"""LLMClient features against a real local HTTP endpoint: tools, finish_reason, token ids / logprobs,
samples and the cache, structured output with repairs, recorded replay, ledger accounting."""
import asyncio
import json

import pytest
from pydantic import BaseModel

from treadle.llm import (Cache, ChatResult, Failure, FailureKind, LLMClient, Prices, RecordedBackend,
                         UnrecordedRequestError, read_ledger, totals)

from .conftest import FAKE_MODEL, Step

MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a+b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                          "b": {"type": "integer"}}}}}]


def run(coro):
    return asyncio.run(coro)


def test_tool_calls_and_finish_reason(fake, make_config):
    body = {"model": FAKE_MODEL, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "call_8", "type": "function", "function": {"name": "add", "arguments": '{"a": 3'}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9}}
    fake.script = [Step(200, body)]

    async def go():
        async with LLMClient(make_config()) as llm:
            return await llm.chat(MSG, tools=TOOLS, tool_choice="auto")

    r = run(go())
    assert r.finish_reason == "tool_calls" and r.text == ""
    assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [("call_7", "add", '{"a": 1, "b": 2}'),
                                                                   ("call_8", "add", '{"a": 3')]
    sent = fake.requests[0][2]
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "auto"


def test_length_finish_reason_is_kept(fake, make_config):
    fake.script = [Step(200, {"choices": [{"index": 0, "finish_reason": "length",
                                           "message": {"role": "assistant", "content": "cut of"}}]})]

    async def go():
        async with LLMClient(make_config(sampling={"max_tokens": 2})) as llm:
            return await llm.chat(MSG)

    r = run(go())
    assert (r.finish_reason, r.text, r.usage.prompt_tokens) == ("length", "cut of", 0)
    assert fake.requests[0][2]["max_tokens"] == 2


def test_token_ids_and_logprobs_kept_vllm_format(fake, make_config):
    body = {"model": FAKE_MODEL, "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [7, 8],
                         "message": {"role": "assistant", "content": "ab"},
                         "logprobs": {"content": [
                             {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5},
                                                                            {"token": "b", "logprob": -1.5}]},
                             {"token": "b", "logprob": -0.25, "top_logprobs": []}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    fake.script = [Step(200, body)]

    async def go():
        cfg = make_config(sampling={"logprobs": 2, "extra_body": {"return_token_ids": True}})
        async with LLMClient(cfg) as llm:
            return await llm.chat(MSG)

    r = run(go())
    assert r.prompt_token_ids == (1, 2, 3) and r.token_ids == (7, 8)
    assert [(t.token, t.logprob, t.top) for t in r.logprobs] == [("a", -0.5, {"a": -0.5, "b": -1.5}),
                                                                 ("b", -0.25, None)]
    sent = fake.requests[0][2]
    assert sent["logprobs"] is True and sent["top_logprobs"] == 2 and sent["return_token_ids"] is True


def test_text_completion_with_logprobs(fake, make_config):
    body = {"choices": [{"index": 0, "text": "42", "finish_reason": "stop", "token_ids": [4, 2],
                         "logprobs": {"tokens": ["4", "2"], "token_logprobs": [-0.1, -0.2],
                                      "top_logprobs": [{"4": -0.1}, {"2": -0.2}]}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    fake.script = [Step(200, body)]

    async def go():
        async with LLMClient(make_config(sampling={"logprobs": 1})) as llm:
            return await llm.complete("6*7=")

    r = run(go())
    assert (r.kind, r.text, r.token_ids, r.usage.completion_tokens) == ("completion", "42", (4, 2), 2)
    assert [t.logprob for t in r.logprobs] == [-0.1, -0.2]
    assert fake.requests[0][0].endswith("/v1/completions") and fake.requests[0][2]["prompt"] == "6*7="


def test_samples_are_distinct_cache_entries_with_distinct_seeds(fake, make_config, tmp_path):
    cfg = make_config(sampling={"temperature": 1.0, "seed": 100})

    async def go(mode="use"):
        async with LLMClient(cfg, cache=tmp_path / "c.sqlite", cache_mode=mode) as llm:
            return await llm.sample(MSG, 4)

    first = run(go())
    assert [json.loads(json.dumps(r.sample_index)) for r in first] == [0, 1, 2, 3]
    assert sorted(req[2]["seed"] for req in fake.requests) == [100, 101, 102, 103]
    assert len({r.text for r in first}) == 4 and len({r.key for r in first}) == 4
    cache = Cache(tmp_path / "c.sqlite")
    assert len(cache) == 4
    again = run(go())
    assert len(fake.requests) == 4 and all(r.cached for r in again)
    assert [r.text for r in again] == [r.text for r in first]
    # refresh: calls again and overwrites; off: calls, writes nothing
    run(go("refresh"))
    assert len(fake.requests) == 8 and len(cache) == 4
    run(go("off"))
    assert len(fake.requests) == 12 and len(cache) == 4


def test_cache_key_ignores_timeouts_and_retries(fake, make_config, tmp_path):
    async def go(cfg):
        async with LLMClient(cfg, cache=tmp_path / "c.sqlite") as llm:
            return await llm.chat(MSG)

    a = run(go(make_config(timeout_s=5, max_retries=1)))
    b = run(go(make_config(timeout_s=9, max_retries=4, max_concurrency=2)))
    assert b.cached and a.key == b.key and len(fake.requests) == 1
    c = run(go(make_config(sampling={"temperature": 0.5})))
    assert not c.cached and c.key != a.key and len(fake.requests) == 2


class Answer(BaseModel):
    value: int
    reason: str


def test_structured_tolerant_extraction(fake, make_config):
    fake.script = [Step(200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": 'Sure! Here it is:\n```json\n{"value": 4, "reason": "2+2"}\n```\nDone.'}}]})]

    async def go():
        async with LLMClient(make_config()) as llm:
            return await llm.structured(MSG, Answer)

    out = run(go())
    assert out.value == Answer(value=4, reason="2+2") and out.attempts == 1
    sent = fake.requests[0][2]
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"] == Answer.model_json_schema()


def _reply(text):
    msg = {"role": "assistant", "content": text}
    return Step(200, {"choices": [{"index": 0, "finish_reason": "stop", "message": msg}]})


def test_structured_repair_reask(fake, make_config):
    fake.script = [_reply('{"value": "four", "reason": "x"}'), _reply('noise {"value": 4, "reason": "fixed"} noise')]

    async def go():
        async with LLMClient(make_config(structured_mode="prompt")) as llm:
            return await llm.structured(MSG, Answer)

    out = run(go())
    assert out.value.value == 4 and out.attempts == 2
    second = fake.requests[1][2]["messages"]
    assert second[-2] == {"role": "assistant", "content": '{"value": "four", "reason": "x"}'}
    assert "value" in second[-1]["content"] and "did not validate" in second[-1]["content"]
    assert "response_format" not in fake.requests[0][2]


def test_structured_never_valid_is_a_failure_record(fake, make_config):
    fake.script = [_reply("no json"), _reply('{"value": 1}'), _reply("[1, 2]")]

    async def go():
        async with LLMClient(make_config(structured_mode="json_object")) as llm:
            return await llm.structured(MSG, Answer, max_repairs=2)

    out = run(go())
    assert isinstance(out, Failure) and out.kind == FailureKind.invalid_output and out.blame == "model"
    assert out.attempts == 3 and out.last_output == "[1, 2]" and len(fake.requests) == 3
    assert fake.requests[0][2]["response_format"] == {"type": "json_object"}


def test_structured_provider_failure_is_returned_not_raised(fake, make_config):
    fake.script = [Step(400)]

    async def go():
        async with LLMClient(make_config()) as llm:
            return await llm.structured(MSG, Answer)

    out = run(go())
    assert isinstance(out, Failure) and out.kind == FailureKind.bad_request


def test_recorded_backend_replays_and_labels(fake, make_config, tmp_path):
    cfg = make_config(sampling={"temperature": 1.0, "seed": 0})
    rec = tmp_path / "fixtures.jsonl"

    async def live():
        async with LLMClient(cfg, record_to=rec) as llm:
            return await llm.sample(MSG, 3), await llm.complete("p")

    live_samples, live_c = run(live())
    n_live = len(fake.requests)
    fake.close()  # replay must not need the server

    async def replay(messages):
        async with LLMClient(cfg, backend=RecordedBackend(rec), ledger=tmp_path / "l.jsonl") as llm:
            return await llm.sample(messages, 3), await llm.complete("p")

    samples, c = run(replay(MSG))
    assert [s.text for s in samples] == [s.text for s in live_samples] and c.text == live_c.text
    assert all(s.recorded and not s.cached for s in samples) and c.recorded
    assert n_live == 4
    led = read_ledger(tmp_path / "l.jsonl")
    assert all(r.recorded and r.cost_usd == 0 and r.tokens_in == 0 for r in led)
    with pytest.raises(UnrecordedRequestError, match="not in"):
        run(replay([{"role": "user", "content": "never recorded"}]))


def test_ledger_accounting_per_role_and_tag(fake, make_config, tmp_path):
    cfg = make_config(roles=("policy", "judge"), prices=Prices(input_per_million=3.0, output_per_million=15.0))
    fake.script = [Step(200), Step(400)]

    async def go():
        async with LLMClient(cfg, cache=tmp_path / "c.sqlite", ledger=tmp_path / "l.jsonl") as llm:
            calls = [llm.chat([{"role": "user", "content": f"q{i}"}], role=("policy", "judge")[i % 2],
                              tag=("rollout", "score", "repair")[i % 3]) for i in range(9)]
            first = await llm.gather(calls)
            i = next(i for i, r in enumerate(first) if isinstance(r, ChatResult))  # the 400 hit whichever came second
            again = await llm.chat([{"role": "user", "content": f"q{i}"}], role=("policy", "judge")[i % 2], tag="again")
            return first, again

    first, again = run(go())
    recs = read_ledger(tmp_path / "l.jsonl")
    assert len(recs) == 10 and sum(not r.ok for r in recs) == 1 and sum(r.cache_hit for r in recs) == 1
    assert again.cached
    ok = [r for r in first if isinstance(r, ChatResult)]
    assert sum(r.usage.prompt_tokens for r in ok) == sum(r.tokens_in for r in recs)
    for r, res in zip(recs, first):
        if r.ok and not r.cache_hit:
            assert r.cost_usd == pytest.approx((3.0 * r.tokens_in + 15.0 * r.tokens_out) / 1e6)
    t = totals(recs)
    for group in ("role", "tag", "role_tag"):
        parts = t[group].values()
        assert sum(p.calls for p in parts) == t["all"].calls == 10
        assert sum(p.tokens_in for p in parts) == t["all"].tokens_in
        assert sum(p.tokens_out for p in parts) == t["all"].tokens_out
        assert sum(p.failures for p in parts) == t["all"].failures == 1
        assert sum(p.cache_hits for p in parts) == t["all"].cache_hits == 1
        assert sum(p.cost_usd for p in parts) == pytest.approx(t["all"].cost_usd, rel=1e-12)
    assert t["all"].cost_usd > 0
    assert set(t["role"]) == {"policy", "judge"} and set(t["tag"]) == {"rollout", "score", "repair", "again"}
    assert t["tag"]["again"].cache_hits == 1 and t["tag"]["again"].tokens_in == 0 and t["tag"]["again"].cost_usd == 0

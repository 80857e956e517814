"""Fuzz target: endpoint replies (:mod:`treadle.llm.parse`, :mod:`treadle.llm.structured`,
:mod:`treadle.untrusted`). Any body is a :class:`ChatResult` or a :class:`BadResponseError`; any reply text is
a validated value or an error string; masking and JSON loading are total and linear."""
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from treadle.llm.backends import BadResponseError
from treadle.llm.parse import parse_response
from treadle.llm.records import ChatResult
from treadle.llm.structured import extract_and_validate
from treadle.untrusted import UntrustedInputError, clip, loads_json, mask_secrets

from .linearity import FUZZ, assert_linear, hostile_text, repeat_to, unit

scalars = st.none() | st.booleans() | st.integers(-10 ** 30, 10 ** 30) | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.sampled_from(["choices", "message", "content", "tool_calls",
                                                              "function", "name", "arguments", "usage",
                                                              "prompt_tokens", "completion_tokens", "text",
                                                              "logprobs", "token_ids", "finish_reason", "id"]),
                                             kids, max_size=5), max_leaves=25)


def _choice(msg):
    return {"choices": [{"message": msg, "finish_reason": "stop"}]}


bodies = st.one_of(
    json_values,
    st.builds(_choice, json_values),
    st.builds(lambda content, calls, usage: {**_choice({"content": content, "tool_calls": calls}), "usage": usage},
              scalars, json_values, json_values))


def _parse(body, kind="chat"):
    try:
        out = parse_response(body, kind=kind, model="m", key="k", sample_index=0, latency_s=0.0, recorded=False)
    except BadResponseError:
        return None
    assert isinstance(out, ChatResult)
    assert out.usage.prompt_tokens >= 0 and out.usage.completion_tokens >= 0
    return out


@FUZZ
@given(bodies)
def test_any_body_is_a_result_or_a_bad_response(body):
    _parse(body, "chat")
    _parse(body, "completion")


class _Answer(BaseModel):
    x: int
    tags: list[str] = []


def _extract(text):
    value, error = extract_and_validate(text, _Answer)
    assert (value is None) != (error is None)
    return value


@FUZZ
@given(hostile_text)
def test_any_reply_text_is_a_value_or_an_error(text):
    _extract(text)
    try:
        loads_json(text)
    except UntrustedInputError:
        pass
    assert len(clip(text, 50)) <= 50 and isinstance(mask_secrets(text), str)


@FUZZ
@given(st.integers(0, 10 ** 6), st.lists(st.text(max_size=5), max_size=3), hostile_text, hostile_text)
def test_a_valid_answer_in_prose_or_a_fence_is_found(x, tags, before, after):
    doc = json.dumps({"x": x, "tags": tags})
    for text in (doc, f"```json\n{doc}\n```", f"Sure! {doc}"):
        v = _extract(text)
        assert v is not None and v.x == x


@settings(FUZZ, max_examples=10)
@given(unit)
def test_reply_parsing_is_linear(u):
    assert_linear(_extract, repeat_to(u), f"extract_and_validate({u!r} * n)")


def test_reply_parsing_is_linear_on_known_degenerate_inputs():
    for u in ("[", "{", "[1,", '{"x": [', "```", "```json\n" + " " * 4, " ", '"', "\\", "{\"x\": 1" + " " * 3,
              "sk-", "Bearer "):
        assert_linear(_extract, repeat_to(u), f"extract_and_validate({u!r} * n)")
        assert_linear(mask_secrets, repeat_to(u), f"mask_secrets({u!r} * n)")
        assert_linear(lambda t: _load(t), repeat_to(u), f"loads_json({u!r} * n)")


def _load(text):
    try:
        return loads_json(text)
    except UntrustedInputError:
        return None

"""Fuzz target: JSON-RPC lines a WEFT server reads (the MCP SDK's message model, as the stdio and HTTP
transports parse them) and the tool results the runtime reads back. Any line is a message or a pydantic
``ValidationError``; any result text is JSON or kept as text; both linear in the input."""
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from mcp.types import jsonrpc_message_adapter
from pydantic import ValidationError

from treadle.weft.runtime.sessions import result_payload

from .linearity import FUZZ, assert_linear, hostile_text, repeat_to, unit

ids = st.none() | st.integers(-10 ** 20, 10 ** 20) | st.text(max_size=8)
params = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                      lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                      max_leaves=12)
messages = st.fixed_dictionaries({"jsonrpc": st.sampled_from(["2.0", "1.0", 2]),
                                  "method": st.sampled_from(["tools/call", "tools/list", "initialize", ""]) | ids},
                                 optional={"id": ids, "params": params, "result": params, "error": params})


def _message(line):
    try:
        return jsonrpc_message_adapter.validate_json(line, by_name=False)  # what the stdio/SSE servers run
    except ValidationError:
        return None


class _Result:
    structured_content = None

    def __init__(self, text):
        self.content = [type("Text", (), {"text": text})()]


def _result(text):
    value, raw = result_payload(_Result(text))
    assert raw == text
    return value


@FUZZ
@given(st.one_of(messages.map(json.dumps), hostile_text))
def test_any_line_is_a_message_or_a_validation_error(line):
    _message(line)
    _result(line)


@settings(FUZZ, max_examples=8)
@given(unit)
def test_parsing_lines_and_results_is_linear(u):
    assert_linear(_message, repeat_to(u), f"JSONRPCMessage({u!r} * n)")
    assert_linear(_result, repeat_to(u), f"result_payload({u!r} * n)")


def test_known_degenerate_lines():
    for u in ("[", "{", '{"a":', " ", '"', "\\u0000", "1" * 50):
        assert_linear(_message, repeat_to(u), f"JSONRPCMessage({u!r} * n)")
        assert_linear(_result, repeat_to(u), f"result_payload({u!r} * n)")

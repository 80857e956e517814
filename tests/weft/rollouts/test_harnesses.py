"""Harness parsers: round trips, tolerated variants, and malformed output as recorded policy errors."""
import json

import pytest

from treadle.llm.records import ToolCall as NativeCall
from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.rollouts.harnesses import harness_label
from treadle.weft.rollouts.records import PolicyOutput
from treadle.weft.rollouts.registry import HARNESSES, UnknownComponentError

CALLS = [ToolCall(name="find_customer", arguments={"email": "ada@example.com"}),
         ToolCall(name="place_order", arguments={"customer_id": 1, "items": [{"sku": "MUG", "qty": 2}]})]


@pytest.mark.parametrize("name", ["hermes", "react", "native", "openclaw"])
def test_round_trip_parallel_calls_and_final_reply(name):
    h = HARNESSES.build(name)
    parsed = h.parse(h.render(CALLS))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in CALLS]
    assert parsed.failures == ()
    final = h.parse(h.render([], "All done."))
    assert final.calls == () and final.failures == () and final.reply == "All done."
    lab = harness_label(h)
    assert lab["name"] == name and lab["parser"] and lab["tolerance"]


@pytest.mark.parametrize("name", ["hermes", "react", "native", "openclaw"])
def test_malformed_call_is_a_failure_not_an_exception(name):
    h = HARNESSES.build(name)
    p = h.parse(h.render_malformed(CALLS[0]))
    assert p.calls == () and len(p.failures) == 1 and "JSONDecodeError" in p.failures[0].message


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})]),                    # no closing tag
    ('<tool_call>```json\n{"name": "f", "arguments": {"a": 1}}\n```</tool_call>', [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', [("f", {"a": 1})]),
    ('<tool_call>{"name": "f"}</tool_call> and <tool_call>{"name": "g", "arguments": {}}</tool_call>',
     [("f", {}), ("g", {})]),
])
def test_hermes_tolerance(text, expected):
    p = HARNESSES.build("hermes").parse(PolicyOutput(text=text))
    assert [(c.name, c.arguments) for c in p.calls] == expected and p.failures == ()


def test_hermes_rejects_non_object_and_keeps_reply():
    p = HARNESSES.build("hermes").parse(PolicyOutput(text='Sure. <tool_call>[1, 2]</tool_call>'))
    assert p.calls == () and len(p.failures) == 1 and p.reply == "Sure."


def test_react_tolerance():
    h = HARNESSES.build("react")
    p = h.parse(PolicyOutput(text="thought: look up\naction: list_orders\naction input: ```json\n{\"customer_id\": 1}\n```"))
    assert [(c.name, c.arguments) for c in p.calls] == [("list_orders", {"customer_id": 1})]
    p = h.parse(PolicyOutput(text="Thought: x\nAction: get_time"))
    assert [(c.name, c.arguments) for c in p.calls] == [("get_time", {})]
    p = h.parse(PolicyOutput(text="Thought: x\nAction: not a tool!\nAction Input: {}"))
    assert p.calls == () and len(p.failures) == 1
    assert h.parse(PolicyOutput(text="It is done, bye.")).reply == "It is done, bye."


def test_native_tolerance_and_tool_messages():
    h = HARNESSES.build("native")
    out = PolicyOutput(tool_calls=(NativeCall(id="a", name="f", arguments=""),
                                   NativeCall(id="b", name="g", arguments='```json\n{"x": 2}\n```')),
                       finish_reason="tool_calls")
    p = h.parse(out)
    assert [(c.id, c.name, c.arguments) for c in p.calls] == [("a", "f", {}), ("b", "g", {"x": 2})]
    msg = h.assistant_message(out)
    assert [t["id"] for t in msg["tool_calls"]] == ["a", "b"]
    tm = h.tool_messages(p.calls, ["r1", "r2"])
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in tm] == [("tool", "a", "r1"), ("tool", "b", "r2")]
    assert json.loads(h.render(CALLS).tool_calls[1].arguments) == CALLS[1].arguments


def test_unknown_harness_name():
    with pytest.raises(UnknownComponentError, match="unknown harness 'claw'.*hermes.*openclaw"):
        HARNESSES.build("claw")


@pytest.mark.parametrize("name", ["hermes", "react"])
def test_text_harness_also_reads_server_parsed_native_calls(name):
    h = HARNESSES.build(name)
    out = PolicyOutput(text="", tool_calls=(NativeCall(id="x", name="f", arguments='{"a": 1}'),
                                            NativeCall(id="y", name="g", arguments="{bad")))
    p = h.parse(out)
    assert [(c.id, c.name, c.arguments) for c in p.calls] == [("x", "f", {"a": 1})]
    assert [f.id for f in p.failures] == ["y"]
    assert h.assistant_message(out)["tool_calls"][0]["function"]["name"] == "f"

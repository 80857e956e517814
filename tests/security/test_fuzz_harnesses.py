"""Fuzz target: harness outputs (:mod:`treadle.weft.rollouts.harnesses`, OpenClaw, RSI code extraction). Any
model output parses to calls, :class:`ParseFailure` records and a reply, never an exception, in time linear in
its length: a degenerate output must not stall the event loop other rollouts share."""
import pytest
from hypothesis import given, settings

from treadle.llm.records import ToolCall as NativeCall
from treadle.rsi.coding import extract_code
from treadle.untrusted import fenced_blocks, strip_fence
from treadle.weft.rollouts import harnesses, openclaw  # noqa: F401  (register the harnesses)
from treadle.weft.rollouts.records import ParsedStep, PolicyOutput
from treadle.weft.rollouts.registry import HARNESSES

from .linearity import FUZZ, assert_linear, hostile_text, repeat_to, unit

NAMES = ["hermes", "react", "native", "openclaw"]
# each of these was (or is in a sibling parser) the worst case of a backtracking regex
DEGENERATE = [" ", "\n", " \n", "```", "```json" + " " * 5, "``` ", "<tool_call>", "<tool_call> ", "Action: ",
              "Action: a\n", "Action Input: ", "\nAction Input: {", "Final ", "Thought: \n", "[[reply_to:",
              "[[ reply_to: ", "<think>", "<final>", "{", "[", '{"a": [', "\\"]


def _parser(name):
    h = HARNESSES.build(name)

    def parse(text: str) -> ParsedStep:
        step = h.parse(PolicyOutput(text=text))
        native = h.parse(PolicyOutput(text="", tool_calls=(NativeCall(id="c", name="f", arguments=text),)))
        assert isinstance(step, ParsedStep) and isinstance(native, ParsedStep)
        return step
    return parse


@pytest.mark.parametrize("name", NAMES)
def test_any_output_parses_without_raising(name):
    parse = _parser(name)

    @FUZZ
    @given(hostile_text)
    def run(text):
        step = parse(text)
        for c in step.calls:
            assert isinstance(c.arguments, dict)

    run()


@pytest.mark.parametrize("name", NAMES)
def test_parse_time_is_linear_on_degenerate_outputs(name):
    parse = _parser(name)
    for u in DEGENERATE:
        assert_linear(parse, repeat_to(u), f"{name}.parse({u!r} * n)")


@pytest.mark.parametrize("name", NAMES)
def test_parse_time_is_linear_on_generated_outputs(name):
    parse = _parser(name)

    @settings(FUZZ, max_examples=6)
    @given(unit)
    def run(u):
        assert_linear(parse, repeat_to(u), f"{name}.parse({u!r} * n)")

    run()


def test_fence_and_code_extraction_is_total_and_linear():
    @FUZZ
    @given(hostile_text)
    def run(text):
        assert isinstance(extract_code(text), str) and isinstance(strip_fence(text), str)
        assert all(isinstance(b, str) for b in fenced_blocks(text))

    run()
    for u in ("```", "``` ", "```python" + " " * 3, " ", "\n", "```\n"):
        for fn in (extract_code, strip_fence, fenced_blocks):
            assert_linear(fn, repeat_to(u), f"{fn.__name__}({u!r} * n)")
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nthanks") == "def f():\n    return 1\n"
    assert strip_fence("```json\n{\"a\": 1}\n```") == '{"a": 1}'

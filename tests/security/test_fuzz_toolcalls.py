"""Fuzz target: tool-call strings (:mod:`treadle.weft.runtime.callparse`). Any text is a list of calls or a
:class:`CallParseError`, in time linear in its length."""
import keyword

from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.weft.runtime.callparse import ToolCall, parse_call, parse_calls
from treadle.weft.runtime.errors import CallParseError

from .linearity import FUZZ, assert_linear, hostile_text, repeat_to, unit


def _parse(text: str):
    try:
        return parse_calls(text, param_order=["a", "b", "c"])
    except CallParseError:
        return None


@FUZZ
@given(hostile_text)
def test_any_text_is_calls_or_a_call_parse_error(text):
    out = _parse(text)
    assert out is None or all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in out)
    try:
        parse_call(text)
    except CallParseError:
        pass


@FUZZ
@given(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(
                           lambda k: not keyword.iskeyword(k)),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                                    lambda kids: st.lists(kids, max_size=3)
                                    | st.dictionaries(st.text(max_size=5), kids, max_size=3), max_leaves=10),
                       max_size=4))
def test_calls_written_with_repr_round_trip(args):
    text = "tool(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
    assert parse_call(text).arguments == args


@settings(FUZZ, max_examples=10)
@given(unit)
def test_parse_time_is_linear_in_the_input(u):
    assert_linear(_parse, repeat_to(u), f"parse_calls({u!r} * n)")


def test_parse_time_is_linear_on_known_degenerate_inputs():
    for u in ("[", "(", " ", "f(a=[", '"', "\\", "[f(),", "f(a={'k': 1, ", "f(a=1, " * 3, "-" * 7):
        assert_linear(_parse, repeat_to(u), f"parse_calls({u!r} * n)")

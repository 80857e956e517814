"""Call strings are parsed with ast into structured calls; nothing is evaluated."""
import re

import pytest

from treadle.weft.runtime.callparse import ToolCall, parse_call, parse_calls
from treadle.weft.runtime.errors import CallParseError
from treadle.weft.runtime.stats import ToolStats, percentile


@pytest.mark.parametrize("text, name, args", [
    ('f(a=1, b="x")', "f", {"a": 1, "b": "x"}),
    ("  f()  ", "f", {}),
    ("f(x=-2.5, y=None, z=True, w=[1, (2, 3)], v={'k': {'n': [1]}})", "f",
     {"x": -2.5, "y": None, "z": True, "w": [1, (2, 3)], "v": {"k": {"n": [1]}}}),
    ("Cls.method(a='b')", "method", {"a": "b"}),
    ("g(1, 'two', c=3)", "g", {"a": 1, "b": "two", "c": 3}),
])
def test_parse_call(text, name, args):
    c = parse_call(text, param_order={"g": ["a", "b", "c"]})
    assert c == ToolCall(name=name, arguments=args)


def test_parse_calls_and_dotted():
    assert parse_calls('[f(a=1), m.g(b="2")]', keep_dotted=True) == [ToolCall(name="f", arguments={"a": 1}),
                                                                     ToolCall(name="m.g", arguments={"b": "2"})]
    assert parse_calls("[]") == []
    assert str(ToolCall(name="f", arguments={"a": 1, "b": "x"})) == "f(a=1, b='x')"


@pytest.mark.parametrize("text, msg", [
    ("f(", "not a call"),
    ("f(a=1", "not a call"),
    ("x", "expected a call"),
    ("f(a=1) + 1", "expected a call"),
    ("f(a=__import__('os').system('echo pwned'))", "not a literal"),
    ("f(a=open('/etc/passwd'))", "not a literal"),
    ("f(a=b)", "not a literal"),
    ("f(a=[x for x in y])", "not a literal"),
    ("f(a=f'{x}')", "not a literal"),
    ("f()()", "must be a (dotted) name"),
    ("f(*a)", "*args"),
    ("f(**a)", "**kwargs"),
    ("f(1)", "positional arguments need"),
    ("f(a=1, a=2)", "given twice"),
    ("g(1, 2, 3, 4)", "4 positional arguments"),
    ("g(1, a=2)", "given twice"),
])
def test_parse_call_rejects(text, msg):
    with pytest.raises(CallParseError, match=re.escape(msg)):
        parse_call(text, param_order={"g": ["a", "b", "c"]})


def test_parse_call_type_and_size():
    with pytest.raises(TypeError, match="must be a str"):
        parse_call(b"f()")
    with pytest.raises(CallParseError, match="too long"):
        parse_call("f(a='" + "x" * 200_000 + "')")


def test_stats_percentiles():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 0)
    st = ToolStats()
    st.record("h", "t", 1.0, None, "srv")
    st.record("h", "t", None, "invalid_args")
    assert st.get("h", "t")["errors"] == {"invalid_args": 1} and st.get("h", "t")["error_rate"] == 0.5
    assert st.get("h", "never")["calls"] == 0

"""BFCL schema dialect -> JSON Schema."""
import copy

import jsonschema
import pytest

from treadle.weft.envs.bfcl_schema import bfcl_to_tool

DOC = {
    "name": "place_order",
    "description": "Place a stock order.",
    "parameters": {
        "type": "dict",
        "properties": {
            "symbol": {"type": "string", "description": "ticker"},
            "amount": {"type": "integer"},
            "price": {"type": "float", "default": 0.0},
            "side": {"type": "string", "enum": ["buy", "sell"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "window": {"type": "tuple", "items": {"type": "integer"}},
            "meta": {"type": "dict", "properties": {"note": {"type": "any"}}},
        },
        "required": ["symbol", "amount", "side"],
    },
}


def test_convert_and_validate_instances():
    before = copy.deepcopy(DOC)
    tool = bfcl_to_tool(DOC)
    assert DOC == before  # caller's dict untouched
    s = tool["input_schema"]
    assert tool["name"] == "place_order" and s["type"] == "object" and s["required"] == ["symbol", "amount", "side"]
    assert s["properties"]["price"] == {"type": "number", "default": 0.0}
    assert s["properties"]["window"] == {"type": "array", "items": {"type": "integer"}}
    assert s["properties"]["meta"]["properties"]["note"] == {}
    v = jsonschema.Draft202012Validator(s)
    assert v.is_valid({"symbol": "NVDA", "amount": 3, "side": "buy", "price": 1.5, "meta": {"note": [1]}})
    assert not v.is_valid({"symbol": "NVDA", "amount": 3.5, "side": "buy"})
    assert not v.is_valid({"symbol": "NVDA", "amount": 3, "side": "hold"})
    assert bfcl_to_tool({"name": "ls"})["input_schema"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("doc, msg", [
    ({"parameters": {}}, "non-empty str 'name'"),
    ({"name": "f", "parameters": {"type": "dict", "properties": {"a": {"type": "decimal"}}}}, "unknown BFCL type"),
    ({"name": "f", "parameters": {"type": "dict", "properties": {}, "required": ["a"]}}, "undefined properties"),
    ({"name": "f", "parameters": {"type": "dict", "properties": []}}, "expected a dict"),
    ({"name": "f", "parameters": {"type": "string"}}, "must describe an object"),
    ({"name": "f", "parameters": {"type": "dict", "properties": {"a": {"type": "integer", "minimum": "x"}}}},
     "not valid JSON Schema"),
])
def test_bad_docs(doc, msg):
    with pytest.raises(ValueError, match=msg):
        bfcl_to_tool(doc)
    with pytest.raises(TypeError, match="doc must be a dict"):
        bfcl_to_tool([doc])

"""BFCL function documentation (its schema dialect) -> MCP tool definitions with JSON Schema.

BFCL describes each function as ``{"name", "description", "parameters": {"type": "dict",
"properties": {...}, "required": [...]}}`` with a few non-JSON-Schema type names. This converter maps
``dict`` -> ``object``, ``float`` -> ``number``, ``tuple``/``list`` -> ``array``, ``any`` -> no type
constraint (plus the Python spellings ``int``/``str``/``bool``), walks ``properties`` and ``items``
recursively, keeps ``description``/``enum``/``default``/``required``, and checks the result is a
valid JSON Schema (draft 2020-12). The environments themselves are in :mod:`treadle.weft.envs.bfcl`.
"""
from __future__ import annotations

import copy
from typing import Any

import jsonschema

_TYPES = {"dict": "object", "object": "object", "float": "number", "number": "number", "integer": "integer",
          "int": "integer", "string": "string", "str": "string", "boolean": "boolean", "bool": "boolean",
          "array": "array", "list": "array", "tuple": "array", "null": "null", "any": None}
_KEEP = ("description", "enum", "default", "minimum", "maximum", "minItems", "maxItems", "pattern", "format")


def _convert(node: Any, path: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        raise ValueError(f"{path}: expected a schema object (dict), got {type(node).__name__}")
    out: dict[str, Any] = {k: copy.deepcopy(node[k]) for k in _KEEP if k in node}
    t = node.get("type")
    if t is not None:
        if not isinstance(t, str) or t.lower() not in _TYPES:
            raise ValueError(f"{path}.type: unknown BFCL type {t!r}; known: {sorted(_TYPES)}")
        mapped = _TYPES[t.lower()]
        if mapped is not None:
            out["type"] = mapped
    if "properties" in node:
        props = node["properties"]
        if not isinstance(props, dict):
            raise ValueError(f"{path}.properties: expected a dict, got {type(props).__name__}")
        out["properties"] = {k: _convert(v, f"{path}.properties.{k}") for k, v in props.items()}
        out.setdefault("type", "object")
    if "required" in node:
        req = node["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise ValueError(f"{path}.required: expected a list of str, got {req!r}")
        missing = [r for r in req if r not in out.get("properties", {})]
        if missing:
            raise ValueError(f"{path}.required names undefined properties {missing}")
        out["required"] = list(req)
    if "items" in node:
        out["items"] = _convert(node["items"], f"{path}.items")
    if "additionalProperties" in node:
        ap = node["additionalProperties"]
        out["additionalProperties"] = ap if isinstance(ap, bool) else _convert(ap, f"{path}.additionalProperties")
    return out


def bfcl_to_tool(doc: dict[str, Any]) -> dict[str, Any]:
    """Convert one BFCL function doc to ``{"name", "description", "input_schema"}`` (JSON Schema).

    The caller's ``doc`` is never modified.

    Raises:
        TypeError: ``doc`` is not a dict.
        ValueError: no ``name``, an unknown type, malformed ``properties``/``required``, or an invalid
            resulting schema (the message names the path).
    """
    if not isinstance(doc, dict):
        raise TypeError(f"doc must be a dict (one BFCL function doc), got {type(doc).__name__}")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"doc must have a non-empty str 'name', got {name!r}")
    params = doc.get("parameters", {"type": "dict", "properties": {}})
    schema = _convert(params, f"{name}.parameters")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{name}.parameters must describe an object ('dict'), got type {schema.get('type')!r}")
    schema["type"] = "object"
    schema.setdefault("properties", {})
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        raise ValueError(f"{name}: converted schema is not valid JSON Schema: {err.message}") from err
    return {"name": name, "description": str(doc.get("description", "")), "input_schema": schema}

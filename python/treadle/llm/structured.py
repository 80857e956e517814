"""Structured output helpers: the response_format per mode, tolerant JSON extraction, validation.

Extraction accepts a bare JSON value, one inside a ```json fence, or the first JSON object/array
embedded in prose that validates; the pydantic error of the best candidate is what a repair re-ask quotes.
"""
from __future__ import annotations

import json
import re

from pydantic import BaseModel, ValidationError

__all__ = ["response_format", "schema_instruction", "extract_and_validate"]

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)


def response_format(schema: type[BaseModel], mode: str) -> dict | None:
    if mode == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema()}}
    if mode == "json_object":
        return {"type": "json_object"}
    return None


def schema_instruction(schema: type[BaseModel]) -> str:
    return ("Reply with a single JSON object (no prose) that validates against this JSON schema:\n"
            + json.dumps(schema.model_json_schema(), sort_keys=True))


def _candidates(text: str):
    yield text.strip()
    for m in _FENCE.finditer(text):
        yield m.group(1).strip()
    dec = json.JSONDecoder()
    for i, c in enumerate(text):
        if c in "{[":
            try:
                _, end = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                continue
            yield text[i:end]


def extract_and_validate(text: str, schema: type[BaseModel]) -> tuple[BaseModel | None, str | None]:
    """``(instance, None)`` for the first JSON candidate in ``text`` that validates, else ``(None, error)``
    with the validation error of the first parseable candidate (or 'no JSON found')."""
    first_error = None
    for cand in _candidates(text):
        if not cand:
            continue
        try:
            data = json.loads(cand)
        except json.JSONDecodeError:
            continue
        try:
            return schema.model_validate(data), None
        except ValidationError as err:
            first_error = first_error or str(err)
    return None, first_error or "no JSON object found in the reply"

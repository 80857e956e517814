"""Structured output helpers: the response_format per mode, tolerant JSON extraction, validation.

Extraction accepts a bare JSON value, one inside a ```json fence, or the first JSON object/array
embedded in prose that validates; the pydantic error of the best candidate is what a repair re-ask quotes.
Extraction is linear in the reply: fences are found with ``str.find``, at most :data:`MAX_EMBEDDED` embedded
openers are tried, and every candidate goes through :func:`treadle.untrusted.loads_json` (nesting bounded,
duplicated keys rejected, over-long integers a parse failure), so garbage text is "no JSON", never a raise.
"""
from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError

from treadle.untrusted import UntrustedInputError, clip, fenced_blocks, loads_json

__all__ = ["MAX_EMBEDDED", "response_format", "schema_instruction", "extract_and_validate"]

MAX_EMBEDDED = 32
"""Embedded ``{`` / ``[`` positions tried per reply (each try is linear in the reply)."""


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
    for body in fenced_blocks(text):
        yield body.strip()
    dec = json.JSONDecoder()
    tried, i = 0, 0
    while tried < MAX_EMBEDDED:
        starts = [p for p in (text.find("{", i), text.find("[", i)) if p >= 0]
        if not starts:
            return
        i = min(starts)
        tried += 1
        try:
            _, end = dec.raw_decode(text, i)
        except (ValueError, RecursionError):  # JSONDecodeError, the int-str digit limit, deep nesting
            i += 1
            continue
        yield text[i:end]
        i = end


def extract_and_validate(text: str, schema: type[BaseModel]) -> tuple[BaseModel | None, str | None]:
    """``(instance, None)`` for the first JSON candidate in ``text`` that validates, else ``(None, error)``
    with the validation error of the first parseable candidate (or 'no JSON found')."""
    first_error = None
    if not isinstance(text, str):
        return None, f"the reply is not text ({type(text).__name__})"
    for cand in _candidates(text):
        if not cand:
            continue
        try:
            data = loads_json(cand, what="the reply's JSON")
        except UntrustedInputError as err:
            if "duplicated key" in str(err) or "nested too deep" in str(err):
                first_error = first_error or str(err)
            continue
        try:
            return schema.model_validate(data), None
        except ValidationError as err:
            first_error = first_error or clip(err, 2000)
        except (ValueError, TypeError, RecursionError) as err:  # a validator that raised on hostile data
            first_error = first_error or clip(f"{type(err).__name__}: {err}", 2000)
    return None, first_error or "no JSON object found in the reply"

"""Text from outside the process (model output, endpoint replies, stored files): bounded parsing and key masking.

Every parser of such text goes through these helpers so that one degenerate input costs time linear in
its size and fails with a typed error, and every message built from it has API keys masked *before* it is
truncated (truncating first can cut a key in half and let the other half through):

- :func:`loads_json`: ``json.loads`` with duplicated object keys rejected, a nesting-depth bound (a reply
  nested 10^5 deep is an :class:`UntrustedInputError`, not a ``RecursionError``), and Python's integer-digit
  limit turned into the same typed error;
- :func:`mask_secrets` / :func:`clip`: the one masking function (values of secret-looking environment
  variables, keys registered with :func:`register_secret`, ``sk-...`` and ``Bearer ...`` tokens) and
  "mask, then truncate";
- :func:`strip_fence`: removes one Markdown code fence without a backtracking regex;
- :func:`as_count`: a token count from an endpoint as a bounded non-negative int.
"""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

__all__ = ["JSONDecodeError", "MAX_COUNT", "MAX_JSON_DEPTH", "UntrustedInputError", "as_count", "clip", "fenced_blocks", "json_depth",
           "loads_json", "mask_secrets", "register_secret", "strip_fence"]

MAX_JSON_DEPTH = 100
"""Deepest nesting of arrays/objects accepted from model or endpoint JSON (tool arguments, replies)."""
MAX_COUNT = 10 ** 12
"""Largest token count accepted from an endpoint's ``usage``."""

_SECRET_ENV = re.compile(r"(?:KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.I)
_MIN_SECRET = 8  # shorter values are too likely to be ordinary words to mask everywhere
# single quantifiers over classes disjoint from what precedes them: linear in the text
_TOKEN_PATTERNS = re.compile(r"\bsk-[A-Za-z0-9_\-]{8,}|(?i:\bbearer)[ \t]+[A-Za-z0-9._\-~+/]{8,}=*")
_registered: set[str] = set()
_lock = threading.Lock()


class UntrustedInputError(ValueError):
    """Text from a model, an endpoint or a stored file is not what the parser accepts (malformed, nested too
    deep, an integer too long, a duplicated key). A ``ValueError``, so callers that already treat
    ``ValueError`` as a typed parse failure keep doing so."""


class JSONDecodeError(UntrustedInputError, json.JSONDecodeError):
    """Untrusted text that is not JSON at all: both an :class:`UntrustedInputError` and a
    ``json.JSONDecodeError`` with json's own message (what a model is shown when its call does not parse stays
    the same text)."""


def register_secret(value: str | None) -> None:
    """Mask ``value`` everywhere from now on (the API key a config resolved, whatever its variable's name)."""
    if value and len(value) >= 4:
        with _lock:
            _registered.add(value)


def _secrets() -> list[str]:
    env = [v for k, v in os.environ.items() if _SECRET_ENV.search(k) and v and len(v) >= _MIN_SECRET]
    with _lock:
        found = set(env) | _registered
    return sorted(found, key=len, reverse=True)  # a key containing another is masked whole


def mask_secrets(text: Any) -> str:
    """``text`` (as ``str``) with every API key replaced by ``***``: the values of environment variables whose
    names say they hold a key/token/secret, keys registered with :func:`register_secret`, and anything shaped
    like ``sk-...`` or ``Bearer <token>``."""
    s = text if isinstance(text, str) else str(text)
    for secret in _secrets():
        if secret in s:
            s = s.replace(secret, "***")
    return _TOKEN_PATTERNS.sub("***", s)


def clip(text: Any, limit: int) -> str:
    """Mask keys in ``text``, THEN truncate it to ``limit`` characters (``...`` marks a cut)."""
    s = mask_secrets(text)
    return s if len(s) <= limit else s[:max(0, limit - 3)] + "..."


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise UntrustedInputError(f"duplicated key {clip(k, 60)!r} in a JSON object")
        out[k] = v
    return out


def json_depth(obj: Any) -> int:
    """Nesting depth of a JSON value (0 for a scalar), computed without recursion."""
    depth, stack = 0, [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
            depth = max(depth, d + 1)
        elif isinstance(o, (list, tuple)):
            stack.extend((v, d + 1) for v in o)
            depth = max(depth, d + 1)
    return depth


def loads_json(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, duplicates: bool = False,
               what: str = "JSON") -> Any:
    """``json.loads(text)`` for untrusted text.

    Raises:
        UntrustedInputError: not JSON, nested deeper than ``max_depth``, an integer over Python's digit limit,
            or (unless ``duplicates``) an object with a duplicated key.
    """
    try:
        if not duplicates:
            obj = json.loads(text, object_pairs_hook=_pairs)
        else:
            obj = json.loads(text)
    except UntrustedInputError:
        raise
    except RecursionError:
        raise UntrustedInputError(f"{what} is nested too deep (more than {max_depth} levels)") from None
    except json.JSONDecodeError as err:
        raise JSONDecodeError(err.msg, err.doc, err.pos) from None
    except (ValueError, TypeError, UnicodeDecodeError) as err:  # int-str digit limit, bad bytes
        raise UntrustedInputError(f"{what} is not valid: {clip(err, 160)}") from None
    if json_depth(obj) > max_depth:
        raise UntrustedInputError(f"{what} is nested too deep (more than {max_depth} levels)")
    return obj


def strip_fence(text: str) -> str:
    """``text`` stripped, and without one enclosing Markdown fence (```` ```json ... ``` ````, language tag
    optional): string operations only, linear in the text."""
    s = text.strip()
    if len(s) < 6 or not s.startswith("```") or not s.endswith("```"):
        return s
    body = s[3:-3]
    nl = body.find("\n")
    head = body if nl < 0 else body[:nl]
    tag = head.strip()
    if tag.isidentifier() and tag.lower() in ("json", "python", "py", "javascript", "js", "text"):
        body = "" if nl < 0 else body[nl + 1:]
    return body.strip()


def fenced_blocks(text: str, tags: tuple[str, ...] | None = None) -> list[str]:
    """The bodies of the Markdown code fences in ``text``, in order (```` ```lang\n...``` ````), found with
    ``str.find`` (linear; no regex to backtrack). A fence's language tag is the rest of its opening line;
    with ``tags`` given, only fences whose tag (lower case, ``""`` for none) is in ``tags`` are returned.
    An unclosed fence is ignored."""
    out: list[str] = []
    i = 0
    while True:
        a = text.find("```", i)
        if a < 0:
            return out
        b = text.find("```", a + 3)
        if b < 0:
            return out
        body = text[a + 3:b]
        nl = body.find("\n")
        tag = body[:nl].strip() if nl >= 0 else body.strip()
        if nl >= 0 and (tag == "" or (len(tag) <= 20 and tag.replace("-", "").replace("+", "").isalnum())):
            body = body[nl + 1:]
        elif nl < 0:
            tag = ""  # a one-line fence: ```{...}```
        else:
            tag = ""
        if tags is None or tag.lower() in tags:
            out.append(body)
        i = b + 3


def as_count(value: Any, what: str = "token count") -> int:
    """An endpoint's count (``usage.prompt_tokens``...) as an int in ``[0, MAX_COUNT]``; ``None`` is 0.

    Raises:
        UntrustedInputError: negative, not an integer (a bool, a float with a fraction, a string), or huge.
    """
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UntrustedInputError(f"{what} must be a non-negative integer, got {clip(repr(value), 40)}")
    if isinstance(value, float):
        if not value.is_integer():
            raise UntrustedInputError(f"{what} must be a non-negative integer, got {value!r}")
        value = int(value)
    if value < 0 or value > MAX_COUNT:
        raise UntrustedInputError(f"{what} must be in [0, {MAX_COUNT}], got {clip(repr(value), 40)}")
    return value

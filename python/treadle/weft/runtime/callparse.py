"""Call strings -> structured tool calls, with ``ast`` (model output is never ``eval``-ed).

Accepts ``f(a=1, b="x")``, dotted names (``Class.method(...)``: the last part is the tool name unless
``keep_dotted=True``), and for :func:`parse_calls` a Python list of calls ``[f(a=1), g()]`` (BFCL
style). Argument values must be literals (numbers, strings, bytes, True/False/None, and
lists/tuples/dicts/sets of literals, negative numbers): anything else (names, calls, attribute
access, comprehensions, f-strings) is rejected. Positional arguments need ``param_order`` (the
tool's parameter names in order) to be mapped to names. A dict literal that repeats a key is rejected (a
model that writes two values for one key has not made a call), as is an argument given twice. Parsing is
bounded: at most :data:`MAX_CALL_CHARS` characters, and ``ast`` refuses nesting deeper than 200 brackets
and integers over Python's digit limit (both a :class:`CallParseError`).
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from treadle.weft.runtime.errors import CallParseError

MAX_CALL_CHARS = 100_000


class ToolCall(BaseModel):
    """A structured tool call: tool name and JSON-like keyword arguments."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        return f"{self.name}({args})"


def _no_duplicate_keys(node: ast.AST, text: str) -> None:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Dict):
            seen: set = set()
            for k in sub.keys:
                if isinstance(k, ast.Constant):
                    try:
                        new = k.value not in seen
                        seen.add(k.value)
                    except TypeError:  # an unhashable key: literal_eval rejects it below
                        continue
                    if not new:
                        raise CallParseError(f"dict key {k.value!r:.60} given twice in "
                                             f"{(ast.get_source_segment(text, sub) or '')[:80]!r}")


def _literal(node: ast.AST, text: str) -> Any:
    _no_duplicate_keys(node, text)
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as err:
        seg = ast.get_source_segment(text, node) or ast.dump(node)[:80]
        raise CallParseError(f"argument value {seg!r} is not a literal ({err})") from None


def _call_from_node(node: ast.AST, text: str, keep_dotted: bool,
                    param_order: dict[str, Sequence[str]] | Sequence[str] | None) -> ToolCall:
    if not isinstance(node, ast.Call):
        raise CallParseError(f"expected a call like f(a=1), got {type(node).__name__}: {text[:120]!r}")
    parts = []
    f = node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if not isinstance(f, ast.Name):
        raise CallParseError(f"the called object must be a (dotted) name, got {ast.dump(node.func)[:80]}")
    parts.append(f.id)
    dotted = ".".join(reversed(parts))
    name = dotted if keep_dotted else parts[0]
    args: dict[str, Any] = {}
    order = param_order.get(name) if isinstance(param_order, dict) else param_order
    if node.args:
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise CallParseError(f"{name}: *args are not allowed")
        if order is None:
            raise CallParseError(f"{name}: positional arguments need the tool's parameter order; use name=value")
        if len(node.args) > len(order):
            raise CallParseError(f"{name}: {len(node.args)} positional arguments but the tool has {len(order)} "
                                 f"parameters {list(order)}")
        for pname, a in zip(order, node.args):
            args[pname] = _literal(a, text)
    for kw in node.keywords:
        if kw.arg is None:
            raise CallParseError(f"{name}: **kwargs are not allowed")
        if kw.arg in args:
            raise CallParseError(f"{name}: argument {kw.arg!r} given twice")
        args[kw.arg] = _literal(kw.value, text)
    return ToolCall(name=name, arguments=args)


def _parse_expr(text: str) -> ast.expr:
    if not isinstance(text, str):
        raise TypeError(f"call string must be a str, got {type(text).__name__}")
    if len(text) > MAX_CALL_CHARS:
        raise CallParseError(f"call string too long ({len(text)} chars > {MAX_CALL_CHARS})")
    try:
        return ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
        raise CallParseError(f"not a call: {getattr(err, 'msg', None) or err} in {text[:120]!r}") from None


def parse_call(text: str, *, keep_dotted: bool = False,
               param_order: dict[str, Sequence[str]] | Sequence[str] | None = None) -> ToolCall:
    """Parse one call string such as ``create_order(customer_id=1, items=[{"sku": "A", "qty": 2}])``.

    Args:
        text: the call string.
        keep_dotted: keep ``a.b.f`` as the tool name instead of ``f``.
        param_order: parameter names (or ``{tool: names}``) to map positional arguments.

    Raises:
        TypeError: ``text`` is not a str.
        CallParseError: not exactly one call with literal arguments.
    """
    return _call_from_node(_parse_expr(text), text, keep_dotted, param_order)


def parse_calls(text: str, *, keep_dotted: bool = False,
                param_order: dict[str, Sequence[str]] | Sequence[str] | None = None) -> list[ToolCall]:
    """Parse ``[f(a=1), g()]`` (or a single call, or an empty list) into a list of calls.

    Raises:
        TypeError / CallParseError: as :func:`parse_call`.
    """
    node = _parse_expr(text)
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    return [_call_from_node(n, text, keep_dotted, param_order) for n in items]

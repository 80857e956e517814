"""What ``treadle weft check`` reports without running the file: a server module read from its syntax tree.

Importing a server module runs its code (any top-level statement: file writes, network calls). The
static reading here never does: it parses the source with :mod:`ast`, finds the module-level
``server = WeftServer("name", backend=...)`` and the functions decorated with ``@server.tool`` /
``@server.tool(...)``, reads their contracts where they are literals, and runs the isolation check
(:func:`treadle.weft.runtime.isolation.check_source`, itself static). What needs the module imported (the
content hash, the tools' JSON schemas from type hints, decorator arguments that are not literals) is
left to :meth:`treadle.weft.runtime.registry.Registry.register`.
"""
from __future__ import annotations

import ast
from typing import Any

from pydantic import BaseModel, Field

from treadle.weft.runtime.errors import ServerImportError
from treadle.weft.runtime.isolation import SideEffectReport, check_source

__all__ = ["StaticTool", "StaticServer", "read_server"]

#: shown for a contract field that is not a literal (known only after importing the module)
NOT_LITERAL = "?"


class StaticTool(BaseModel):
    """One ``@server.tool`` function as written: contract fields are literals or :data:`NOT_LITERAL`."""

    name: str
    line: int
    reads: list[str] | str = Field(default_factory=list)
    writes: list[str] | str = Field(default_factory=list)
    returns: str = ""
    arguments: list[str] = Field(default_factory=list)


class StaticServer(BaseModel):
    """A server module read without running it."""

    filename: str
    name: str
    backend: str
    isolation: str
    report: SideEffectReport
    tools: list[StaticTool]
    executed: bool = False


def _literal(node: ast.AST | None, default: Any) -> Any:
    if node is None:
        return default
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return NOT_LITERAL


def _names(value: Any) -> list[str] | str:
    if value == NOT_LITERAL:
        return NOT_LITERAL
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, (list, tuple, set, frozenset)) else NOT_LITERAL


def _server_call(tree: ast.Module) -> tuple[str, ast.Call] | None:
    """``(variable, call)`` of the module-level ``server = WeftServer(...)`` (or ``x.WeftServer(...)``)."""
    found = None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            f = node.value.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if called == "WeftServer" and isinstance(t, ast.Name) and (found is None or t.id == "server"):
                    found = (t.id, node.value)
    return found


def _tool_decorator(dec: ast.expr, var: str) -> ast.Call | bool:
    """The decorator's call (``@var.tool(...)``), True for a bare ``@var.tool``, False otherwise."""
    target = dec.func if isinstance(dec, ast.Call) else dec
    if isinstance(target, ast.Attribute) and target.attr == "tool" and isinstance(target.value, ast.Name) \
            and target.value.id == var:
        return dec if isinstance(dec, ast.Call) else True
    return False


def read_server(source: str, filename: str = "<server>") -> StaticServer:
    """Read a server module's name, backend, tools and isolation level without running any of it.

    Args:
        source: the module's Python source.
        filename: used in messages only.

    Returns:
        A :class:`StaticServer` (``executed`` is False).

    Raises:
        TypeError: ``source`` is not a str.
        ServerImportError: the source does not parse, or defines no module-level
            ``server = WeftServer(...)`` (what importing it would also refuse).
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as err:
        raise ServerImportError(f"{filename} does not parse: line {err.lineno}: {err.msg}") from None
    found = _server_call(tree)
    if found is None:
        raise ServerImportError(f"{filename} defines no module-level `server = WeftServer(...)`")
    var, call = found
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    name = _literal(call.args[0] if call.args else kw.get("name"), NOT_LITERAL)
    backend = _literal(kw.get("backend"), "sqlite")
    tools = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            hit = _tool_decorator(dec, var)
            if hit is False:
                continue
            dkw = {k.arg: k.value for k in hit.keywords if k.arg} if isinstance(hit, ast.Call) else {}
            params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs][1:]
            tool_name = _literal(dkw.get("name"), node.name)
            returns = _literal(dkw.get("returns"), "")
            tools.append(StaticTool(name=str(tool_name if tool_name is not None else node.name), line=node.lineno,
                                    reads=_names(_literal(dkw.get("reads"), ())),
                                    writes=_names(_literal(dkw.get("writes"), ())),
                                    returns=returns if isinstance(returns, str) else NOT_LITERAL,
                                    arguments=[p for p in params if p != "weft_ctx"]))
    report = check_source(source, filename)
    return StaticServer(filename=filename, name=str(name), backend=str(backend), isolation=report.isolation,
                        report=report, tools=tools)

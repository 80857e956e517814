"""Static check of a server module for process-global side effects (seed: WEFT 4.1, MegaMCP registry).

Sessions of a server may *share* one imported copy of its module only if no tool call can leave
state outside the session's own state object. :func:`check_source` walks the module's AST (the
code is never run) and reports:

- ``module_mutable_state``: a module-level mutable container (list/dict/set/... literal or
  constructor) that code mutates, or that is not an ALL_CAPS constant;
- ``global_write``: a ``global`` statement inside a function, or a run-time write to an attribute of
  an imported module (``mpmath.mp.dps = ...``: process-global, not contained by module isolation);
- ``class_mutable_attribute``: a mutable container in a class body (shared by all instances);
- ``class_attribute_mutation``: a class attribute assigned or mutated at run time
  (``Cls.x = ...``, ``cls.x += ...``, ``type(self).x``, ``self.__class__.x``, or ``self.x.append``
  on a class-level container never rebound per instance);
- ``file_access``: ``open``, ``pathlib`` reads/writes, ``os``/``shutil`` file operations,
  ``sqlite3.connect`` of a file;
- ``network_access`` / ``process_access``: imports of socket/HTTP client modules, or of
  ``subprocess``/``multiprocessing``, ``os.system``/``os.fork``...

Any finding makes the server ``isolated``: each session imports its own copy of the module (so class
attributes and module globals are per session). Isolation is at the module level, not a sandbox:
file and network effects are reported, not contained.
"""
from __future__ import annotations

import ast
from typing import Literal

from pydantic import BaseModel, Field

FindingKind = Literal["module_mutable_state", "global_write", "class_mutable_attribute", "class_attribute_mutation",
                      "file_access", "network_access", "process_access", "syntax_error"]

_MUTABLE_CTORS = {"list", "dict", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque"}
_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add",
             "discard", "sort", "reverse", "appendleft", "extendleft", "popleft", "__setitem__", "__delitem__"}
_NETWORK_MODULES = {"socket", "ssl", "http", "urllib", "urllib3", "requests", "httpx", "aiohttp", "ftplib", "smtplib",
                    "poplib", "imaplib", "telnetlib", "websockets", "websocket", "grpc", "paramiko"}
_PROCESS_MODULES = {"subprocess", "multiprocessing", "signal", "ctypes"}
_OS_FILE = {"remove", "unlink", "rename", "replace", "mkdir", "makedirs", "rmdir", "removedirs", "chmod", "chown",
            "symlink", "link", "truncate", "open", "write", "listdir", "scandir", "walk", "chdir"}
_OS_PROCESS = {"system", "popen", "fork", "forkpty", "kill", "killpg", "_exit", "execv", "execve", "execvp", "spawnv",
               "putenv", "unsetenv"}
_PATH_IO = {"read_text", "write_text", "read_bytes", "write_bytes", "unlink", "mkdir", "touch", "rmdir", "symlink_to",
            "hardlink_to"}


class Finding(BaseModel):
    """One side effect found: its kind, source line and a short description."""

    kind: FindingKind
    line: int
    detail: str


class SideEffectReport(BaseModel):
    """Result of :func:`check_source`: findings and the isolation level they imply."""

    findings: list[Finding] = Field(default_factory=list)

    @property
    def isolation(self) -> Literal["shared", "isolated"]:
        return "isolated" if self.findings else "shared"

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}


def _is_mutable_value(node: ast.AST | None) -> bool:
    if isinstance(node, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return name in _MUTABLE_CTORS
    return False


def _root_name(node: ast.AST) -> str | None:
    """``a`` for ``a``, ``a.b.c``, ``a[0].b``; else None."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_class_ref(node: ast.AST, class_names: set[str]) -> bool:
    """``Cls``, ``cls``, ``type(self)``, ``self.__class__``."""
    if isinstance(node, ast.Name):
        return node.id in class_names or node.id == "cls"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
        return True
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _module_level_statements(tree: ast.Module):
    """Top-level statements, descending into module-level if/try/with blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []) or []:
                    stack.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])


def check_source(source: str, filename: str = "<server>") -> SideEffectReport:
    """Statically check server module ``source`` for process-global side effects.

    Args:
        source: Python source of the server module.
        filename: used in messages only.

    Returns:
        A :class:`SideEffectReport`; a module that does not parse gets one ``syntax_error`` finding.

    Raises:
        TypeError: ``source`` is not a str.
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
    report = SideEffectReport()
    add = report.findings.append
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as err:
        add(Finding(kind="syntax_error", line=err.lineno or 0, detail=str(err)))
        return report

    module_mutables: dict[str, int] = {}
    class_names: set[str] = set()
    class_mutables: dict[tuple[str, str], int] = {}
    instance_bound: dict[str, set[str]] = {}
    for node in _module_level_statements(tree):
        for t in _targets(node):
            if isinstance(t, ast.Name) and _is_mutable_value(getattr(node, "value", None)):
                module_mutables[t.id] = node.lineno
        if isinstance(node, ast.ClassDef):
            class_names.add(node.name)
            bound = instance_bound.setdefault(node.name, set())
            for item in node.body:
                for t in _targets(item):
                    if isinstance(t, ast.Name) and _is_mutable_value(getattr(item, "value", None)):
                        class_mutables[(node.name, t.id)] = item.lineno
            for sub in ast.walk(node):
                for t in _targets(sub):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        bound.add(t.attr)

    imported_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported_names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported_names |= {a.asname or a.name for a in node.names}
    mutated_globals: dict[str, int] = {}
    mutated_class_attrs: set[tuple[str, str]] = set()

    def note_mutation(target: ast.AST, line: int, fn_class: str | None) -> None:
        root = _root_name(target)
        if root in module_mutables and not isinstance(target, ast.Name):
            mutated_globals.setdefault(root, line)
        if isinstance(target, ast.Attribute) and root in imported_names and root not in class_names:
            add(Finding(kind="global_write", line=line,
                        detail=f"writes {ast.unparse(target)!r}, an attribute of imported module {root!r}"))
        if isinstance(target, ast.Attribute) and _is_class_ref(target.value, class_names):
            add(Finding(kind="class_attribute_mutation", line=line,
                        detail=f"class attribute {ast.unparse(target)!r} written at run time"))
        # self.x[...] = / self.x.append(...) on a class-level container never rebound per instance
        node = target
        while isinstance(node, (ast.Attribute, ast.Subscript)) and not (
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            node = node.value
        if (fn_class and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node is not target and node.value.id == "self" and (fn_class, node.attr) in class_mutables
                and node.attr not in instance_bound.get(fn_class, set())):
            mutated_class_attrs.add((fn_class, node.attr))
        if (isinstance(target, (ast.Attribute, ast.Subscript)) and not isinstance(target, ast.Name)):
            base = target.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                if isinstance(base, ast.Attribute) and _is_class_ref(base.value, class_names):
                    add(Finding(kind="class_attribute_mutation", line=line,
                                detail=f"class attribute {ast.unparse(base)!r} mutated at run time"))
                    break
                base = base.value

    def visit_function(fn: ast.AST, fn_class: str | None) -> None:
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Global):
                add(Finding(kind="global_write", line=sub.lineno, detail=f"global {', '.join(sub.names)}"))
            for t in _targets(sub):
                if not isinstance(t, ast.Name):
                    note_mutation(t, sub.lineno, fn_class)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _MUTATORS:
                note_mutation(ast.Subscript(value=sub.func.value, slice=ast.Constant(0)), sub.lineno, fn_class)

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit_function(item, node.name)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit_function(node, None)

    for name, line in sorted(module_mutables.items(), key=lambda kv: kv[1]):
        if name in mutated_globals:
            add(Finding(kind="module_mutable_state", line=mutated_globals[name],
                        detail=f"module-level container {name!r} (line {line}) mutated at run time"))
        elif not name.isupper():
            add(Finding(kind="module_mutable_state", line=line,
                        detail=f"module-level mutable container {name!r} (not an ALL_CAPS constant)"))
    for (cls, attr), line in sorted(class_mutables.items(), key=lambda kv: kv[1]):
        if (cls, attr) in mutated_class_attrs or not attr.isupper():
            add(Finding(kind="class_mutable_attribute", line=line,
                        detail=f"class {cls} holds mutable container {attr!r} shared by all instances"))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                top = m.split(".")[0]
                if top in _NETWORK_MODULES:
                    add(Finding(kind="network_access", line=node.lineno, detail=f"imports {m}"))
                elif top in _PROCESS_MODULES:
                    add(Finding(kind="process_access", line=node.lineno, detail=f"imports {m}"))
                elif top == "shutil":
                    add(Finding(kind="file_access", line=node.lineno, detail="imports shutil"))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func) or ""
            last = node.func.attr if isinstance(node.func, ast.Attribute) else name
            if name in ("open", "io.open", "os.fdopen"):
                add(Finding(kind="file_access", line=node.lineno, detail=f"calls {name}()"))
            elif name.startswith("os.") and last in _OS_PROCESS:
                add(Finding(kind="process_access", line=node.lineno, detail=f"calls {name}()"))
            elif name.startswith(("os.", "os.path.")) and last in _OS_FILE:
                add(Finding(kind="file_access", line=node.lineno, detail=f"calls {name}()"))
            elif name == "sqlite3.connect" and not (
                    node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == ":memory:"):
                add(Finding(kind="file_access", line=node.lineno, detail="sqlite3.connect() of a file"))
            elif isinstance(node.func, ast.Attribute) and last in _PATH_IO and not name.startswith("self."):
                add(Finding(kind="file_access", line=node.lineno, detail=f"calls .{last}() (pathlib-style file I/O)"))
    report.findings.sort(key=lambda f: (f.line, f.kind))
    return report

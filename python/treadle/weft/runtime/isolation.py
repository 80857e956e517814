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

- ``mutable_alias``: function code that reaches a module-level or class-level value the check cannot
  prove immutable, other than by a read that can only return immutable values (``X[k]``, ``X.get(k)``,
  ``k in X``, ``len(X)``, iteration, ``deepcopy(X)`` of a container whose leaves are all constants).
  Assigning such a value into instance state (``self.vpn = self.DEFAULT_VPN``), passing it to a
  helper, a module-level counter (``itertools.count()``) or namespace object: all are aliases through
  which one session could write what another reads;
- ``mutable_default_argument``: a default argument value that is not provably immutable (ruff B006:
  the default object is created once and shared by every call of every session);
- class-level values that are not provably immutable are ``class_mutable_attribute`` whatever their
  name's case (ruff RUF012; a ``ClassVar`` annotation documents sharing, it does not prevent it).

**Isolate unless proven safe.** A server is ``shared`` only when the check finds nothing; any finding
makes it ``isolated``: each session imports its own copy of the module (so class attributes and module
globals are per session). What ``shared`` guarantees: every module- and class-level value that tool
code can reach is a constant, a function/class/module, or a container of constants read without
handing out a reference; so no write of one session can be observed by another through the server
module. Not covered (by either level): state kept inside *imported third-party* modules and changed
through their functions (``random.seed``, a library's own caches), and files/network/processes, which
are reported (``file_access`` ...), not contained. Isolation is at the module level, not a sandbox.
"""
from __future__ import annotations

import ast
from typing import Literal

from pydantic import BaseModel, Field

FindingKind = Literal["module_mutable_state", "global_write", "class_mutable_attribute", "class_attribute_mutation",
                      "mutable_alias", "mutable_default_argument", "file_access", "network_access", "process_access",
                      "syntax_error"]

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



_IMMUTABLE_CTORS = {"frozenset", "tuple", "str", "int", "float", "bool", "bytes", "complex", "range", "Decimal",
                    "Fraction", "timedelta", "date", "datetime", "getLogger", "compile", "TypeVar", "ParamSpec",
                    "NewType", "namedtuple", "NamedTuple", "WeftServer", "Field", "field", "PrivateAttr", "object"}
_TYPE_FORMS = {"Literal", "Annotated", "Optional", "Union", "list", "dict", "tuple", "set", "frozenset", "type",
               "Callable", "ClassVar", "Final"}
_COPYING_READS = {"len", "deepcopy", "sorted", "list", "tuple", "set", "frozenset", "dict", "any", "all", "sum",
                  "min", "max", "enumerate", "iter", "reversed", "str", "repr", "bool", "hash", "json.dumps",
                  "copy.deepcopy"}
_ELEMENT_READS = {"get", "keys", "values", "items", "count", "index", "copy"}


def _call_name(node: ast.AST) -> str | None:
    f = node.func if isinstance(node, ast.Call) else None
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _immutable(node: ast.AST | None, safe: set[str]) -> bool:
    """True when ``node`` provably evaluates to an immutable value (``safe``: names known immutable)."""
    if node is None or isinstance(node, (ast.Constant, ast.JoinedStr, ast.Compare, ast.Lambda)):
        return True
    if isinstance(node, ast.Tuple):
        return all(_immutable(e, safe) for e in node.elts)
    if isinstance(node, ast.BinOp):
        return _immutable(node.left, safe) and _immutable(node.right, safe)
    if isinstance(node, ast.UnaryOp):
        return _immutable(node.operand, safe)
    if isinstance(node, (ast.BoolOp, ast.IfExp)):
        parts = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
        return all(_immutable(v, safe) for v in parts)
    if isinstance(node, ast.Name):
        return node.id in safe
    if isinstance(node, ast.Subscript):  # type aliases: Literal[...], dict[str, int], ...
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
        return base in _TYPE_FORMS
    if isinstance(node, ast.Call):
        name = _call_name(node)
        if name in ("frozenset", "tuple"):
            return all(_container_of_constants(a, safe) for a in node.args)
        return name in _IMMUTABLE_CTORS
    return False


def _container_of_constants(node: ast.AST | None, safe: set[str]) -> bool:
    """A container literal whose leaves (at any depth) are immutable, or an immutable value."""
    if isinstance(node, (ast.List, ast.Set, ast.Tuple)):
        return all(_container_of_constants(e, safe) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _immutable(k, safe) for k in node.keys) and all(
            _container_of_constants(v, safe) for v in node.values)
    if isinstance(node, ast.Call) and _call_name(node) in ("set", "list", "dict") and not node.keywords:
        return all(_container_of_constants(a, safe) for a in node.args)  # set(), list((1, 2))
    return _immutable(node, safe)


def _flat(node: ast.AST, safe: set[str]) -> bool:
    """A container literal whose direct elements (dict values) are immutable: element reads alias nothing."""
    elts = node.values if isinstance(node, ast.Dict) else getattr(node, "elts", [])
    return all(_immutable(e, safe) for e in elts)


def _function_locals(fn: ast.AST) -> set[str]:
    names: set[str] = set()
    declared_global: set[str] = set()
    for sub in ast.walk(fn):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = sub.args
            names |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
            if not isinstance(sub, ast.Lambda) and sub is not fn:
                names.add(sub.name)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            names.add(sub.id)
        elif isinstance(sub, ast.Global):
            declared_global |= set(sub.names)
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            names.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return names - declared_global


def _allowed_read(node: ast.Name, parent: ast.AST | None, grand: ast.AST | None, flat: bool, is_dict: bool) -> bool:
    """Is this load of a module-level container a read that hands out no reference to mutable data?"""
    if isinstance(parent, ast.Compare) and node in parent.comparators and all(
            isinstance(op, (ast.In, ast.NotIn)) for op in parent.ops):
        return True
    if isinstance(parent, ast.Call) and node in parent.args:
        return (_dotted(parent.func) or "") in _COPYING_READS and (
            flat or _call_name(parent) in ("len", "deepcopy", "any", "all", "hash", "dumps", "repr", "str")
            or (is_dict and _call_name(parent) in ("sorted", "set", "frozenset", "tuple", "list")))
    if isinstance(parent, (ast.For, ast.AsyncFor, ast.comprehension)) and parent.iter is node:
        return flat or is_dict
    if isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load):
        return flat
    if isinstance(parent, ast.Attribute) and parent.value is node and parent.attr in _ELEMENT_READS:
        return (flat or parent.attr == "keys") and isinstance(grand, ast.Call) and grand.func is parent
    return False


def _module_values(tree: ast.Module) -> tuple[set[str], dict[str, tuple[int, bool, bool]], dict[str, int]]:
    """Classify module-level names: (safe, containers name -> (line, flat, is_dict), unsafe name -> line).

    ``safe``: functions, classes, imports and provably immutable values; ``containers``: literals of
    constants (read-only uses allowed); ``unsafe``: everything else (unknown call results, containers
    with unknown leaves, names rebound or mutated at module level).
    """
    safe: set[str] = set()
    containers: dict[str, tuple[int, bool, bool]] = {}
    unsafe: dict[str, int] = {}

    def bind(name: str, value: ast.AST | None, line: int) -> None:
        if name in safe or name in containers or name in unsafe:  # rebound at module level: trust nothing
            safe.discard(name)
            containers.pop(name, None)
            unsafe.setdefault(name, line)
            return
        if name == "server" or _immutable(value, safe):
            safe.add(name)
        elif isinstance(value, (ast.List, ast.Dict, ast.Set, ast.Call)) and _container_of_constants(value, safe):
            containers[name] = (line, _flat(value, safe), isinstance(value, ast.Dict))
        else:
            unsafe[name] = line

    for node in _module_level_statements(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            safe.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            safe |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in _targets(node):
                if isinstance(t, ast.Name):
                    bind(t.id, node.value, node.lineno)
                elif _root_name(t) in containers:  # X[k] = v at import time: contents no longer known
                    unsafe[_root_name(t)] = node.lineno
                    containers.pop(_root_name(t))
        elif isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor, ast.With)):
            for sub in ast.walk(node.target if isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor)) else node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    safe.discard(sub.id)
                    containers.pop(sub.id, None)
                    unsafe.setdefault(sub.id, node.lineno)
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            root = _root_name(call.func.value)
            if root in containers and call.func.attr in _MUTATORS:
                unsafe[root] = node.lineno
                containers.pop(root)
    return safe, containers, unsafe


def _alias_findings(tree: ast.Module, skip: set[str]) -> list[Finding]:
    """``mutable_alias`` and ``mutable_default_argument`` findings (see the module docstring)."""
    safe, containers, unsafe = _module_values(tree)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    out: list[Finding] = []
    seen: set[tuple[str, int]] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = fn.args
        for d in [*a.defaults, *(k for k in a.kw_defaults if k is not None)]:
            if not _immutable(d, safe):
                out.append(Finding(kind="mutable_default_argument", line=d.lineno,
                                   detail=f"default argument {ast.unparse(d)[:60]!r} is not provably immutable: "
                                          f"one object shared by every call of every session"))
        if parents.get(fn) is not None and not isinstance(parents[fn], (ast.Module, ast.ClassDef)):
            continue  # nested functions are walked with their enclosing function
        local = _function_locals(fn)
        body = fn.body if isinstance(fn.body, list) else [fn.body]
        for stmt in body:
            for node in ast.walk(stmt):
                if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or node.id in local:
                    continue
                if node.id in skip or (node.id, node.lineno) in seen:
                    continue
                where = f"in {getattr(fn, 'name', '<lambda>')}()"
                parent = parents.get(node)
                if (isinstance(parent, ast.Call) and parent.args == [node] and not parent.keywords
                        and _dotted(parent.func) in ("deepcopy", "copy.deepcopy")):
                    continue  # an independent copy; every other reference is checked on its own
                if node.id in unsafe:
                    seen.add((node.id, node.lineno))
                    out.append(Finding(kind="mutable_alias", line=node.lineno,
                                       detail=f"{where} reaches module-level {node.id!r} (line {unsafe[node.id]}), "
                                              f"not provably immutable: sessions would share it"))
                elif node.id in containers:
                    line, flat, is_dict = containers[node.id]
                    if not _allowed_read(node, parent, parents.get(parent) if parent else None, flat, is_dict):
                        seen.add((node.id, node.lineno))
                        out.append(Finding(kind="mutable_alias", line=node.lineno,
                                           detail=f"{where} hands out module-level container {node.id!r} (line "
                                                  f"{line}) or a mutable part of it: "
                                                  f"`{ast.unparse(parent or node)[:60]}`; copy it with copy.deepcopy"))
    return out


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

    module_safe = _module_values(tree)[0]
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
            pydantic = any((_dotted(b) or "").endswith("BaseModel") for b in node.bases)
            for item in node.body:
                if pydantic and (isinstance(item, ast.AnnAssign) or any(
                        isinstance(t, ast.Name) and t.id == "model_config" for t in _targets(item))):
                    continue  # pydantic copies field defaults per instance
                for t in _targets(item):
                    if isinstance(t, ast.Name) and not _immutable(getattr(item, "value", None), module_safe):
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
        how = "mutated at run time" if (cls, attr) in mutated_class_attrs else "not provably immutable"
        add(Finding(kind="class_mutable_attribute", line=line,
                    detail=f"class {cls} holds {attr!r} ({how}), one object shared by all instances of all sessions"))
    report.findings.extend(_alias_findings(tree, skip=set(mutated_globals)))

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

"""The package's shape: no import cycles, no import up a layer, no private names across packages.

Every ``import`` in ``python/treadle`` counts, also those inside functions (a lazy import still makes
the lower module depend on the upper one). The layers, bottom up:

- kernels: ``treadle.ops``, ``treadle.reference``, ``treadle.dispatch``, ``treadle._extension`` and
  ``treadle.triton_kernels`` know nothing above them;
- ``treadle.distributed`` (what user code needs with any engine) imports no method package;
- the WEFT runtime and environments know nothing of rollouts, RL or evolution; rollouts know nothing
  of RL or evolution;
- RSI never imports WEFT (the two meanings of "harness" stay apart);
- a module never imports a ``_private`` name or module of another package.
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python"
KERNELS = ("treadle.ops", "treadle.reference", "treadle.dispatch", "treadle._extension", "treadle.triton_kernels")
METHODS = ("treadle.stair", "treadle.scale", "treadle.weft", "treadle.rsi", "treadle.llm", "treadle.models",
           "treadle.cli", "treadle.demo")
WEFT_UPPER = ("treadle.weft.rollouts", "treadle.weft.rl", "treadle.weft.evolve")
WEFT_TOP = ("treadle.weft", "treadle.weft.cli", "treadle.weft.demo", "treadle.weft.runtime.serve")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in (ROOT / "treadle").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports() -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, imported name or "")} for every import statement."""
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found[mod] |= {(a.name, "") for a in node.names if a.name.startswith("treadle")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("treadle"):
                    for a in node.names:
                        sub = f"{target}.{a.name}"
                        found[mod].add((sub, "") if sub in MODULES else (target, a.name))
    return found


IMPORTS = _imports()


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in IMPORTS.get(m, ()) if t in MODULES and t != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components, iterative enough for this size
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package(mod: str) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return mod if MODULES.get(mod, pathlib.Path()).name == "__init__.py" else mod.rsplit(".", 1)[0]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _violations(rule) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in IMPORTS.items() for t, _ in targets if rule(m, t))


def test_kernels_know_nothing_above_them():
    assert _violations(lambda m, t: _under(m, KERNELS) and not _under(t, KERNELS)) == []


def test_distributed_imports_no_method_package():
    assert _violations(lambda m, t: _under(m, ("treadle.distributed",)) and _under(t, METHODS)) == []


def test_weft_runtime_and_envs_know_nothing_of_rollouts_rl_or_evolution():
    def lower(m: str) -> bool:  # the runtime (treadle.weft.runtime and its modules) and treadle.weft.envs
        return _under(m, ("treadle.weft",)) and not _under(m, WEFT_UPPER) and m not in WEFT_TOP

    assert _violations(lambda m, t: lower(m) and _under(t, WEFT_UPPER)) == []


def test_rollouts_know_nothing_of_rl_or_evolution():
    assert _violations(lambda m, t: _under(m, ("treadle.weft.rollouts",))
                       and _under(t, ("treadle.weft.rl", "treadle.weft.evolve"))) == []


def test_rsi_never_imports_weft():
    assert _violations(lambda m, t: _under(m, ("treadle.rsi",)) and _under(t, ("treadle.weft",))) == []


def _private_import(mod: str, target: str, name: str) -> bool:
    """A private name is used only inside its module's package; a private module only under its parent."""
    if name.startswith("_") and not name.startswith("__"):
        return _package(target if target not in MODULES or MODULES[target].name != "__init__.py" else target + ".x") \
            != _package(mod)
    parts = target.split(".")
    for i, part in enumerate(parts[1:], 1):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])
            return not (mod == owner or mod.startswith(owner + "."))
    return False


def test_no_private_names_across_packages():
    bad = sorted(f"{m} -> {t}{'.' + n if n else ''}" for m, targets in IMPORTS.items() for t, n in targets
                 if _private_import(m, t, n))
    assert bad == []


def test_every_module_is_under_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) >= 800}
    assert long == {}


def test_png_figures_never_switch_the_global_matplotlib_backend():
    """One way to draw a PNG: :func:`treadle.figures.png_figure` (matplotlib's object API); a module that
    called ``matplotlib.use`` or imported pyplot would change the backend of the user's own process."""
    bad = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "matplotlib.use":
                bad.append(f"{mod}: matplotlib.use")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{mod}: import {n}" for n in names if n.startswith("matplotlib.pyplot")]
    assert bad == []

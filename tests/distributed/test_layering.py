"""``treadle.distributed`` holds what user code needs on several ranks with any engine; it imports no method
package (STAIR, SCALE, WEFT, RSI), at module level or inside a function, and the ops' DTensor check lives with
the ops."""
import ast
from pathlib import Path

import treadle

METHODS = ("treadle.stair", "treadle.scale", "treadle.weft", "treadle.rsi")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_distributed_imports_no_method_package():
    root = Path(treadle.__file__).parent / "distributed"
    bad = {p.name: sorted(m for m in _imports(p) if m.startswith(METHODS)) for p in root.glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_ops_import_their_dtensor_check_from_ops():
    root = Path(treadle.__file__).parent / "ops"
    users = {p.name for p in root.glob("*.py") if "treadle.distributed.dtensor" in _imports(p)}
    assert not users

"""Registry (content addressing, import failures) and the static side-effect check."""
import textwrap
from pathlib import Path

import pytest

from treadle.weft.runtime.errors import ServerImportError, UnknownServerError
from treadle.weft.runtime.isolation import check_source
from treadle.weft.runtime.registry import Registry

SERVERS = Path(__file__).parent / "servers"


def kinds(src: str) -> set[str]:
    return check_source(textwrap.dedent(src)).kinds()


@pytest.mark.parametrize("src, expected", [
    ("X = (1, 2)\nNAMES = frozenset({'a'})\nLIMITS = {'a': 1}\ndef f():\n    return LIMITS['a']\n", set()),
    ("cache = {}\n", {"module_mutable_state"}),
    ("CACHE = {}\ndef f(k):\n    CACHE[k] = 1\n", {"module_mutable_state"}),
    ("SEEN = []\ndef f(k):\n    SEEN.append(k)\n", {"module_mutable_state"}),
    ("n = 0\ndef f():\n    global n\n    n += 1\n", {"global_write"}),
    ("class A:\n    count = 0\n    def f(self):\n        A.count += 1\n", {"class_attribute_mutation"}),
    ("class A:\n    def f(self):\n        type(self).x = 1\n", {"class_attribute_mutation"}),
    ("class A:\n    @classmethod\n    def f(cls):\n        cls.x = 2\n", {"class_attribute_mutation"}),
    ("class A:\n    ITEMS = []\n    def f(self):\n        self.ITEMS.append(1)\n", {"class_mutable_attribute"}),
    ("class A:\n    items = []\n    def __init__(self):\n        self.items = []\n    def f(self):\n"
     "        self.items.append(1)\n", {"class_mutable_attribute"}),
    ("class A:\n    def __init__(self):\n        self.items = []\n    def f(self):\n        self.items.append(1)\n"
     "        self.name = 'x'.replace('x', 'y')\n", set()),
    ("def f(p):\n    return open(p).read()\n", {"file_access"}),
    ("from pathlib import Path\ndef f(p):\n    Path(p).write_text('x')\n", {"file_access"}),
    ("import os\ndef f(p):\n    os.remove(p)\n", {"file_access"}),
    ("import sqlite3\nCON = sqlite3.connect('db.sqlite')\n", {"file_access"}),
    ("import sqlite3\ndef f():\n    return sqlite3.connect(':memory:')\n", set()),
    ("import requests\n", {"network_access"}),
    ("from urllib.request import urlopen\n", {"network_access"}),
    ("import subprocess\n", {"process_access"}),
    # aliases of module- or class-level mutables, whatever the name's case
    (("class P:\n    DEFAULT_VPN = {'connected': False, 'server': None}\n    def f(p, name):\n"
      "        p.vpn = p.DEFAULT_VPN\n        p.vpn['server'] = name\n"), {"class_mutable_attribute"}),
    ("class A:\n    ITEMS: list = []\n", {"class_mutable_attribute"}),  # ruff RUF012
    ("import threading\nclass A:\n    lock = threading.Lock()\n", {"class_mutable_attribute"}),
    ("DEFAULT = {'a': {'b': 1}}\nclass P:\n    def f(self):\n        self.x = DEFAULT['a']\n", {"mutable_alias"}),
    ("DEFAULT = {'a': 1}\ndef helper(d):\n    d['a'] = 2\ndef f(p):\n    helper(DEFAULT)\n", {"mutable_alias"}),
    ("DEFAULT = {'a': 1}\ndef f(p):\n    p.d = DEFAULT\n", {"mutable_alias"}),
    ("import itertools\nCOUNTER = itertools.count()\ndef f(p):\n    return next(COUNTER)\n", {"mutable_alias"}),
    ("from types import SimpleNamespace\nNS = SimpleNamespace(n=0)\ndef f(p):\n    NS.n += 1\n", {"mutable_alias"}),
    ("L = [[1], [2]]\ndef f(p):\n    for x in L:\n        p.x = x\n", {"mutable_alias"}),
    ("def f(p, tags=[]):\n    tags.append(1)\n", {"mutable_default_argument"}),  # ruff B006
    ("D = {'a': 1}\ndef f(p, opts=D):\n    return opts\n", {"mutable_default_argument"}),
    (("from copy import deepcopy\nD = {'a': [1], 'b': set()}\ndef f(p):\n    p.x = deepcopy(D)\n"
      "    return 'a' in D and len(D)\n"), set()),
    ("D = {'a': 1}\ndef f(p, k, n: int = 3, t=('x', 1)):\n    return D.get(k), D[k], [v for v in D.values()]\n",
     set()),
])
def test_side_effect_check(src, expected):
    assert kinds(src) == expected


def test_side_effect_findings_name_the_line():
    src = "x = 1\nD = {'a': [1]}\n\ndef f(p):\n    p.x = D['a']\n"
    (f,) = check_source(src).findings
    assert (f.kind, f.line) == ("mutable_alias", 5) and "'D' (line 2)" in f.detail


def test_side_effect_check_bad_input():
    assert check_source("def (:\n").kinds() == {"syntax_error"}
    with pytest.raises(TypeError, match="source must be a str"):
        check_source(b"x = 1")


def test_register_content_addressed():
    reg = Registry()
    h1 = reg.register(SERVERS / "notes.py")
    assert reg.register((SERVERS / "notes.py").read_text()) == h1  # same code, same hash
    assert len(reg) == 1 and len(h1) == 64
    spec = reg.spec(h1)
    assert spec.name == "notes" and spec.isolation == "shared" and spec.backend == "sqlite"
    assert spec.tool_names == ["add_note", "add_then_exit", "add_then_fail", "explode", "list_notes", "slow",
                              "slow_sync"]
    assert spec.tool("add_note")["contract"]["writes"] == ["notes"]
    assert spec.tool("add_note")["input_schema"]["required"] == ["text"]
    assert reg.spec(h1[:10]) is spec
    changed = (SERVERS / "notes.py").read_text().replace('"""Add a note."""', '"""Add one note."""')
    assert reg.register(changed) != h1
    h3 = reg.register(SERVERS / "ledger_classattr.py")
    assert reg.spec(h3).isolation == "isolated"
    assert reg.spec(h3).report.kinds() == {"class_mutable_attribute", "class_attribute_mutation"}


def test_register_bad_input():
    reg = Registry()
    with pytest.raises(ServerImportError, match="missing dependency on purpose"):
        reg.register(SERVERS / "broken_import.py")
    with pytest.raises(ServerImportError, match="must define `server = WeftServer"):
        reg.register("x = 1\n")
    with pytest.raises(ServerImportError, match="cannot read server file"):
        reg.register(SERVERS / "does_not_exist.py")
    with pytest.raises(ServerImportError, match="SyntaxError"):
        reg.register("def (:\n")
    with pytest.raises(TypeError, match="server must be"):
        reg.register(42)
    with pytest.raises(UnknownServerError):
        reg.spec("0" * 64)
    assert len(reg) == 0
    h = reg.register(SERVERS / "notes.py", isolation="isolated")
    with pytest.raises(ValueError, match="cannot re-register"):
        reg.register(SERVERS / "notes.py", isolation="shared")
    assert reg.spec(h).isolation == "isolated"


def test_load_gives_independent_modules():
    reg = Registry()
    h = reg.register(SERVERS / "ledger_classattr.py")
    (m1, s1), (m2, s2) = reg.load(h), reg.load(h)
    assert m1 is not m2 and m1.Ledger is not m2.Ledger
    m1.Ledger.total = 5
    assert m2.Ledger.total == 0


def test_imported_module_attribute_write_is_a_global_write():
    src = "import mpmath\ndef f(p):\n    mpmath.mp.dps = p\n    return mpmath.pi\n"
    rep = check_source(src)
    assert rep.kinds() == {"global_write"} and "imported module 'mpmath'" in rep.findings[0].detail
    assert kinds("import math\ndef f(x):\n    y = math.sqrt(x)\n    return y\n") == set()

"""``treadle.weft.runtime.static_check.read_server`` (no import) agrees with the imported registration."""
import re
from pathlib import Path

import pytest

from treadle.weft.runtime.registry import Registry
from treadle.weft.runtime.static_check import read_server

SERVERS = sorted((Path(__file__).parent / "servers").glob("*.py"))
ENVS = [p for p in sorted((Path(__file__).parents[2] / "python" / "treadle" / "weft" / "envs").glob("*.py"))
        if re.search(r"^server = WeftServer\(", p.read_text(), re.M)]


@pytest.mark.parametrize("path", [p for p in SERVERS + ENVS if p.name != "broken_import.py"], ids=lambda p: p.name)
def test_static_reading_matches_import(path):
    static = read_server(path.read_text(), str(path))
    reg = Registry()
    spec = reg.spec(reg.register(path))
    assert (static.name, static.backend, static.isolation) == (spec.name, spec.backend, spec.isolation)
    assert static.report == spec.report
    imported = {t["name"]: t for t in spec.tools}
    assert sorted(t.name for t in static.tools) == sorted(imported)
    for t in static.tools:
        c = imported[t.name]["contract"]
        if t.reads != "?":
            assert sorted(t.reads) == sorted(c["reads"]), t.name
        if t.writes != "?":
            assert sorted(t.writes) == sorted(c["writes"]), t.name
        if t.returns != "?":
            assert t.returns == c["returns"], t.name
        assert set(t.arguments) >= set(imported[t.name]["input_schema"].get("properties", {})), t.name

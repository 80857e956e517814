"""`treadle weft synth` against recorded role answers, through the real (sandboxed) validation path."""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.weft.evolve.synth_validate import Design, Stage, validate

pytestmark = pytest.mark.usefixtures("sandbox")


def test_recorded_run_localises_and_repairs_the_broken_backend(S, recorded_synthesis):
    res = recorded_synthesis
    assert res.accepted and len(res.rounds) == 2
    first = res.rounds[0]
    assert first.revised == Stage.backend and {f.stage for f in first.failures} == {Stage.backend}
    assert any("SELECT status FROM books WHERE id = 1 gave [['in']]" in f.detail for f in first.failures)
    assert res.rounds[1].failures == []
    # only the blamed component was revised; the malformed checker answer was recorded and re-asked
    assert res.revisions == {"design": 1, "schema": 1, "backend": 2, "checks": 1}
    assert res.design.model_dump() == Design.model_validate(S.DESIGN).model_dump()
    assert res.schema_.model_dump() == S.SCHEMA and res.backend.source == S.FIXED
    assert [f.stage for f in res.role_failures] == [Stage.checks] and "not the JSON" in res.role_failures[0].detail


def test_validation_localises_each_stage(S):
    bad_schema = dict(S.SCHEMA, seed="INSERT INTO nowhere VALUES (1);")
    [f] = validate(*S.artefacts(schema=bad_schema))[0]
    assert f.stage == Stage.schema and "nowhere" in f.detail
    design = json.loads(json.dumps(S.DESIGN))
    design["tools"][0]["writes"] = []  # add_book writes books without declaring it
    fails = validate(*S.artefacts(design=design))[0]
    assert [f.stage for f in fails] == [Stage.contract] and "add_book changed ['books']" in fails[0].detail
    fails = validate(*S.artefacts(backend="def add_book(db, title, author:\n"))[0]
    assert [f.stage for f in fails] == [Stage.backend] and "does not import" in fails[0].detail
    assert validate(*S.artefacts())[0] == []


def test_generated_code_is_contained(S, tmp_path):
    from treadle.sandbox import SandboxLimits

    loops = S.FIXED.replace('def list_books(db):\n', 'def list_books(db):\n    while True:\n        pass\n')
    fails, facts = validate(*S.artefacts(backend=loops), limits=SandboxLimits(timeout_s=3, memory_mb=512))
    assert facts["termination"] in ("timeout", "cpu_limit")
    assert [(f.stage, f.check) for f in fails] == [(Stage.backend, 5)] and "did not return" in fails[0].detail
    target = tmp_path / "escaped.txt"
    net = S.FIXED + f'''
def list_books(db):
    import socket
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1)
        reached = "yes"
    except OSError as e:
        reached = "no: " + type(e).__name__
    try:
        open({str(target)!r}, "w").write("x")
        wrote = "yes"
    except OSError as e:
        wrote = "no: " + type(e).__name__
    return [{{"id": 2, "status": "in", "net": reached, "write": wrote}}]
'''
    checks = json.loads(json.dumps(S.CHECKS))
    checks["checks"][5]["expect_returns"] = [{"net": "yes"}]
    fails, _ = validate(*S.artefacts(backend=net, checks=checks))
    assert len(fails) == 1 and "'net': 'no: " in fails[0].detail and "'write': 'no: " in fails[0].detail
    assert not target.exists()


def test_cli_without_an_endpoint_says_so_and_exits_2(S, tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text(S.DOCS)
    r = CliRunner().invoke(app, ["weft", "synth", "--docs", str(docs), "--requirement", "x", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--llm-config" in r.output and "endpoint" in r.output
    bad = tmp_path / "api.json"
    bad.write_text("{not json")
    r = CliRunner().invoke(app, ["weft", "synth", "--docs", str(bad), "--requirement", "x", "--llm-config", str(docs)])
    assert r.exit_code == 2 and "--docs" in r.output
    assert not (tmp_path / "o").exists()

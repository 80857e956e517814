"""The `treadle` command: version, backends, demo section, bench argument errors."""
import json

from typer.testing import CliRunner

from treadle import __version__
from treadle.cli import app

runner = CliRunner()


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output


def test_backends_json_lists_every_op_for_both_devices():
    res = runner.invoke(app, ["backends", "--json"])
    assert res.exit_code == 0, res.output
    table = json.loads(res.output)
    assert "grpo_advantages" in table
    for devs in table.values():
        assert set(devs) == {"cpu", "cuda"}
        assert all(d["backend"] in ("reference", "cpp", "cuda", "triton") and d["reason"] for d in devs.values())


def test_demo_grpo_op_section(tmp_path):
    res = runner.invoke(app, ["demo", "--sections", "grpo-op", "--quick", "--run-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "max |A - reference|" in res.output
    rows = json.loads((tmp_path / "grpo-op" / "advantages.json").read_text())
    assert {r["backend"] for r in rows} >= {"reference", "cpp"}
    assert all(r["max_err"] < 1e-6 for r in rows)


def test_demo_unknown_section_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["demo", "--sections", "nope", "--run-dir", str(tmp_path)])
    assert res.exit_code != 0
    assert res.exit_code == 2 and "unknown demo section" in res.output


def test_bench_unknown_suite():
    res = runner.invoke(app, ["bench", "--ops", "nope"])
    assert res.exit_code != 0
    assert "no such benchmark suite" in res.output

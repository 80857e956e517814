"""`treadle weft ...` and the weft-shop demo section."""
import json
from pathlib import Path

from typer.testing import CliRunner

from treadle.cli import app

SERVERS = Path(__file__).parent / "servers"
runner = CliRunner()


def test_weft_check(tmp_path):
    res = runner.invoke(app, ["weft", "check", str(SERVERS / "ledger_classattr.py")])
    assert res.exit_code == 0, res.output
    assert "isolation: isolated" in res.output and "class_attribute_mutation" in res.output
    res = runner.invoke(app, ["weft", "check", str(SERVERS / "notes.py"), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["isolation"] == "shared"
    res = runner.invoke(app, ["weft", "check", str(SERVERS / "broken_import.py")])
    assert res.exit_code == 2 and "failed to import" in res.output


def test_weft_shop_and_demo_section(tmp_path):
    res = runner.invoke(app, ["weft", "shop", "--run-dir", str(tmp_path / "gold")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "gold" / "checkpoints.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["r"] == 1 for r in rows)
    stats = [json.loads(x) for x in (tmp_path / "gold" / "tool_stats.jsonl").read_text().splitlines()]
    assert {s["tool"] for s in stats} >= {"place_order", "close_ticket"} and all(s["errors"] == {} for s in stats)
    res = runner.invoke(app, ["demo", "--sections", "weft-shop", "--quick", "--run-dir", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    skipped = [json.loads(x) for x in (tmp_path / "demo" / "weft-shop" / "skip" / "checkpoints.jsonl").read_text()
               .splitlines()]
    assert [r["r"] for r in skipped] == [1, 0, 1, 1, 1, 1]

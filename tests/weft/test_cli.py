"""`treadle weft ...` and the weft-shop demo section."""
import json
from pathlib import Path

from typer.testing import CliRunner

from treadle.cli import app
from treadle.testing import assert_usage_error

SERVERS = Path(__file__).parent / "servers"
runner = CliRunner()


def test_weft_check(tmp_path):
    res = runner.invoke(app, ["weft", "check", str(SERVERS / "ledger_classattr.py")])
    assert res.exit_code == 0, res.output
    assert "isolation: isolated" in res.output and "class_attribute_mutation" in res.output
    res = runner.invoke(app, ["weft", "check", str(SERVERS / "notes.py"), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["isolation"] == "shared"
    res = runner.invoke(app, ["weft", "check", str(SERVERS / "broken_import.py"), "--import"])
    assert res.exit_code == 2 and "failed to import" in res.output
    res = runner.invoke(app, ["weft", "check", str(SERVERS / "broken_import.py")])  # not run: nothing fails
    assert res.exit_code == 0 and "the file was not run" in res.output, res.output


def test_weft_check_does_not_run_the_file(tmp_path):
    marker = tmp_path / "ran"
    server = tmp_path / "sneaky.py"
    server.write_text(f"""from pathlib import Path
from treadle.weft.runtime.server import WeftServer
Path({str(marker)!r}).write_text("user code ran")
server = WeftServer("sneaky", backend="sqlite", schema="CREATE TABLE t (a);")


@server.tool(writes=("t",), returns="nothing")
def put(db, a: int) -> None:
    db.execute("INSERT INTO t VALUES (?)", (a,))
""")
    res = runner.invoke(app, ["weft", "check", str(server), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert not marker.exists() and got["executed"] is False
    assert (got["name"], got["backend"], [t["name"] for t in got["tools"]]) == ("sneaky", "sqlite", ["put"])
    assert (got["tools"][0]["writes"], got["tools"][0]["arguments"]) == (["t"], ["a"])
    res = runner.invoke(app, ["weft", "check", str(server), "--import"])  # said plainly: --import runs it
    assert res.exit_code == 0 and marker.read_text() == "user code ran" and "its code ran" in res.output


def test_weft_check_bad_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    assert_usage_error(runner.invoke(app, ["weft", "check", str(bad)]), "does not parse")
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    assert_usage_error(runner.invoke(app, ["weft", "check", str(none)]), "WeftServer")
    assert_usage_error(runner.invoke(app, ["weft", "check", str(tmp_path / "missing.py")]), "cannot read")


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


def test_weft_shop_skip_options_are_never_ignored(tmp_path):
    out = ["--out", str(tmp_path / "s")]
    assert_usage_error(runner.invoke(app, ["weft", "shop", "--skip-task", "nope", "--skip-turn", "0", *out]),
                    "--skip-task", "no shop task 'nope'", "ada-replacement")
    assert_usage_error(runner.invoke(app, ["weft", "shop", "--skip-task", "ada-replacement", *out]),
                    "--skip-task", "needs --skip-turn")
    assert_usage_error(runner.invoke(app, ["weft", "shop", "--skip-turn", "1", *out]), "--skip-turn", "needs --skip-task")
    assert_usage_error(runner.invoke(app, ["weft", "shop", "--skip-task", "ada-replacement", "--skip-turn", "99", *out]),
                    "--skip-turn", "turns 0...")
    assert_usage_error(runner.invoke(app, ["weft", "shop", "--skip-turn", "-1", *out]), "--skip-turn")
    assert not (tmp_path / "s").exists()
    # the valid boundary: turn 0 of a task loses its first gold call, so its first checkpoint fails
    res = runner.invoke(app, ["weft", "shop", "--skip-task", "ada-replacement", "--skip-turn", "0", *out])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "s" / "checkpoints.jsonl").read_text().splitlines()]
    assert [r["r"] for r in rows if r["task"] == "ada-replacement"][0] == 0
    assert sum(r["r"] == 0 for r in rows) >= 1
    # same folder, other settings: refused; --overwrite replaces
    assert_usage_error(runner.invoke(app, ["weft", "shop", *out]), "--out", "another config", "--overwrite")
    res = runner.invoke(app, ["weft", "shop", "--overwrite", *out])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "s" / "checkpoints.jsonl").read_text().splitlines()]
    assert all(r["r"] == 1 for r in rows)
    record = json.loads((tmp_path / "s" / "run.json").read_text())
    assert record["status"] == "finished" and record["config"] == {"skip": None}

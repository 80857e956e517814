"""`treadle bench`'s report (treadle.bench_report): from the suites' last_<suite>.json it writes a
Markdown table, JSON and a PNG bar chart with each op vs each named peer as ratios, and the machine."""
import json

from treadle.bench_report import main, write_report

MACHINE = {"cpu": "Test CPU", "cores": 2, "torch_threads": 1, "python": "3.11", "torch": "2.x", "triton": "3.x",
           "gpu": None, "date": "2026-11-30 12:00:00 UTC", "commit": "abc1234",
           "backends": {"grpo_advantages": {"cpu": "cpp", "cuda": "cuda"}}}


def _fake_results(tmp_path):
    payload = {"suite": "grpo", "machine": "Test CPU", "date": "2026-11-30",
               "cases": {"N=65536 g16": {"treadle_cpp": {"seconds": 0.0002, "limit_ms": 0.01},
                                         "trl_view": {"seconds": 0.0006},
                                         "torch_scatter": {"seconds": 0.0001}},
                         "mem case": {"treadle_x": {"seconds": 1.0, "peak_MiB": "33"}}}}
    (tmp_path / "last_grpo.json").write_text(json.dumps(payload))


def test_report_has_ratios_machine_and_chart(tmp_path):
    _fake_results(tmp_path)
    md, js, png = write_report(tmp_path, machine=MACHINE)
    text = md.read_text()
    assert "Test CPU" in text and "grpo_advantages: cpp / cuda" in text and "abc1234" in text
    assert "| N=65536 g16 | treadle_cpp | trl_view | 0.2 ms | 0.6 ms | 3.00x |" in text
    assert "| N=65536 g16 | treadle_cpp | torch_scatter | 0.2 ms | 0.1 ms | 0.50x |" in text  # a peer that wins shows < 1
    assert "peak_MiB=33" in text  # a one-sided (memory) case stays visible
    rows = json.loads(js.read_text())["rows"]
    ratios = {(r["treadle"], r["peer"]): r["ratio"] for r in rows if r["ratio"]}
    assert abs(ratios[("treadle_cpp", "trl_view")] - 3.0) < 1e-9 and abs(ratios[("treadle_cpp", "torch_scatter")] - 0.5) < 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_module_main_needs_a_results_folder(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "usage" in capsys.readouterr().err


def test_no_report_when_pytest_did_not_run_the_benchmarks(tmp_path):
    """``treadle bench ... -- <bad pytest arg>``: pytest exits 4 and ran nothing; the report used to be written
    anyway (from whatever last_*.json the folder held). Now: no report, a created folder removed, one error
    line naming the pytest arguments, exit 2; an existing folder's earlier report is left as it was."""
    import subprocess
    import sys

    fresh = tmp_path / "fresh"
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "report.md").write_text("earlier report")
    for out, extra, code in ((fresh, ["--no-such-pytest-flag"], 4), (kept, ["--no-such-pytest-flag"], 4),
                             (kept, ["-k", "no_benchmark_matches_this"], 5)):
        res = subprocess.run([sys.executable, "-m", "treadle", "bench", "--ops", "grpo", "--out", str(out), "--no-compare",
                              "--", *extra], capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, (extra, res.stdout, res.stderr)
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("Error: EXTRA") and extra[0] in last and f"pytest exited {code}" in last, res.stderr
        assert "report:" not in res.stdout
    assert not fresh.exists()
    assert sorted(p.name for p in kept.iterdir()) == ["report.md"] and (kept / "report.md").read_text() == "earlier report"

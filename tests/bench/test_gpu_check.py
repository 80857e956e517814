"""The device script's dry run (``bash bench/gpu_check.sh --dry-run``) works on this CPU: every import,
the cuda tests collected, and bench/gpu_figures.py end to end on tiny shapes under the Triton
interpreter, writing figures.json with the figures' sections (the sm_90a AOT check it also runs has
its own test, tests/bench/test_gpu_aot.py, so it is left out here)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_the_report(tmp_path):
    env = dict(os.environ, TREADLE_REPORT_DIR=str(tmp_path), PYTHON=sys.executable, GPU_CHECK_DRY_AOT="0")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:] + (tmp_path / "summary.txt").read_text()
    figures = json.loads((tmp_path / "figures.json").read_text())
    for section in ("ceilings", "grpo", "scale", "topk_entropy", "stair"):
        assert section in figures and "error" not in figures[section], section
    assert "time_ratio_ours_over_full" in figures["topk_entropy"]
    assert "treadle_added_over_base" in figures["scale"]["fwd"]
    assert "dry run ok" in (tmp_path / "summary.txt").read_text()

"""GPU check of treadle.ops.stair_readout (issue 4): CUDA tests, then the GPU benchmark, one report.

    python bench/gpu_stair.py [REPORT_DIR]          (or call run(report_dir) from bench/gpu_check.sh)

Runs, with ``TRITON_INTERPRET=0`` forced (tests/conftest.py defaults it to 1, which would send CUDA
tensors through the Triton interpreter):
  1. ``pytest -m cuda tests/stair``: Triton on CUDA vs the float64 reference, fp32/bf16/fp16, outputs
     and both gradients, plus the two-SDPA identity through the default dispatch;
  2. ``TREADLE_BENCH_DEVICE=cuda pytest bench/bench_stair.py -k cuda``: bf16 B=1 Hq=32 Hkv=8 D=128
     T=4096, M=32768 and M=2048, forward and forward+backward, vs two SDPA (and flash-attn) calls,
     with TFLOP/s against the H200's dense bf16 peak (autotuning happens in the warm-up rounds).
Writes ``tests_stair.log``, ``bench_stair.log``, ``bench_stair.json`` and ``ratios_stair.json`` into
the report folder and prints one summary line per step. Budget: about 4 minutes on one H200.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _step(cmd: list[str], log: Path, env: dict, timeout: int) -> tuple[bool, str]:
    t0 = time.time()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return rc == 0, f"rc={rc} {time.time() - t0:.0f}s: {tail[0]}"


def run(report_dir: str | os.PathLike | None = None) -> int:
    report = Path(report_dir or ROOT / "bench" / "results" / f"gpu-stair-{time.strftime('%Y%m%d-%H%M%S')}")
    report.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    py = sys.executable
    steps = [
        ("stair tests", [py, "-m", "pytest", "-q", "-m", "cuda", "tests/stair", "-p", "no:cacheprovider", "-o", "addopts="],
         report / "tests_stair.log", env, 150),
        ("stair bench", [py, "-m", "pytest", "-q", "bench/bench_stair.py", "-k", "cuda", "--benchmark-enable",
                         "-p", "no:cacheprovider", "-o", "addopts=", f"--benchmark-json={report / 'bench_stair.json'}"],
         report / "bench_stair.log", {**env, "TREADLE_BENCH_DEVICE": "cuda"}, 240),
    ]
    ok, lines = True, []
    for name, cmd, log, step_env, timeout in steps:
        good, text = _step(cmd, log, step_env, timeout)
        ok &= good
        lines.append(f"{name}: {text}")
        print(lines[-1], flush=True)
    ratios = ROOT / "bench" / "results" / "last_stair.json"
    if ratios.exists():
        shutil.copy(ratios, report / "ratios_stair.json")
    (report / "summary_stair.txt").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(run(sys.argv[1] if len(sys.argv) > 1 else None))

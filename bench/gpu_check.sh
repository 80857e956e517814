#!/usr/bin/env bash
# One prepared GPU check: build the CUDA extension, run every op's CUDA tests and GPU benchmarks, and
# write a dated report in the format of `treadle bench` (report.md, report.json, ratios.png from the
# suites' last_<suite>.json; see treadle/bench_report.py), plus the logs. Meant for a lent GPU machine
# (budget: under 8 minutes on one H200). Keep the last GPU report folder in bench/results/.
#
#   TREADLE_REPORT_DIR=/some/folder bash bench/gpu_check.sh
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh     (no GPU: skips nvidia-smi, the CUDA build and tests;
#                                                    runs the report step on the suites' CPU smoke cases)
#
# Needs torch (CUDA build), triton, nvcc, pytest, pytest-benchmark, hypothesis importable; the GPU
# machine has no network, so carry wheels for anything missing (see README, "GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${GPU_CHECK_DRY_RUN:-0}
report=${TREADLE_REPORT_DIR:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$report"
PY=${PYTHON:-python3}
export TRITON_INTERPRET=0   # tests/conftest.py defaults it to 1 for CPU runs; on the GPU, compile for real
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$report/summary.txt"; }

if [ "$dry" = 1 ]; then
  log "DRY RUN: no GPU steps; the report step runs on CPU smoke cases"
  "$PY" -c "import torch; print('torch', torch.__version__)" >"$report/machine.txt" 2>&1
  TREADLE_BENCH_RESULTS_DIR="$report" timeout 300 "$PY" -m pytest -q bench/bench_grpo.py -k "4096 and g16 and (treadle_cpp or torch_scatter) and not cuda" \
    --benchmark-enable --benchmark-max-time=0.05 -p no:cacheprovider -o addopts="" >"$report/bench_grpo.log" 2>&1
  log "bench grpo (CPU smoke): $(tail -1 "$report/bench_grpo.log")"
  "$PY" -m treadle.bench_report "$report" | tee -a "$report/summary.txt"
  exit 0
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
} >"$report/machine.txt" 2>&1
log "machine: $(tr '\n' ' ' <"$report/machine.txt")"

log "build (TREADLE_CUDA=1, sm_90)"
if ! TREADLE_CUDA=1 TREADLE_CUDA_ARCHS=90 MAX_JOBS=${MAX_JOBS:-16} timeout 300 "$PY" -m pip install -q --no-deps \
    --no-build-isolation -e . >"$report/build.log" 2>&1; then
  log "build FAILED (tail of build.log follows)"; tail -30 "$report/build.log" | tee -a "$report/summary.txt"; exit 1
fi
"$PY" -c "import treadle, json; print(json.dumps(treadle.backends(), indent=1))" >"$report/backends.json" 2>&1
log "backends: $(tr -d '\n ' <"$report/backends.json" | head -c 600)"

log "CUDA tests"
timeout 180 "$PY" -m pytest -q -m cuda tests -p no:cacheprovider -o addopts="" >"$report/tests.log" 2>&1
log "tests: $(tail -1 "$report/tests.log")"

for suite in grpo stair scale; do
  [ -f "bench/bench_$suite.py" ] || continue
  log "bench $suite (GPU cases)"
  TREADLE_BENCH_DEVICE=cuda TREADLE_BENCH_RESULTS_DIR="$report" timeout 200 "$PY" -m pytest -q "bench/bench_$suite.py" \
    -k cuda --benchmark-enable -p no:cacheprovider -o addopts="" --benchmark-json="$report/bench_$suite.json" \
    >"$report/bench_$suite.log" 2>&1
  log "bench $suite: $(tail -1 "$report/bench_$suite.log")"
done
"$PY" -m treadle.bench_report "$report" | tee -a "$report/summary.txt"
log "done; report in $report (report.md, report.json, ratios.png)"

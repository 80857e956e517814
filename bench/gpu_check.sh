#!/usr/bin/env bash
# One prepared GPU check: build the CUDA extension, run every op's CUDA tests and GPU benchmarks, and
# write a dated report. Meant for a lent GPU machine (budget: under 8 minutes on one H200).
#
#   TREADLE_REPORT_DIR=/some/folder bash bench/gpu_check.sh
#
# Needs torch (CUDA build), triton, nvcc, pytest, pytest-benchmark, hypothesis importable; the GPU
# machine has no network, so carry wheels for anything missing (see README, "GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
report=${TREADLE_REPORT_DIR:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$report"
PY=${PYTHON:-python3}
export TRITON_INTERPRET=0   # tests/conftest.py defaults it to 1 for CPU runs; on the GPU, compile for real
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$report/summary.txt"; }

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
  TREADLE_BENCH_DEVICE=cuda timeout 200 "$PY" -m pytest -q "bench/bench_$suite.py" -k cuda --benchmark-enable \
    -p no:cacheprovider -o addopts="" --benchmark-json="$report/bench_$suite.json" >"$report/bench_$suite.log" 2>&1
  log "bench $suite: $(tail -1 "$report/bench_$suite.log")"
  [ -f "bench/results/last_$suite.json" ] && cp "bench/results/last_$suite.json" "$report/ratios_$suite.json"
done
log "done; report in $report"

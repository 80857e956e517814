#!/usr/bin/env bash
# One prepared GPU check (issue 19): build the CUDA extension, run every `cuda`-marked test, the issue's
# GPU figures (bench/gpu_figures.py: STAIR, SCALE, GRPO, top-k entropy vs their peers, with the Triton
# autotune choices) and the GPU cases of the benchmark suites, and write one dated report folder in the
# format of `treadle bench` (report.md, report.json, ratios.png from the suites' last_<suite>.json; see
# treadle/bench_report.py) plus gpu_figures.json and the logs. Budget: under 8 minutes on one H200; each
# stage has its own time limit so that one hang cannot eat the run.
#
#   TREADLE_REPORT_DIR=/some/folder bash bench/gpu_check.sh
#   GPU_CHECK_PARTS="tests figures suites" bash bench/gpu_check.sh   (a subset; default: all three)
#   GPU_CHECK_SUITES="grpo" GPU_FIGURES_SECTIONS="ceilings grpo" ...  (subsets of the suites / figures)
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh   (no GPU: skips nvidia-smi, the CUDA build and every GPU
#                                                  step; collects the cuda tests, byte-compiles the figures
#                                                  script and runs the report step on CPU smoke cases)
#
# Needs torch (CUDA build), triton, nvcc, cmake, ninja, pytest, pytest-benchmark, hypothesis and peft
# importable (the H200 image has them). The GPU machine has no network: verl's vectorized-estimator peer
# needs verl's `verl/utils/groupwise.py` under $VERL_SRC (default .gpu_carry; see README, "GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${GPU_CHECK_DRY_RUN:-0}
parts=${GPU_CHECK_PARTS:-tests figures suites}
report=${TREADLE_REPORT_DIR:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$report"
PY=${PYTHON:-python3}
export VERL_SRC=${VERL_SRC:-$PWD/.gpu_carry}
export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0   # tests/conftest.py defaults it to 1 for CPU runs; on the GPU, compile for real
start=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - start ))s] $*" | tee -a "$report/summary.txt"; }
has() { [[ " $parts " == *" $1 "* ]]; }
# the cuda-marked tests live in these files (collecting only them keeps optional dependencies of other
# test folders out of the GPU image's way)
CUDA_TEST_FILES="tests/contracts/test_cuda_rule.py tests/stair/test_stair_readout.py tests/scale/test_gated_lora.py
  tests/scale/test_topk_entropy.py tests/grpo/test_advantages.py tests/contracts/test_autocast.py"
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfE --tb=short)

if [ "$dry" = 1 ]; then
  log "DRY RUN: no GPU steps"
  "$PY" -c "import torch; print('torch', torch.__version__)" >"$report/machine.txt" 2>&1
  "$PY" -m py_compile bench/gpu_figures.py && log "gpu_figures.py compiles"
  # shellcheck disable=SC2086
  "${PYTEST[@]}" --collect-only -m cuda $CUDA_TEST_FILES >"$report/collect.log" 2>&1
  log "cuda tests collected: $(tail -1 "$report/collect.log")"
  TREADLE_BENCH_RESULTS_DIR="$report" timeout 300 "${PYTEST[@]}" bench/bench_grpo.py \
    -k "4096 and g16 and (treadle_cpp or torch_scatter) and not cuda" --benchmark-enable --benchmark-max-time=0.05 \
    >"$report/bench_grpo.log" 2>&1
  log "bench grpo (CPU smoke): $(tail -1 "$report/bench_grpo.log")"
  "$PY" -m treadle.bench_report "$report" | tee -a "$report/summary.txt"
  exit 0
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
  date -u
} >"$report/machine.txt" 2>&1
log "machine: $(tr '\n' ' ' <"$report/machine.txt")"

# 1. the pure-Python package (editable, seconds), then the extension with CUDA in the background: the
#    Triton tests need no compiled extension and run on the GPU while the CPU compiles.
TREADLE_SKIP_EXTENSION=1 timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$report/install.log" 2>&1 \
  || { log "editable install FAILED"; tail -20 "$report/install.log" | tee -a "$report/summary.txt"; exit 1; }
log "installed (pure Python); building treadle._C with CUDA (sm_90) in the background"
( TREADLE_CUDA=1 TREADLE_CUDA_ARCHS=90 MAX_JOBS=${MAX_JOBS:-16} timeout 360 "$PY" setup.py -q build_ext --inplace \
    >"$report/build.log" 2>&1; echo $? >"$report/build.rc" ) &
build_pid=$!

if has tests; then
  log "CUDA tests, Triton kernels (during the build)"
  # shellcheck disable=SC2086
  # one fixed Triton config (TREADLE_TRITON_AUTOTUNE=0) and 12 workers: autotuning every config of every
  # test shape compiles for minutes (seen on the first H200 run); the figures below autotune for real
  TREADLE_TRITON_AUTOTUNE=0 timeout 200 "${PYTEST[@]}" -n 12 -m cuda $CUDA_TEST_FILES -k "not grpo and not backends_agree" \
    >"$report/tests_triton.log" 2>&1
  log "tests (Triton): $(tail -1 "$report/tests_triton.log")"
fi
wait $build_pid
if [ "$(cat "$report/build.rc" 2>/dev/null)" != 0 ]; then
  log "build FAILED (rc $(cat "$report/build.rc" 2>/dev/null)); tail of build.log:"; tail -25 "$report/build.log" | tee -a "$report/summary.txt"
else
  log "build done"
fi
"$PY" -c "import treadle, json; print(json.dumps(treadle.backends(), indent=1))" >"$report/backends.json" 2>&1
log "backends: $(tr -d '\n ' <"$report/backends.json" | head -c 700)"

if has tests; then
  log "CUDA tests, GRPO (CUDA and Triton kernels) and the dispatch"
  # shellcheck disable=SC2086
  timeout 120 "${PYTEST[@]}" -m cuda $CUDA_TEST_FILES -k "grpo or backends_agree" >"$report/tests_grpo.log" 2>&1
  log "tests (GRPO): $(tail -1 "$report/tests_grpo.log")"
fi

if has figures; then
  log "GPU figures (bench/gpu_figures.py)"
  timeout 240 "$PY" bench/gpu_figures.py "$report/gpu_figures.json" >"$report/gpu_figures.log" 2>&1
  log "figures rc $?: $(grep -c '"error"' "$report/gpu_figures.json" 2>/dev/null) sections with errors"
fi

if has suites; then
  for suite in ${GPU_CHECK_SUITES:-grpo stair scale}; do
    log "bench $suite (GPU cases)"
    TREADLE_BENCH_DEVICE=cuda TREADLE_BENCH_RESULTS_DIR="$report" timeout 90 "${PYTEST[@]}" "bench/bench_$suite.py" \
      -k cuda --benchmark-enable --benchmark-max-time=0.25 --benchmark-min-rounds=3 \
      --benchmark-json="$report/bench_$suite.json" >"$report/bench_$suite.log" 2>&1
    log "bench $suite: $(tail -1 "$report/bench_$suite.log")"
  done
  "$PY" -m treadle.bench_report "$report" >>"$report/summary.txt" 2>&1
fi
log "done; report in $report"

#!/usr/bin/env bash
# One prepared GPU check that fits a short GPU window (under 5 minutes on one H200): the CUDA-marked
# tests (the kernel contracts and the ops' CUDA tests, Triton kernels at their pinned configs), then the
# GPU figures (bench/gpu_figures.py: STAIR, SCALE, GRPO, top-k entropy against their peers, each op
# through its public function), then the config sweep (bench/gpu_sweep.py: the AOT-clean alternatives
# of each pinned config, timed, to choose which to pin), written to one report folder bench/results/gpu-<date>/ (figures.json,
# sweep.json, machine.txt, summary.txt, the logs: 8 files). No autotuning on the device (TREADLE_TRITON_AUTOTUNE=0: each op
# launches the configs bench/gpu_aot.py checked on the CPU) and no CUDA extension build (nvcc takes
# minutes; the Triton kernels are what is timed; the `cuda` GRPO backend is recorded as unavailable).
#
#   bash bench/gpu_check.sh                    (on the GPU machine)
#   bash bench/gpu_check.sh --dry-run          (on a CPU, a minute or two: every import, the sm_90a AOT
#                                               check of every pinned config, the cuda tests collected,
#                                               the figures script end to end on tiny shapes under the
#                                               Triton interpreter; writes the same report folder)
#   TREADLE_REPORT_DIR=DIR GPU_CHECK_PARTS="tests figures" GPU_FIGURES_SECTIONS="ceilings grpo" ...
#   GPU_TEST_FILES="tests/stair/test_stair_readout.py" GPU_TESTS_TIMEOUT_S=100 GPU_SWEEP_SECTIONS=stair ...
#
# Needs torch (CUDA build), triton, pytest and hypothesis importable (the H200 image has them). verl's
# vectorized-estimator peer needs verl's `verl/utils/groupwise.py` under $VERL_SRC (default .gpu_carry).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${GPU_CHECK_DRY_RUN:-0}
[ "${1:-}" = "--dry-run" ] && dry=1
parts=${GPU_CHECK_PARTS:-tests figures sweep}
report=${TREADLE_REPORT_DIR:-bench/results/gpu-$(date -u +%Y-%m-%d)}
mkdir -p "$report"
PY=${PYTHON:-python3}
export VERL_SRC=${VERL_SRC:-$PWD/.gpu_carry}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, no install step
export TREADLE_TRITON_AUTOTUNE=0
# setup.py installs triton_kernels/ as treadle.triton_kernels; with no install step, a link does it
[ -e python/treadle/triton_kernels ] || ln -s ../../triton_kernels python/treadle/triton_kernels
start=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - start ))s] $*" | tee -a "$report/summary.txt"; }
has() { [[ " $parts " == *" $1 "* ]]; }
# the cuda-marked tests: the kernel contracts and the ops' own CUDA tests
CUDA_TEST_FILES=${GPU_TEST_FILES:-"tests/contracts tests/stair/test_stair_readout.py tests/scale/test_gated_lora.py
  tests/scale/test_topk_entropy.py tests/grpo/test_advantages.py"}
PYTEST=("$PY" -m pytest -p no:cacheprovider -o addopts="" -rfE --tb=short)
: >"$report/summary.txt"

if [ "$dry" = 1 ]; then
  export TRITON_INTERPRET=1
  log "DRY RUN (CPU): imports, sm_90a AOT check of the pinned configs, cuda tests collected, figures on tiny shapes"
  "$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, '(dry run, CPU)')" >"$report/machine.txt" 2>&1
  "$PY" -c "import treadle.ops, treadle.triton_kernels.grpo, treadle.triton_kernels.stair, treadle.triton_kernels.scale, \
treadle.ops.topk_entropy; print('imports ok')" >"$report/imports.log" 2>&1
  rc_imp=$?; log "imports: $(tail -1 "$report/imports.log") (rc $rc_imp)"
  rc_aot=0
  if [ "${GPU_CHECK_DRY_AOT:-1}" = 1 ]; then  # 0: leave it out (tests/bench/test_gpu_aot.py runs it on its own)
    timeout 600 "$PY" bench/gpu_aot.py --json "$report/aot.json" >"$report/aot.log" 2>&1
    rc_aot=$?; log "AOT check (sm_90a): $(tail -1 "$report/aot.log") (rc $rc_aot)"
  fi
  # shellcheck disable=SC2086
  "${PYTEST[@]}" -q --collect-only -m cuda $CUDA_TEST_FILES >"$report/collect.log" 2>&1
  rc_col=$?; log "cuda tests collected: $(tail -1 "$report/collect.log") (rc $rc_col)"
  GPU_FIGURES_DEVICE=cpu timeout 600 "$PY" bench/gpu_figures.py "$report/figures.json" >"$report/figures.log" 2>&1
  rc_fig=$?
  errs=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(' '.join(k for k,v in d.items() if isinstance(v, dict) and 'error' in v))" "$report/figures.json" 2>&1)
  log "figures (tiny shapes, CPU): rc $rc_fig; sections with errors: ${errs:-none}"
  GPU_FIGURES_DEVICE=cpu timeout 300 "$PY" bench/gpu_sweep.py "$report/sweep.json" >"$report/sweep.log" 2>&1
  rc_sw=$?; log "config sweep (tiny shapes, CPU): $(tail -1 "$report/sweep.log") (rc $rc_sw)"
  grep -q '"error"' "$report/sweep.json" && { rc_sw=1; log "config sweep: a row failed (see sweep.json)"; }
  [ "$rc_imp$rc_aot$rc_col$rc_fig$rc_sw" = 00000 ] && [ -z "$errs" ] && { log "dry run ok"; exit 0; }
  log "dry run FAILED"; exit 1
fi

export TRITON_INTERPRET=0   # tests/conftest.py defaults it to 1 for CPU runs; on the GPU, compile for real
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv,noheader
  "$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  date -u
} >"$report/machine.txt" 2>&1
log "machine: $(tr '\n' ' ' <"$report/machine.txt")"

if has tests; then
  log "CUDA tests (contracts and ops; Triton kernels at their pinned configs)"
  # shellcheck disable=SC2086
  # compile in parallel where pytest-xdist is there (the GPU image has it), one test at most 90 s, so the
  # failures' tracebacks are printed inside the limit
  par=()
  "$PY" -c "import xdist" 2>/dev/null && par+=(-n "${GPU_TEST_WORKERS:-8}")
  "$PY" -c "import pytest_timeout" 2>/dev/null && par+=(--timeout 90)
  timeout ${GPU_TESTS_TIMEOUT_S:-150} "${PYTEST[@]}" -v "${par[@]}" -m cuda $CUDA_TEST_FILES >"$report/tests.log" 2>&1
  log "tests: $(tail -1 "$report/tests.log"); failed: $(grep -c FAILED "$report/tests.log")"
fi

if has figures; then
  log "GPU figures (bench/gpu_figures.py)"
  timeout 170 "$PY" bench/gpu_figures.py "$report/figures.json" >"$report/figures.log" 2>&1
  log "figures rc $?: $(grep -c '"error"' "$report/figures.json" 2>/dev/null) sections with errors"
fi
if has sweep; then  # the AOT-clean alternatives of each pinned config, timed (which config to pin)
  log "config sweep (bench/gpu_sweep.py)"
  GPU_SWEEP_BUDGET_S=${GPU_SWEEP_BUDGET_S:-100} timeout 130 "$PY" bench/gpu_sweep.py "$report/sweep.json" >"$report/sweep.log" 2>&1
  log "sweep rc $?: $(tail -1 "$report/sweep.log")"
fi
nvidia-smi -q -d CLOCK,POWER >"$report/clocks_after.txt" 2>&1
log "done; report in $report"

#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu for sm_90 with nvcc (no GPU needed), failing on any error and on
# register spills reported by ptxas. Usage: bash tests/build/nvcc_check.sh [arch, default sm_90]
set -euo pipefail
cd "$(dirname "$0")/../.."
arch=${1:-sm_90}
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "nvcc not found"; exit 3; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for f in csrc/cuda/*.cu; do
  log="$out/$(basename "$f").log"
  if ! "$NVCC" -std=c++17 -O3 -arch="$arch" -Icsrc -Xptxas -v -c "$f" -o "$out/$(basename "$f").o" >"$log" 2>&1; then
    echo "FAIL $f"; cat "$log"; status=1; continue
  fi
  if grep -E "bytes spill (stores|loads)" "$log" | grep -vq " 0 bytes spill"; then
    echo "SPILL $f"; grep -E "spill" "$log"; status=1; continue
  fi
  echo "ok   $f ($(grep -c 'Used [0-9]* registers' "$log") kernels)"
done
# The ATen glue (csrc/cuda/*.cpp) is checked with g++ -fsyntax-only against torch's headers and the
# CUDA toolkit's. A CPU build of torch lacks one generated header (cuda_cmake_macros.h): stub it.
PY=${PYTHON:-python}
if inc=$("$PY" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I'+p for p in include_paths()))" 2>/dev/null); then
  cuda_inc=${CUDA_HOME:-/usr/local/cuda}/include
  mkdir -p "$out/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  for f in csrc/cuda/*.cpp; do
    [ -e "$f" ] || continue
    # shellcheck disable=SC2086
    if g++ -std=c++20 -fsyntax-only -w $inc -I"$out/stub" -I"$cuda_inc" -Icsrc "$f" 2>"$out/glue.log"; then
      echo "ok   $f (g++ syntax check)"
    else
      echo "FAIL $f"; cat "$out/glue.log"; status=1
    fi
  done
else
  echo "skip csrc/cuda/*.cpp syntax check: torch not importable by $PY"
fi
exit $status

// Launchers of the CUDA kernels of treadle.ops.grpo_advantages (plain CUDA, raw pointers), so that the
// .cu file compiles with nvcc alone (no torch headers) and the ATen glue stays in a .cpp file.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "grpo_common.h"

namespace treadle {
namespace grpo {

// rewards: float32 or float64 (is_double), n rows; group: dense group index in [0, n) per row;
// ok: 1 if the row is considered; flags: nullable; work: 4*n doubles + n ints + 8 doubles, zeroed by
// the caller (layout in the .cu file); out: n elements of the rewards' type.
cudaError_t launch_advantages(const void* rewards, bool is_double, const int64_t* group, const int8_t* ok,
                              const int8_t* flags, double* work_f64, int32_t* work_i32, void* out, int64_t n,
                              Options o, cudaStream_t stream);

}  // namespace grpo
}  // namespace treadle

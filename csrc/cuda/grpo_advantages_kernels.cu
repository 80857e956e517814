// CUDA kernels of treadle.ops.grpo_advantages: a segmented reduction over dense group indices with
// float64 atomics, four launches, no host synchronisation. Spec: python/treadle/reference/grpo.py;
// per-row maths shared with the C++ kernel through grpo_common.h.
#include "grpo_advantages_kernels.cuh"

namespace treadle {
namespace grpo {
namespace {

constexpr int kThreads = 256;
// work_f64 layout: [cnt n][sum n][rep n][m2 n][batch 8: sum r, count, m2, sum a, sum (a - mean a)^2,
// representative a, count of a differing from it]; a reuses `rep` after pass 2 for reinforce_baseline,
// whose whitening statistics are two-pass like every other (whiten_dev_kernel).

__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ void block_add(double v, double* target) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0 && v != 0.0) atomicAdd(target, v);
}

template <typename T>
__global__ void stats_kernel(const T* __restrict__ r, const int64_t* __restrict__ g, const int8_t* __restrict__ ok,
                             double* cnt, double* sum, double* rep, double* batch, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double rv = 0.0, one = 0.0;
  if (i < n && ok[i]) {
    rv = static_cast<double>(r[i]);
    one = 1.0;
    const int64_t gi = g[i];
    atomicAdd(cnt + gi, 1.0);
    atomicAdd(sum + gi, rv);
    rep[gi] = rv;  // any member will do (benign race)
  }
  block_add(rv, batch + 0);
  block_add(one, batch + 1);
}

template <typename T>
__global__ void dev_kernel(const T* __restrict__ r, const int64_t* __restrict__ g, const int8_t* __restrict__ ok,
                           const double* cnt, const double* sum, const double* rep, double* m2, int32_t* differs,
                           double* batch, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double bd2 = 0.0;
  if (i < n && ok[i]) {
    const double rv = static_cast<double>(r[i]);
    const int64_t gi = g[i];
    const double d = rv - sum[gi] / cnt[gi];
    atomicAdd(m2 + gi, d * d);
    if (rv != rep[gi]) atomicMax(differs + gi, 1);
    const double bd = rv - batch[0] / fmax(batch[1], 1.0);
    bd2 = bd * bd;
  }
  block_add(bd2, batch + 2);
}

template <typename T>
__global__ void advantage_kernel(const T* __restrict__ r, const int64_t* __restrict__ g, const int8_t* __restrict__ ok,
                                 const int8_t* __restrict__ flags, const double* cnt, const double* sum,
                                 const double* m2, const int32_t* differs, double* batch, double* a, T* out,
                                 int64_t n, Options o) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double adv = 0.0;
  const bool considered = i < n && ok[i];
  if (considered) {
    const int64_t gi = g[i];
    const double c = cnt[gi];
    const double batch_std = std_from(batch[2], batch[1], o.unbiased);
    adv = row_advantage(static_cast<double>(r[i]), c, sum[gi] / c, m2[gi], differs[gi] == 0, batch_std, o);
  }
  if (o.estimator == kReinforceBaseline) {
    if (i < n) a[i] = adv;
    // a representative pre-whitening advantage: the first considered lane of each warp writes it
    // (a benign race between warps: any considered value will do)
    const unsigned lanes = __ballot_sync(0xffffffffu, considered);
    if (considered && static_cast<int>(threadIdx.x & 31) == __ffs(lanes) - 1) batch[5] = adv;
    block_add(adv, batch + 3);
    return;
  }
  if (i < n) {
    if (flags != nullptr && flags[i] && adv > 0.0) adv = 0.0;
    out[i] = static_cast<T>(adv);
  }
}

// second pass over the pre-whitening advantages: sum (a - mean a)^2 (no E[a^2] - E[a]^2 cancellation)
// and how many differ from the representative (all equal: exactly 0, never 0/0 at eps = 0)
__global__ void whiten_dev_kernel(const double* __restrict__ a, const int8_t* __restrict__ ok, double* batch,
                                  int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double d2 = 0.0, diff = 0.0;
  if (i < n && ok[i]) {
    const double d = a[i] - batch[3] / fmax(batch[1], 1.0);
    d2 = d * d;
    diff = a[i] != batch[5] ? 1.0 : 0.0;
  }
  block_add(d2, batch + 4);
  block_add(diff, batch + 6);
}

template <typename T>
__global__ void whiten_kernel(const double* __restrict__ a, const int8_t* __restrict__ ok,
                              const int8_t* __restrict__ flags, const double* batch, T* out, int64_t n, Options o) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const double cnt = batch[1];
  const double mean = batch[3] / fmax(cnt, 1.0);
  const double s = std_from(batch[4], cnt, o.unbiased);
  double adv = (ok[i] && batch[6] > 0.0) ? (a[i] - mean) / (s + o.eps) : 0.0;
  if (flags != nullptr && flags[i] && adv > 0.0) adv = 0.0;
  out[i] = static_cast<T>(adv);
}

template <typename T>
cudaError_t launch_typed(const T* r, const int64_t* g, const int8_t* ok, const int8_t* flags, double* w,
                         int32_t* differs, T* out, int64_t n, Options o, cudaStream_t stream) {
  double* cnt = w;
  double* sum = w + n;
  double* rep = w + 2 * n;
  double* m2 = w + 3 * n;
  double* batch = w + 4 * n;
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  stats_kernel<T><<<blocks, kThreads, 0, stream>>>(r, g, ok, cnt, sum, rep, batch, n);
  dev_kernel<T><<<blocks, kThreads, 0, stream>>>(r, g, ok, cnt, sum, rep, m2, differs, batch, n);
  advantage_kernel<T><<<blocks, kThreads, 0, stream>>>(r, g, ok, flags, cnt, sum, m2, differs, batch, rep, out, n, o);
  if (o.estimator == kReinforceBaseline) {
    whiten_dev_kernel<<<blocks, kThreads, 0, stream>>>(rep, ok, batch, n);
    whiten_kernel<T><<<blocks, kThreads, 0, stream>>>(rep, ok, flags, batch, out, n, o);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_advantages(const void* rewards, bool is_double, const int64_t* group, const int8_t* ok,
                              const int8_t* flags, double* work_f64, int32_t* work_i32, void* out, int64_t n,
                              Options o, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (is_double) {
    return launch_typed<double>(static_cast<const double*>(rewards), group, ok, flags, work_f64, work_i32,
                                static_cast<double*>(out), n, o, stream);
  }
  return launch_typed<float>(static_cast<const float*>(rewards), group, ok, flags, work_f64, work_i32,
                             static_cast<float*>(out), n, o, stream);
}

}  // namespace grpo
}  // namespace treadle

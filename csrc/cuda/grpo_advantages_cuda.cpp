// ATen glue of the CUDA backend of treadle.ops.grpo_advantages: dense group indices by sort + scan
// (no host sync), zeroed work buffers, then the plain-CUDA launcher in grpo_advantages_kernels.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/grpo_advantages_kernels.cuh"

namespace treadle {
namespace {

at::Tensor dense_group_index(const at::Tensor& ids) {
  auto sorted = at::sort(ids);
  const at::Tensor& keys = std::get<0>(sorted);
  const at::Tensor& perm = std::get<1>(sorted);
  at::Tensor starts = at::ones_like(keys);
  const int64_t n = keys.numel();
  if (n > 1) starts.slice(0, 1, n).copy_(keys.slice(0, 1, n).ne(keys.slice(0, 0, n - 1)));
  at::Tensor seg = at::cumsum(starts, 0).sub_(1);
  return at::empty_like(seg).index_put_({perm}, seg);
}

at::Tensor grpo_advantages_cuda(const at::Tensor& rewards, const at::Tensor& group_ids,
                                const c10::optional<at::Tensor>& valid, const c10::optional<at::Tensor>& flags,
                                int64_t estimator, bool unbiased, double eps, bool eps_in_sqrt, bool singleton_raw,
                                int64_t scale, bool skip_nonfinite) {
  TORCH_CHECK(rewards.is_cuda() && rewards.dim() == 1 && rewards.is_contiguous(), "rewards: contiguous 1-D CUDA tensor");
  TORCH_CHECK(rewards.scalar_type() == at::kFloat || rewards.scalar_type() == at::kDouble, "rewards: float32/float64");
  const int64_t n = rewards.numel();
  at::Tensor ok = valid.has_value() ? valid->clone() : at::ones({n}, rewards.options().dtype(at::kBool));
  if (skip_nonfinite) ok.logical_and_(at::isfinite(rewards));
  at::Tensor ok8 = ok.to(at::kChar);
  at::Tensor fl8;
  if (flags.has_value()) fl8 = flags->to(at::kChar);
  at::Tensor dense = dense_group_index(group_ids.to(at::kLong));
  at::Tensor work = at::zeros({4 * n + 8}, rewards.options().dtype(at::kDouble));
  at::Tensor differs = at::zeros({n}, rewards.options().dtype(at::kInt));
  at::Tensor out = at::empty_like(rewards);
  const grpo::Options o{static_cast<int>(estimator), unbiased, eps, eps_in_sqrt, singleton_raw, static_cast<int>(scale)};
  const cudaError_t err = grpo::launch_advantages(
      rewards.data_ptr(), rewards.scalar_type() == at::kDouble, dense.data_ptr<int64_t>(), ok8.data_ptr<int8_t>(),
      flags.has_value() ? fl8.data_ptr<int8_t>() : nullptr, work.data_ptr<double>(), differs.data_ptr<int32_t>(),
      out.data_ptr(), n, o, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "grpo_advantages CUDA launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(treadle_C, CUDA, m) { m.impl("grpo_advantages", &grpo_advantages_cuda); }

}  // namespace treadle

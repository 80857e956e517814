// Shared per-row maths of the GRPO-family advantage op, used by the C++ CPU kernel and the CUDA
// kernel alike, so the two cannot drift apart. Spec: python/treadle/reference/grpo.py.
#pragma once
#include <cmath>

#ifdef __CUDACC__
#define TREADLE_HD __host__ __device__ __forceinline__
#else
#define TREADLE_HD inline __attribute__((always_inline))
#endif

namespace treadle {
namespace grpo {

enum Estimator : int { kGrpo = 0, kDrGrpo = 1, kRloo = 2, kReinforceBaseline = 3 };
enum Scale : int { kGroup = 0, kBatch = 1, kNone = 2 };

struct Options {
  int estimator;
  bool unbiased;
  double eps;
  bool eps_in_sqrt;
  bool singleton_raw;
  int scale;
};

// A row's advantage is affine in its reward: A = (r - center) * mul, with one (center, mul) pair
// per group (before the batch whitening of reinforce_baseline and before the flag clamp). Computing
// the pair once per group keeps divisions and square roots out of the per-row loop.
//   n: considered rows in the group; mean; m2 = sum (r - mean)^2; all_equal: max == min;
//   batch_std: std over all considered rows of the batch (grpo with scale == kBatch only).
struct Affine {
  double center;
  double mul;
};

TREADLE_HD Affine group_affine(double n, double mean, double m2, bool all_equal, double batch_std,
                               const Options& o) {
  if (n < 1.5) {  // a group of one: 0, or verl's convention (mean 0, std 1)
    if (!o.singleton_raw) return {0.0, 0.0};
    return {0.0, (o.estimator == kGrpo && o.scale != kNone) ? 1.0 / (1.0 + o.eps) : 1.0};
  }
  if (all_equal) return {mean, 0.0};  // exactly 0: no trust in eps
  switch (o.estimator) {
    case kGrpo:
      if (o.scale == kGroup) {
        const double var = m2 / (o.unbiased ? n - 1.0 : n);
        return {mean, o.eps_in_sqrt ? 1.0 / sqrt(var + o.eps) : 1.0 / (sqrt(var) + o.eps)};
      }
      if (o.scale == kBatch) return {mean, 1.0 / (batch_std + o.eps)};
      return {mean, 1.0};
    case kRloo:  // r_i - mean of the others = n / (n - 1) * (r_i - mean)
      return {mean, n / (n - 1.0)};
    default:  // kDrGrpo, kReinforceBaseline (whitened afterwards)
      return {mean, 1.0};
  }
}

TREADLE_HD double row_advantage(double r, double n, double mean, double m2, bool all_equal,
                                double batch_std, const Options& o) {
  const Affine a = group_affine(n, mean, m2, all_equal, batch_std, o);
  return (r - a.center) * a.mul;
}

TREADLE_HD double std_from(double m2, double n, bool unbiased) {
  if (n < 1.5) return 0.0;
  return sqrt(m2 / (unbiased ? n - 1.0 : n));
}

}  // namespace grpo
}  // namespace treadle

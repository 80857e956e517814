// Shared per-row maths of the GRPO-family advantage op, used by the C++ CPU kernel and the CUDA
// kernel alike, so the two cannot drift apart. Spec: python/treadle/reference/grpo.py.
#pragma once
#include <cmath>

#ifdef __CUDACC__
#define TREADLE_HD __host__ __device__ __forceinline__
#else
#define TREADLE_HD inline
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

// Advantage of one considered row from its group's statistics (before the batch whitening of
// reinforce_baseline and before the flag clamp).
//   n: considered rows in the group; mean; m2 = sum (r - mean)^2; all_equal: max == min;
//   batch_std: std over all considered rows of the batch (grpo with scale == kBatch only).
TREADLE_HD double row_advantage(double r, double n, double mean, double m2, bool all_equal,
                                double batch_std, const Options& o) {
  if (n < 1.5) {
    if (!o.singleton_raw) return 0.0;
    return (o.estimator == kGrpo && o.scale != kNone) ? r / (1.0 + o.eps) : r;
  }
  if (all_equal) return 0.0;
  const double d = r - mean;
  switch (o.estimator) {
    case kGrpo:
      if (o.scale == kGroup) {
        const double var = m2 / (o.unbiased ? n - 1.0 : n);
        return o.eps_in_sqrt ? d / sqrt(var + o.eps) : d / (sqrt(var) + o.eps);
      }
      if (o.scale == kBatch) return d / (batch_std + o.eps);
      return d;
    case kRloo:
      return d * n / (n - 1.0);
    default:  // kDrGrpo, kReinforceBaseline (whitened afterwards)
      return d;
  }
}

TREADLE_HD double std_from(double m2, double n, bool unbiased) {
  if (n < 1.5) return 0.0;
  return sqrt(m2 / (unbiased ? n - 1.0 : n));
}

}  // namespace grpo
}  // namespace treadle

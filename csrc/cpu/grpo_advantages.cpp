// C++ CPU kernel of treadle.ops.grpo_advantages (spec: python/treadle/reference/grpo.py).
//
// Grouping by arbitrary int64 ids uses an open-addressing hash table sized to the number of
// distinct groups (grown by doubling), so the working set stays in cache for typical group sizes;
// statistics are two-pass in float64 (mean, then sum of squared deviations), which keeps groups
// whose rewards differ by 1e-5 exact to ~1e-11. The hash pass is serial (it is memory-bound and
// cheap); the per-row passes run under OpenMP.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "grpo_common.h"

namespace treadle {
namespace {

using grpo::Options;

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

class GroupTable {
 public:
  explicit GroupTable(int64_t expected) {
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(expected) * 2) cap <<= 1;
    reset(cap);
  }
  // Dense index of `key`, inserting it as group `next` if new.
  int32_t find_or_insert(int64_t key, int32_t next) {
    uint64_t h = mix64(static_cast<uint64_t>(key)) & mask_;
    while (true) {
      const int32_t g = group_[h];
      if (g < 0) break;
      if (keys_[h] == key) return g;
      h = (h + 1) & mask_;
    }
    if (static_cast<uint64_t>(next + 1) * 2 > mask_ + 1) {  // keep load factor <= 1/2
      grow();
      return find_or_insert(key, next);
    }
    keys_[h] = key;
    group_[h] = next;
    return next;
  }

 private:
  void reset(uint64_t cap) {
    keys_.assign(cap, 0);
    group_.assign(cap, -1);
    mask_ = cap - 1;
  }
  void grow() {
    std::vector<int64_t> old_keys;
    std::vector<int32_t> old_group;
    old_keys.swap(keys_);
    old_group.swap(group_);
    reset((mask_ + 1) * 2);
    for (size_t i = 0; i < old_group.size(); ++i) {
      if (old_group[i] < 0) continue;
      uint64_t h = mix64(static_cast<uint64_t>(old_keys[i])) & mask_;
      while (group_[h] >= 0) h = (h + 1) & mask_;
      keys_[h] = old_keys[i];
      group_[h] = old_group[i];
    }
  }
  std::vector<int64_t> keys_;
  std::vector<int32_t> group_;
  uint64_t mask_ = 0;
};

template <typename T>
void advantages_kernel(const T* r, const int64_t* ids, const bool* valid, const bool* flags, T* out,
                       int64_t n, const Options& o, bool skip_nonfinite) {
  std::vector<int32_t> gidx(n);
  std::vector<double> sum, m2;
  std::vector<int32_t> cnt;
  std::vector<T> first;
  std::vector<uint8_t> differs;
  const int64_t reserve = std::min<int64_t>(n, 1 << 16);
  sum.reserve(reserve); cnt.reserve(reserve); first.reserve(reserve); differs.reserve(reserve);
  GroupTable table(std::min<int64_t>(n, 4096));

  // Pass 1 (serial): dense group index, count, sum, "all equal" tracking, batch sum.
  double bsum = 0.0;
  int64_t bcnt = 0;
  int64_t last_id = 0;
  int32_t last_g = -1;
  for (int64_t i = 0; i < n; ++i) {
    const T ri = r[i];
    const bool ok = (valid == nullptr || valid[i]) && (!skip_nonfinite || std::isfinite(static_cast<double>(ri)));
    if (!ok) {
      gidx[i] = -1;
      continue;
    }
    int32_t g;
    if (last_g >= 0 && ids[i] == last_id) {
      g = last_g;  // contiguous groups (the common layout) skip the hash lookup
    } else {
      g = table.find_or_insert(ids[i], static_cast<int32_t>(cnt.size()));
      if (g == static_cast<int32_t>(cnt.size())) {
        sum.push_back(0.0); cnt.push_back(0); first.push_back(ri); differs.push_back(0);
      }
      last_id = ids[i];
      last_g = g;
    }
    gidx[i] = g;
    sum[g] += static_cast<double>(ri);
    cnt[g] += 1;
    differs[g] |= static_cast<uint8_t>(ri != first[g]);
    bsum += static_cast<double>(ri);
    bcnt += 1;
  }
  const int64_t num_groups = static_cast<int64_t>(cnt.size());
  std::vector<double> mean(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) mean[g] = sum[g] / cnt[g];

  // Pass 2 (serial: scattered accumulation): sum of squared deviations per group and batch.
  const bool need_m2 = o.estimator == grpo::kGrpo && o.scale == grpo::kGroup;
  const bool need_batch = o.estimator == grpo::kGrpo && o.scale == grpo::kBatch;
  double batch_std = 0.0;
  if (need_m2) {
    m2.assign(num_groups, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t g = gidx[i];
      if (g < 0) continue;
      const double d = static_cast<double>(r[i]) - mean[g];
      m2[g] += d * d;
    }
  }
  if (need_batch && bcnt > 0) {
    const double bmean = bsum / bcnt;
    double bm2 = 0.0;
#pragma omp parallel for reduction(+ : bm2) schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; ++i) {
      if (gidx[i] < 0) continue;
      const double d = static_cast<double>(r[i]) - bmean;
      bm2 += d * d;
    }
    batch_std = grpo::std_from(bm2, static_cast<double>(bcnt), o.unbiased);
  }

  // Pass 3 (parallel): per-row advantage.
  const bool whiten = o.estimator == grpo::kReinforceBaseline;
  std::vector<double> a(whiten ? n : 0);
  double asum = 0.0;
#pragma omp parallel for reduction(+ : asum) schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    const int32_t g = gidx[i];
    double adv = 0.0;
    if (g >= 0) {
      adv = grpo::row_advantage(static_cast<double>(r[i]), static_cast<double>(cnt[g]), mean[g],
                                need_m2 ? m2[g] : 0.0, differs[g] == 0, batch_std, o);
    }
    if (whiten) {
      a[i] = adv;
      if (g >= 0) asum += adv;
    } else {
      if (flags != nullptr && flags[i] && adv > 0.0) adv = 0.0;
      out[i] = static_cast<T>(adv);
    }
  }
  if (!whiten) return;

  // reinforce_baseline: whiten a over the considered rows of the batch.
  const double amean = bcnt > 0 ? asum / bcnt : 0.0;
  double am2 = 0.0;
#pragma omp parallel for reduction(+ : am2) schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    if (gidx[i] < 0) continue;
    const double d = a[i] - amean;
    am2 += d * d;
  }
  const double astd = grpo::std_from(am2, static_cast<double>(bcnt), o.unbiased);
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t i = 0; i < n; ++i) {
    double adv = gidx[i] < 0 ? 0.0 : (a[i] - amean) / (astd + o.eps);
    if (flags != nullptr && flags[i] && adv > 0.0) adv = 0.0;
    out[i] = static_cast<T>(adv);
  }
}

at::Tensor grpo_advantages_cpu(const at::Tensor& rewards, const at::Tensor& group_ids,
                               const c10::optional<at::Tensor>& valid, const c10::optional<at::Tensor>& flags,
                               int64_t estimator, bool unbiased, double eps, bool eps_in_sqrt,
                               bool singleton_raw, int64_t scale, bool skip_nonfinite) {
  TORCH_CHECK(rewards.dim() == 1 && rewards.is_contiguous(), "rewards must be a contiguous 1-D tensor");
  TORCH_CHECK(group_ids.scalar_type() == at::kLong && group_ids.is_contiguous() &&
                  group_ids.numel() == rewards.numel(),
              "group_ids must be a contiguous int64 tensor of the same length as rewards");
  for (const auto* m : {&valid, &flags}) {
    if (m->has_value()) {
      TORCH_CHECK((*m)->scalar_type() == at::kBool && (*m)->is_contiguous() && (*m)->numel() == rewards.numel(),
                  "valid/flags must be contiguous bool tensors of the same length as rewards");
    }
  }
  TORCH_CHECK(estimator >= 0 && estimator <= 3, "estimator code out of range");
  TORCH_CHECK(scale >= 0 && scale <= 2, "scale code out of range");
  const Options o{static_cast<int>(estimator), unbiased, eps, eps_in_sqrt, singleton_raw, static_cast<int>(scale)};
  at::Tensor out = at::empty_like(rewards);
  const int64_t n = rewards.numel();
  const bool* vp = valid.has_value() ? valid->data_ptr<bool>() : nullptr;
  const bool* fp = flags.has_value() ? flags->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "grpo_advantages_cpu", [&] {
    advantages_kernel<scalar_t>(rewards.data_ptr<scalar_t>(), group_ids.data_ptr<int64_t>(), vp, fp,
                                out.data_ptr<scalar_t>(), n, o, skip_nonfinite);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treadle_C, m) {
  m.def(
      "grpo_advantages(Tensor rewards, Tensor group_ids, Tensor? valid, Tensor? flags, int estimator, "
      "bool unbiased, float eps, bool eps_in_sqrt, bool singleton_raw, int scale, bool skip_nonfinite) -> Tensor");
}

TORCH_LIBRARY_IMPL(treadle_C, CPU, m) { m.impl("grpo_advantages", &grpo_advantages_cpu); }

}  // namespace treadle

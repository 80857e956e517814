// C++ CPU kernel of treadle.ops.grpo_advantages (spec: python/treadle/reference/grpo.py).
//
// Grouping by arbitrary int64 ids uses an open-addressing hash table sized to the number of
// distinct groups (grown by doubling), so the working set stays in cache for typical group sizes;
// statistics are two-pass in float64 (mean, then sum of squared deviations), which keeps groups
// whose rewards differ by 1e-5 exact to ~1e-11. Large batches split the hash pass by id partition
// over OpenMP threads (no atomics: each group has one owner thread); per-row passes run under
// OpenMP too.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "grpo_common.h"

namespace treadle {
namespace {

using grpo::Options;

// Below this many rows the per-row passes stay on one thread: each is a few microseconds of work,
// less than an OpenMP fork/join costs on a busy machine.
constexpr int64_t kParallelRows = 1 << 18;

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Per-group accumulators, one cache line holds two groups: each row touches one struct per pass.
struct GroupStats {
  double sum;
  double m2;
  double first;  // a representative reward, for the exact "all equal" test
  int32_t count;
  int32_t differs;
};

// Open addressing (linear probing) from int64 id to dense group index, sized to the number of
// distinct groups (load factor <= 1/2, grown by doubling).
// Open addressing (linear probing) from int64 id to dense group index, sized to the number of
// distinct groups (load factor <= 1/2, grown by doubling).
class GroupTable {
 public:
  struct Slot {
    int64_t key;
    int32_t group;
  };
  explicit GroupTable(int64_t expected) {
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(expected) * 2) cap <<= 1;
    slots_.assign(cap, Slot{0, -1});
    mask_ = cap - 1;
  }
  // Start loading the slot a later lookup of `hash` will probe (hides the cache miss).
  void prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[hash & mask_]); }
  // Dense index of `key`, inserting it as group `next` if new.
  int32_t find_or_insert(int64_t key, uint64_t hash, int32_t next) {
    uint64_t h = hash & mask_;
    while (slots_[h].group >= 0) {
      if (slots_[h].key == key) return slots_[h].group;
      h = (h + 1) & mask_;
    }
    if (static_cast<uint64_t>(next + 1) * 2 > mask_ + 1) {
      grow();
      return find_or_insert(key, hash, next);
    }
    slots_[h] = Slot{key, next};
    return next;
  }

 private:
  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(old.size() * 2, Slot{0, -1});
    mask_ = slots_.size() - 1;
    for (const Slot& s : old) {
      if (s.group < 0) continue;
      uint64_t h = mix64(static_cast<uint64_t>(s.key)) & mask_;
      while (slots_[h].group >= 0) h = (h + 1) & mask_;
      slots_[h] = s;
    }
  }
  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
};

template <typename T>
void advantages_kernel(const T* r, const int64_t* ids, const bool* valid, const bool* flags, T* out,
                       int64_t n, const Options& o, bool skip_nonfinite) {
  // Pass 1: dense group index, count, sum, "all equal" tracking, batch sum. With P threads, thread t
  // owns the ids whose hash falls in partition t: it scans every row but does the random-access work
  // for its own rows only, in its own table, so no two threads touch one group. Group g of partition
  // t gets the global index g * P + t.
  int P = 1;
#ifdef _OPENMP
  if (n >= kParallelRows / 8) {
    const int threads = std::max(1, std::min(omp_get_max_threads(), 8));
    while (P * 2 <= threads) P *= 2;  // a power of two: owner = index & (P - 1), no division
  }
#endif
  const uint32_t part_mask = static_cast<uint32_t>(P - 1);
  std::vector<int32_t> gidx(n);
  std::vector<std::vector<GroupStats>> parts(P);
  std::vector<double> part_sum(P, 0.0);
  std::vector<int64_t> part_cnt(P, 0);
#pragma omp parallel num_threads(P) if (P > 1)
  {
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
#endif
    std::vector<GroupStats>& groups = parts[t];
    GroupTable table(std::min<int64_t>(n / P + 1, 4096));
    double bsum = 0.0;
    int64_t bcnt = 0;
    int64_t last_id = 0;
    int32_t last_g = -1;
    constexpr int64_t kAhead = 16;  // rows of look-ahead for the table prefetch
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) table.prefetch(mix64(static_cast<uint64_t>(ids[i + kAhead])));
      const double ri = static_cast<double>(r[i]);
      const bool ok = (valid == nullptr || valid[i]) && (!skip_nonfinite || std::isfinite(ri));
      if (!ok) {
        if (t == 0) gidx[i] = -1;
        continue;
      }
      const int64_t id = ids[i];
      int32_t g;
      if (last_g >= 0 && id == last_id) {
        g = last_g;  // contiguous groups (the common layout) skip the hash lookup
      } else {
        const uint64_t h = mix64(static_cast<uint64_t>(id));
        if (P > 1 && static_cast<int>((h >> 56) & part_mask) != t) continue;
        const int32_t next = static_cast<int32_t>(groups.size());
        g = table.find_or_insert(id, h, next);
        if (g == next) groups.push_back(GroupStats{0.0, 0.0, ri, 0, 0});
        last_id = id;
        last_g = g;
      }
      gidx[i] = g * P + t;
      GroupStats& st = groups[g];
      st.sum += ri;
      st.count += 1;
      st.differs |= static_cast<int32_t>(ri != st.first);
      bsum += ri;
      bcnt += 1;
    }
    part_sum[t] = bsum;
    part_cnt[t] = bcnt;
  }
  double bsum = 0.0;
  int64_t bcnt = 0;
  size_t max_groups = 0;
  for (int t = 0; t < P; ++t) {
    bsum += part_sum[t];
    bcnt += part_cnt[t];
    max_groups = std::max(max_groups, parts[t].size());
  }
  std::vector<GroupStats> merged;
  if (P > 1) {
    merged.assign(max_groups * P, GroupStats{0.0, 0.0, 0.0, 1, 0});
    for (int t = 0; t < P; ++t)
      for (size_t g = 0; g < parts[t].size(); ++g) merged[g * P + t] = parts[t][g];
  }
  std::vector<GroupStats>& groups = P == 1 ? parts[0] : merged;
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  for (int64_t g = 0; g < num_groups; ++g) groups[g].sum /= groups[g].count;  // sum -> mean

  // Pass 2: sum of squared deviations per group (thread t owns groups g with g % P == t) and batch.
  const bool need_m2 = o.estimator == grpo::kGrpo && o.scale == grpo::kGroup;
  const bool need_batch = o.estimator == grpo::kGrpo && o.scale == grpo::kBatch;
  double batch_std = 0.0;
  if (need_m2) {
#pragma omp parallel num_threads(P) if (P > 1)
    {
      int t = 0;
#ifdef _OPENMP
      t = omp_get_thread_num();
#endif
      for (int64_t i = 0; i < n; ++i) {
        const int32_t g = gidx[i];
        if (g < 0 || (static_cast<uint32_t>(g) & part_mask) != static_cast<uint32_t>(t)) continue;
        const double d = static_cast<double>(r[i]) - groups[g].sum;
        groups[g].m2 += d * d;
      }
    }
  }
  if (need_batch && bcnt > 0) {
    const double bmean = bsum / bcnt;
    double bm2 = 0.0;
#pragma omp parallel for reduction(+ : bm2) schedule(static) if (n > kParallelRows)
    for (int64_t i = 0; i < n; ++i) {
      if (gidx[i] < 0) continue;
      const double d = static_cast<double>(r[i]) - bmean;
      bm2 += d * d;
    }
    batch_std = grpo::std_from(bm2, static_cast<double>(bcnt), o.unbiased);
  }

  // Per group: the affine map A = (r - center) * mul (grpo_common.h), so pass 3 is one FMA a row.
  std::vector<grpo::Affine> affine(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const GroupStats& s = groups[g];
    affine[g] = grpo::group_affine(static_cast<double>(s.count), s.sum, s.m2, s.differs == 0, batch_std, o);
  }

  // Pass 3 (parallel): per-row advantage.
  const bool whiten = o.estimator == grpo::kReinforceBaseline;
  std::vector<double> a(whiten ? n : 0);
  double asum = 0.0;
#pragma omp parallel for reduction(+ : asum) schedule(static) if (n > kParallelRows)
  for (int64_t i = 0; i < n; ++i) {
    const int32_t g = gidx[i];
    double adv = 0.0;
    if (g >= 0) adv = (static_cast<double>(r[i]) - affine[g].center) * affine[g].mul;
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
#pragma omp parallel for reduction(+ : am2) schedule(static) if (n > kParallelRows)
  for (int64_t i = 0; i < n; ++i) {
    if (gidx[i] < 0) continue;
    const double d = a[i] - amean;
    am2 += d * d;
  }
  const double astd = grpo::std_from(am2, static_cast<double>(bcnt), o.unbiased);
#pragma omp parallel for schedule(static) if (n > kParallelRows)
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

// C++ CPU kernel of treadle.ops.grpo_advantages (spec: python/treadle/reference/grpo.py).
//
// Grouping rows by arbitrary int64 ids, without a cache-missing hash lookup per row:
//   A. radix partition. Each id is hashed with splitmix64's finaliser, a bijection of 64-bit
//      integers, so the hash stands for the id (equal hashes <=> equal ids). A counting pass and a
//      stable scatter pass (both sequential reads) copy every considered row (hash, row index,
//      reward) into one of B partitions chosen by the hash's top bits; B is a power of two giving
//      about kRowsPerPartition rows a partition. Rows keep their order inside a partition, so every
//      group's sums run in row order: the result is the same for any B and any thread count.
//   B. per partition: an open-addressing table indexed by the hash's low bits, small enough to stay
//      in L1/L2 and reused from partition to partition without clearing (stamps), maps each row to
//      a local group; statistics are two-pass in float64 (mean, then sum of squared deviations),
//      which keeps groups whose rewards differ by 1e-5 exact to ~1e-11; each group's advantage is
//      affine in the reward (grpo_common.h) and is written straight to the row's output.
// Partitions are independent (each group lives in exactly one), so threads split them without
// atomics, and the partition passes split the rows. Batch-wide statistics (scale="batch",
// reinforce_baseline) are summed over fixed row blocks combined in block order. Scratch buffers
// are kept per calling thread between calls (no allocation on the hot path up to kKeepRows rows).
// At N = 65,536 with 8K shuffled groups this runs about 9-10 ns a row on one core (the hash-table
// kernel it replaces: about 18 ns), most of it the table pass; see bench/bench_grpo.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "grpo_common.h"

namespace treadle {
namespace {

using grpo::Options;

// Rows per thread below which the op stays on one thread: at N = 65,536 one core takes ~0.6 ms, and
// on a busy machine a second thread's fork/join and barriers cost more than they save.
constexpr int64_t kRowsPerThread = int64_t{1} << 17;
// Target rows per partition (measured: 2K-4K rows beat 512-1K, where the scatter's many write
// streams cost more than the smaller table saves) and the most partitions one scatter writes to.
constexpr int64_t kRowsPerPartition = 2048;
constexpr int kMaxPartitionBits = 8;
// Row chunks of the partition pass: at least this many rows each, at most kMaxChunks of them.
constexpr int64_t kRowsPerChunk = 8192;
constexpr int64_t kMaxChunks = 64;
// Table slots a partition starts with at most (16 B each); more groups double it.
constexpr uint64_t kTableSlots = uint64_t{1} << 14;
// Rows between two checks of the table's load (the check stays out of the per-row loop).
constexpr int64_t kGrowCheckRows = 256;
// Rows in a block of the batch-wide sums (fixed, so sums do not depend on the thread count).
constexpr int64_t kBlockRows = 16384;
// Scratch kept between calls up to this many rows; larger batches allocate per call.
constexpr int64_t kKeepRows = int64_t{1} << 18;
constexpr uint16_t kSkip = 0xFFFF;  // partition code of a row that is not considered

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// One considered row inside a partition. `key` holds the id's hash until the partition's table
// pass replaces it with the row's local group index.
template <typename T, typename RowT>
struct Entry {
  int64_t key;
  RowT row;
  T r;
};

struct GroupStats {  // per local group (32 B); after the statistics, sum/m2 become the affine pair
  double sum;
  double m2;
  double first;     // a representative reward, for the exact "all equal" test
  uint64_t counts;  // rows in the group (low 63 bits) | some reward differs from `first` (top bit)
};
constexpr uint64_t kDiffers = uint64_t{1} << 63;

// Open-addressing table (linear probing) from a row's key (its id's bijective hash) to a local group
// slot, reused for every partition a thread handles: a table slot is live only when its stamp equals
// the current partition's, so moving to the next partition costs no clearing.
struct TableSlot {
  uint64_t key;
  uint32_t group;
  uint32_t stamp;
};

struct LocalTable {
  std::vector<TableSlot> slots;
  std::vector<GroupStats> groups;  // `limit` of them: a group index never exceeds the live count
  uint64_t mask = 0;
  uint32_t limit = 0;  // groups allowed before the table doubles (load 1/2)
  uint32_t stamp = 0;
  // Prepare for a partition of `rows` rows (capacity 2 * rows, at most kTableSlots to start with).
  void reset(int64_t rows) {
    uint64_t cap = 16;
    while (cap < static_cast<uint64_t>(std::min<int64_t>(rows, kTableSlots / 2)) * 2) cap <<= 1;
    if (cap > slots.size()) {
      slots.assign(cap, TableSlot{0, 0, 0});
      stamp = 0;
    }
    mask = cap - 1;
    limit = static_cast<uint32_t>(cap / 2);
    if (groups.size() < limit) groups.resize(limit);
    if (++stamp == 0) {  // stamps wrapped: clear once
      std::fill(slots.begin(), slots.end(), TableSlot{0, 0, 0});
      stamp = 1;
    }
  }
  // The live groups could fill half the table: double it, re-inserting the live slots (rare: a
  // partition with more than kTableSlots / 2 groups).
  void grow() {
    std::vector<TableSlot> old(slots.begin(), slots.begin() + (mask + 1));
    const uint64_t cap = (mask + 1) * 2;
    if (cap > slots.size()) slots.resize(cap);
    std::fill(slots.begin(), slots.begin() + cap, TableSlot{0, 0, 0});
    mask = cap - 1;
    for (const TableSlot& s : old) {
      if (s.stamp != stamp) continue;
      uint64_t h = s.key & mask;
      while (slots[h].stamp == stamp) h = (h + 1) & mask;
      slots[h] = s;
    }
    limit = static_cast<uint32_t>(cap / 2);
    groups.resize(limit);
  }
  void trim() {  // after a huge partition, give the memory back
    if (slots.size() > kTableSlots) {
      slots = std::vector<TableSlot>();
      groups = std::vector<GroupStats>();
      stamp = 0;
    }
  }
};

// Scratch of one calling thread, kept between calls (raw storage, never value-initialised).
struct Scratch {
  std::unique_ptr<unsigned char[]> entries, codes, adv;
  size_t entries_bytes = 0, codes_bytes = 0, adv_bytes = 0;
  static void* get(std::unique_ptr<unsigned char[]>& p, size_t& have, size_t want) {
    if (want > have) {
      p.reset(new unsigned char[want]);
      have = want;
    }
    return p.get();
  }
  void trim(int64_t n) {  // drop buffers of a huge batch instead of holding them forever
    if (n > kKeepRows) {
      entries.reset();
      codes.reset();
      adv.reset();
      entries_bytes = codes_bytes = adv_bytes = 0;
    }
  }
};

// Phase B for one partition (rows e[0..m) in row order): group statistics, then the advantages,
// written to out (or to `a` for reinforce_baseline, which is whitened afterwards).
template <typename T, typename E>
void partition_advantages(E* e, int64_t m, LocalTable& table, double batch_std, const Options& o, bool need_m2,
                          const bool* flags, T* out, double* a) {
  table.reset(m);
  TableSlot* slots = table.slots.data();
  GroupStats* gs = table.groups.data();
  uint64_t mask = table.mask;
  const uint32_t stamp = table.stamp;
  uint32_t ng = 0, limit = table.limit;
  uint64_t last_key = 0;
  uint32_t last_g = UINT32_MAX;
  for (int64_t j0 = 0; j0 < m; j0 += kGrowCheckRows) {
    const int64_t j1 = std::min(m, j0 + kGrowCheckRows);
    if (ng + (j1 - j0) > limit) {  // this block could push the load past 1/2: double the table
      table.grow();
      slots = table.slots.data();
      gs = table.groups.data();
      mask = table.mask;
      limit = table.limit;
    }
    for (int64_t j = j0; j < j1; ++j) {
      const uint64_t key = static_cast<uint64_t>(e[j].key);
      const double rj = static_cast<double>(e[j].r);
      uint32_t g = last_g;
      bool fresh = false;
      if (key != last_key || last_g == UINT32_MAX) {  // contiguous groups (a common layout) skip the lookup
        uint64_t s = key & mask;
        while (slots[s].stamp == stamp && slots[s].key != key) s = (s + 1) & mask;
        fresh = slots[s].stamp != stamp;
        g = fresh ? ng : slots[s].group;
        slots[s] = TableSlot{key, g, stamp};
        ng += fresh;
        last_key = key;
        last_g = g;
      }
      e[j].key = g;
      GroupStats& st = gs[g];  // a fresh group's slot holds stale values: select, do not branch
      const double first = fresh ? rj : st.first;
      st.first = first;
      st.sum = (fresh ? 0.0 : st.sum) + rj;
      st.counts = ((fresh ? 0 : st.counts) + 1) | (static_cast<uint64_t>(rj != first) << 63);
    }
  }
  for (uint32_t g = 0; g < ng; ++g) {  // sum -> mean
    gs[g].sum /= static_cast<double>(gs[g].counts & ~kDiffers);
    gs[g].m2 = 0.0;
  }
  if (need_m2) {
    for (int64_t j = 0; j < m; ++j) {
      GroupStats& st = gs[e[j].key];
      const double d = static_cast<double>(e[j].r) - st.sum;
      st.m2 += d * d;
    }
  }
  for (uint32_t g = 0; g < ng; ++g) {  // (mean, m2) -> affine (center, mul)
    GroupStats& st = gs[g];
    const grpo::Affine af =
        grpo::group_affine(static_cast<double>(st.counts & ~kDiffers), st.sum, st.m2, (st.counts & kDiffers) == 0,
                           batch_std, o);
    st.sum = af.center;
    st.m2 = af.mul;
  }
  if (a != nullptr) {
    for (int64_t j = 0; j < m; ++j) {
      const GroupStats& st = gs[e[j].key];
      a[e[j].row] = (static_cast<double>(e[j].r) - st.sum) * st.m2;
    }
  } else if (flags == nullptr) {
    for (int64_t j = 0; j < m; ++j) {
      const GroupStats& st = gs[e[j].key];
      out[e[j].row] = static_cast<T>((static_cast<double>(e[j].r) - st.sum) * st.m2);
    }
  } else {
    for (int64_t j = 0; j < m; ++j) {
      const GroupStats& st = gs[e[j].key];
      double adv = (static_cast<double>(e[j].r) - st.sum) * st.m2;
      if (flags[e[j].row] && adv > 0.0) adv = 0.0;
      out[e[j].row] = static_cast<T>(adv);
    }
  }
  table.trim();
}

// Sum of f(i) over considered rows, in fixed row blocks combined in block order (so the result does
// not depend on the thread count). Called by every thread of the team; returns the same value in all.
template <typename F>
double blocked_sum(const uint16_t* code, int64_t n, double* partial, F f) {
  const int64_t nblocks = (n + kBlockRows - 1) / kBlockRows;
#pragma omp for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    double s = 0.0;
    for (int64_t i = b * kBlockRows, e = std::min(n, (b + 1) * kBlockRows); i < e; ++i)
      if (code[i] != kSkip) s += f(i);
    partial[b] = s;
  }  // implicit barrier
  double s = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) s += partial[b];
#pragma omp barrier
  return s;
}

// ---------------------------------------------------------------------------------------------------
// Fast path: grouped-contiguous ids (every group's rows form one run of equal ids, in any id order:
// the layout TRL, verl and OpenRLHF produce). One streaming pass over the rows: each run's statistics
// are taken in cache (sum in row order, then the squared deviations, exactly as the general path
// does, so the outputs are bit-identical), and the run's id goes into a small per-thread set; an id
// met in a second run means the layout is not grouped-contiguous, and the call falls back to the
// radix path above (which rewrites every output). Rows are split into P chunks whose bounds move
// forward to the next id change, so no run is split; after the pass each chunk's ids are looked up
// in the sets of the chunks before it.

// Threads for n rows (the general path's rule).
inline int threads_for(int64_t n) {
#ifdef _OPENMP
  return static_cast<int>(std::clamp<int64_t>(n / kRowsPerThread, 1, omp_get_max_threads()));
#else
  (void)n;
  return 1;
#endif
}

// TREADLE_GRPO_CONTIGUOUS=0 turns the fast path off (tests compare both paths bit for bit; benchmarks
// show what it saves). Read at every call: ~0.1 us.
inline bool contiguous_fast_path_enabled() {
  const char* v = std::getenv("TREADLE_GRPO_CONTIGUOUS");
  return v == nullptr || !(v[0] == '0' && v[1] == '\0');
}

// Open-addressing set of int64 ids (linear probing, stamps instead of clearing between calls).
struct IdSet {
  struct Slot {
    int64_t id;
    uint32_t stamp;
  };
  std::vector<Slot> slots;
  uint64_t mask = 0;
  uint64_t size = 0;
  uint32_t stamp = 0;
  void reset(int64_t expect) {
    uint64_t cap = 64;
    while (cap < static_cast<uint64_t>(std::min<int64_t>(expect, kTableSlots)) * 2) cap <<= 1;
    if (cap > slots.size()) {
      slots.assign(cap, Slot{0, 0});
      stamp = 0;
    }
    mask = cap - 1;
    size = 0;
    if (++stamp == 0) {
      std::fill(slots.begin(), slots.end(), Slot{0, 0});
      stamp = 1;
    }
  }
  bool contains(int64_t id) const {
    uint64_t s = mix64(static_cast<uint64_t>(id)) & mask;
    while (slots[s].stamp == stamp) {
      if (slots[s].id == id) return true;
      s = (s + 1) & mask;
    }
    return false;
  }
  // Insert; false if the id was already there.
  bool insert(int64_t id) {
    if ((size + 1) * 2 > mask + 1) grow();
    uint64_t s = mix64(static_cast<uint64_t>(id)) & mask;
    while (slots[s].stamp == stamp) {
      if (slots[s].id == id) return false;
      s = (s + 1) & mask;
    }
    slots[s] = Slot{id, stamp};
    ++size;
    return true;
  }
  void grow() {
    std::vector<Slot> old(slots.begin(), slots.begin() + (mask + 1));
    const uint64_t cap = (mask + 1) * 2;
    if (cap > slots.size()) slots.resize(cap);
    std::fill(slots.begin(), slots.begin() + cap, Slot{0, 0});
    mask = cap - 1;
    for (const Slot& o : old) {
      if (o.stamp != stamp) continue;
      uint64_t s = mix64(static_cast<uint64_t>(o.id)) & mask;
      while (slots[s].stamp == stamp) s = (s + 1) & mask;
      slots[s] = o;
    }
  }
  void trim() {
    if (slots.size() > 2 * kTableSlots) {
      slots = std::vector<Slot>();
      mask = size = 0;
      stamp = 0;
    }
  }
};

// Sum of f(i) over considered rows, in the same fixed row blocks (and block order) as blocked_sum.
template <typename Ok, typename F>
double blocked_sum_if(int64_t n, double* partial, Ok ok, F f) {
  const int64_t nblocks = (n + kBlockRows - 1) / kBlockRows;
#pragma omp for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    double s = 0.0;
    for (int64_t i = b * kBlockRows, e = std::min(n, (b + 1) * kBlockRows); i < e; ++i)
      if (ok(i)) s += f(i);
    partial[b] = s;
  }  // implicit barrier
  double s = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) s += partial[b];
#pragma omp barrier
  return s;
}

// First row at or after `i` that starts a run (ids[i] != ids[i - 1]), or n.
inline int64_t run_start_at_or_after(const int64_t* ids, int64_t n, int64_t i) {
  if (i <= 0) return 0;
  while (i < n && ids[i] == ids[i - 1]) ++i;
  return i;
}

// Put the id of every run starting in [lo, hi) into the set (lo starts a run).
inline void insert_run_ids(const int64_t* ids, int64_t lo, int64_t hi, IdSet& set) {
  for (int64_t s = lo; s < hi; ++s)
    if (s == lo || ids[s] != ids[s - 1]) set.insert(ids[s]);
}

// What a chunk of the fast path saw: its runs' ids strictly increase (then no run id went into the
// set: the adapters' first-appearance numbering needs no set at all), first and last run id.
struct ChunkIds {
  bool increasing = true;
  int64_t first = 0, last = 0;
};

// One chunk [lo, hi) of the fast path (lo and hi start runs): per run, the statistics of its considered
// rows in row order, then its advantages. AllOk: no valid mask and no non-finite skipping, so every row
// is considered and the first pass over a run also finds its end. While the run ids strictly increase
// no id can repeat; from the first decrease on, ids go into `set` (the earlier ones first). False when
// an id's run is its second.
template <typename T, bool AllOk, typename Ok>
bool contiguous_chunk(const T* r, const int64_t* ids, int64_t lo, int64_t hi, IdSet& set, ChunkIds& seen, Ok ok,
                      const bool* flags, T* out, double* a, bool need_m2, double batch_std, const Options& o,
                      const std::atomic<bool>& failed_any, bool poll) {
  uint64_t runs = 0;
  if (lo < hi) seen.first = seen.last = ids[lo];
  for (int64_t s = lo; s < hi;) {
    const int64_t id = ids[s];
    double sum = 0.0, first = 0.0;
    uint64_t cnt = 0;
    bool differs = false;
    int64_t e = s + 1;
    if (AllOk) {
      first = static_cast<double>(r[s]);
      sum = first;
      for (; e < hi && ids[e] == id; ++e) {
        const double ri = static_cast<double>(r[e]);
        differs |= ri != first;
        sum += ri;
      }
      cnt = static_cast<uint64_t>(e - s);
    } else {
      while (e < hi && ids[e] == id) ++e;
      for (int64_t i = s; i < e; ++i) {
        if (!ok(i)) continue;
        const double ri = static_cast<double>(r[i]);
        if (cnt == 0) first = ri;
        differs |= ri != first;
        sum += ri;
        ++cnt;
      }
    }
    if (s == lo || (seen.increasing && id > seen.last)) {
      seen.last = id;
    } else {
      if (seen.increasing) {  // first decrease: the set takes the ids so far, then every new one
        seen.increasing = false;
        insert_run_ids(ids, lo, s, set);
      }
      if (!set.insert(id)) return false;
    }
    const double mean = cnt > 0 ? sum / static_cast<double>(cnt) : 0.0;
    double m2 = 0.0;
    if (need_m2 && cnt > 1 && differs) {
      for (int64_t i = s; i < e; ++i) {
        if (!AllOk && !ok(i)) continue;
        const double d = static_cast<double>(r[i]) - mean;
        m2 += d * d;
      }
    }
    const grpo::Affine af = cnt > 0 ? grpo::group_affine(static_cast<double>(cnt), mean, m2, !differs, batch_std, o)
                                    : grpo::Affine{0.0, 0.0};
    for (int64_t i = s; i < e; ++i) {
      double adv = (AllOk || ok(i)) ? (static_cast<double>(r[i]) - af.center) * af.mul : 0.0;
      if (a != nullptr) {
        a[i] = adv;
        continue;
      }
      if (flags != nullptr && flags[i] && adv > 0.0) adv = 0.0;
      out[i] = static_cast<T>(adv);
    }
    if (poll && (++runs & 255) == 0 && failed_any.load(std::memory_order_relaxed)) return true;  // another chunk failed
    s = e;
  }
  return true;
}

// Returns false (having written nothing that the general path does not rewrite) when some id forms
// more than one run.
template <typename T>
bool contiguous_advantages(const T* r, const int64_t* ids, const bool* valid, const bool* flags, T* out, int64_t n,
                           const Options& o, bool skip_nonfinite, int P) {
  const bool whiten = o.estimator == grpo::kReinforceBaseline;
  const bool need_m2 = o.estimator == grpo::kGrpo && o.scale == grpo::kGroup;
  const bool need_batch = o.estimator == grpo::kGrpo && o.scale == grpo::kBatch;
  thread_local Scratch scratch;
  double* a = whiten ? static_cast<double*>(Scratch::get(scratch.adv, scratch.adv_bytes, sizeof(double) * n)) : nullptr;
  std::vector<double> partial((n + kBlockRows - 1) / kBlockRows);
  std::vector<IdSet*> sets(P, nullptr);
  std::vector<int64_t> lo_of(P + 1);
  std::vector<ChunkIds> seen(P);
  std::atomic<bool> failed_any{false};
  auto ok = [&](int64_t i) {
    return (valid == nullptr || valid[i]) && (!skip_nonfinite || std::isfinite(static_cast<double>(r[i])));
  };
  bool contiguous = true;
#pragma omp parallel num_threads(P) if (P > 1)
  {
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
#endif
    thread_local IdSet tls_set;
    IdSet& set = tls_set;
    sets[t] = &set;
    lo_of[t] = run_start_at_or_after(ids, n, n * t / P);
    if (t == 0) lo_of[P] = n;
    double batch_std = 0.0;
    if (need_batch) {
      const double cnt = blocked_sum_if(n, partial.data(), ok, [](int64_t) { return 1.0; });
      const double mean = cnt > 0 ? blocked_sum_if(n, partial.data(), ok, [&](int64_t i) { return static_cast<double>(r[i]); }) / cnt : 0.0;
      const double m2 = blocked_sum_if(n, partial.data(), ok, [&](int64_t i) {
        const double d = static_cast<double>(r[i]) - mean;
        return d * d;
      });
      batch_std = grpo::std_from(m2, cnt, o.unbiased);
    } else {
#pragma omp barrier
    }
    const int64_t lo = lo_of[t], hi = lo_of[t + 1];
    set.reset((hi - lo) / 8);
    ChunkIds& mine = seen[t];
    const bool chunk_ok =
        (valid == nullptr && !skip_nonfinite)
            ? contiguous_chunk<T, true>(r, ids, lo, hi, set, mine, ok, flags, out, a, need_m2, batch_std, o, failed_any, P > 1)
            : contiguous_chunk<T, false>(r, ids, lo, hi, set, mine, ok, flags, out, a, need_m2, batch_std, o, failed_any, P > 1);
    if (!chunk_ok) failed_any.store(true, std::memory_order_relaxed);
#pragma omp barrier
    // Across chunks: nothing to check when the run ids increase over the whole batch; else every
    // chunk's set takes its ids (if the increasing shortcut left it empty) and each chunk looks its
    // ids up in the sets of the chunks before it.
    bool increasing = true;
    int64_t last = 0;
    bool have_last = false;
    for (int u = 0; u < P; ++u) {
      if (lo_of[u] == lo_of[u + 1]) continue;
      increasing &= seen[u].increasing && (!have_last || seen[u].first > last);
      last = seen[u].last;
      have_last = true;
    }
    const bool cross_check = P > 1 && !increasing && !failed_any.load(std::memory_order_relaxed);
    if (cross_check && mine.increasing) insert_run_ids(ids, lo, hi, set);
#pragma omp barrier
    if (cross_check && t > 0) {  // ids of this chunk seen in an earlier chunk?
      bool seen = false;
      for (int64_t s = lo; s < hi && !seen; ++s) {
        if (s > lo && ids[s] == ids[s - 1]) continue;
        for (int u = 0; u < t && !seen; ++u) seen = sets[u]->contains(ids[s]);
      }
      if (seen) failed_any.store(true, std::memory_order_relaxed);
    }
#pragma omp barrier
    const bool failed = failed_any.load(std::memory_order_relaxed);
#pragma omp single nowait
    contiguous = !failed;
    if (!failed && whiten) {  // reinforce_baseline: whiten a over the considered rows (as the general path)
      const double cnt = blocked_sum_if(n, partial.data(), ok, [](int64_t) { return 1.0; });
      const double mean = cnt > 0 ? blocked_sum_if(n, partial.data(), ok, [&](int64_t i) { return a[i]; }) / cnt : 0.0;
      const double m2 = blocked_sum_if(n, partial.data(), ok, [&](int64_t i) {
        const double d = a[i] - mean;
        return d * d;
      });
      const double std = grpo::std_from(m2, cnt, o.unbiased);
      // all considered a equal (e.g. every group all-equal): exactly 0, never 0/0 at eps = 0 (as the general path)
      int64_t first = 0;
      while (first < n && !ok(first)) ++first;
      const double a0 = first < n ? a[first] : 0.0;
      const bool differs = blocked_sum_if(n, partial.data(), ok, [&](int64_t i) { return a[i] != a0 ? 1.0 : 0.0; }) > 0.0;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        double adv = (ok(i) && differs) ? (a[i] - mean) / (std + o.eps) : 0.0;
        if (flags != nullptr && flags[i] && adv > 0.0) adv = 0.0;
        out[i] = static_cast<T>(adv);
      }
    }
    set.trim();
  }
  scratch.trim(n);
  return contiguous;
}

template <typename T, typename RowT>
void advantages_kernel(const T* r, const int64_t* ids, const bool* valid, const bool* flags, T* out,
                       int64_t n, const Options& o, bool skip_nonfinite) {
  using E = Entry<T, RowT>;
  thread_local Scratch scratch;

  // B partitions (a power of two, from the top bits of the hash) of about kRowsPerPartition rows;
  // C fixed row chunks for the partition pass (their number does not depend on the thread count).
  int pbits = 0;
  while (pbits < kMaxPartitionBits && (kRowsPerPartition << pbits) < n) ++pbits;
  const int64_t B = int64_t{1} << pbits;
  const int64_t C = std::clamp<int64_t>(n / kRowsPerChunk, 1, kMaxChunks);
  int P = 1;
#ifdef _OPENMP
  P = static_cast<int>(std::clamp<int64_t>(n / kRowsPerThread, 1, omp_get_max_threads()));
#endif
  const bool whiten = o.estimator == grpo::kReinforceBaseline;
  const bool need_m2 = o.estimator == grpo::kGrpo && o.scale == grpo::kGroup;
  const bool need_batch = o.estimator == grpo::kGrpo && o.scale == grpo::kBatch;

  E* buf = static_cast<E*>(Scratch::get(scratch.entries, scratch.entries_bytes, sizeof(E) * n));
  uint16_t* code = static_cast<uint16_t*>(Scratch::get(scratch.codes, scratch.codes_bytes, sizeof(uint16_t) * n));
  double* a = whiten ? static_cast<double*>(Scratch::get(scratch.adv, scratch.adv_bytes, sizeof(double) * n)) : nullptr;
  // hist[c * B + p]: rows of chunk c in partition p, then that chunk's write offset into buf.
  std::vector<int64_t> hist(static_cast<size_t>(C) * B + B + 1, 0);
  int64_t* bounds = hist.data() + static_cast<size_t>(C) * B;  // partition p = buf[bounds[p], bounds[p+1])
  std::vector<double> partial((n + kBlockRows - 1) / kBlockRows);
  const int shift = pbits == 0 ? 63 : 64 - pbits;  // B == 1: shift by 63 and mask below
  const uint64_t pmask = static_cast<uint64_t>(B - 1);

#pragma omp parallel num_threads(P) if (P > 1)
  {
    // A1: each row's partition (kSkip for rows left out, which get advantage 0 now); per-chunk counts.
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < C; ++c) {
      int64_t* h = hist.data() + static_cast<size_t>(c) * B;
      const int64_t lo = n * c / C, hi = n * (c + 1) / C;
      int64_t last_id = ids[lo];  // runs of one id (contiguous groups) hash once
      uint16_t last_p = static_cast<uint16_t>((mix64(static_cast<uint64_t>(last_id)) >> shift) & pmask);
      for (int64_t i = lo; i < hi; ++i) {
        const bool ok =
            (valid == nullptr || valid[i]) && (!skip_nonfinite || std::isfinite(static_cast<double>(r[i])));
        if (!ok) {
          code[i] = kSkip;
          out[i] = T(0);
          continue;
        }
        if (ids[i] != last_id) {
          last_id = ids[i];
          last_p = static_cast<uint16_t>((mix64(static_cast<uint64_t>(last_id)) >> shift) & pmask);
        }
        code[i] = last_p;
        h[last_p] += 1;
      }
    }  // implicit barrier
#pragma omp single
    {  // exclusive prefix over (partition, chunk): a stable scatter keeps row order within a partition
      int64_t off = 0;
      for (int64_t p = 0; p < B; ++p) {
        bounds[p] = off;
        for (int64_t c = 0; c < C; ++c) {
          const int64_t k = hist[static_cast<size_t>(c) * B + p];
          hist[static_cast<size_t>(c) * B + p] = off;
          off += k;
        }
      }
      bounds[B] = off;
    }  // implicit barrier
    // A2: stable scatter of each chunk's considered rows; the key is the id's bijective hash.
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < C; ++c) {
      int64_t* h = hist.data() + static_cast<size_t>(c) * B;
      const int64_t lo = n * c / C, hi = n * (c + 1) / C;
      int64_t last_id = ids[lo];
      int64_t last_key = static_cast<int64_t>(mix64(static_cast<uint64_t>(last_id)));
      for (int64_t i = lo; i < hi; ++i) {
        const uint16_t p = code[i];
        if (p == kSkip) continue;
        if (ids[i] != last_id) {
          last_id = ids[i];
          last_key = static_cast<int64_t>(mix64(static_cast<uint64_t>(last_id)));
        }
        buf[h[p]++] = E{last_key, static_cast<RowT>(i), r[i]};
      }
    }  // implicit barrier
    const double cnt = static_cast<double>(bounds[B]);  // considered rows
    double batch_std = 0.0;
    if (need_batch) {  // TRL's scale_rewards="batch": std over all considered rows (two-pass)
      const double mean = cnt > 0 ? blocked_sum(code, n, partial.data(), [&](int64_t i) { return static_cast<double>(r[i]); }) / cnt : 0.0;
      const double m2 = blocked_sum(code, n, partial.data(), [&](int64_t i) {
        const double d = static_cast<double>(r[i]) - mean;
        return d * d;
      });
      batch_std = grpo::std_from(m2, cnt, o.unbiased);
    }
    // B: partitions are independent (each group lives in exactly one).
    thread_local LocalTable tls_table;  // per OpenMP worker, kept between calls
    LocalTable& table = tls_table;
#pragma omp for schedule(dynamic, 2)
    for (int64_t p = 0; p < B; ++p) {
      const int64_t m = bounds[p + 1] - bounds[p];
      if (m > 0) partition_advantages(buf + bounds[p], m, table, batch_std, o, need_m2, flags, out, a);
    }  // implicit barrier
    if (whiten) {  // reinforce_baseline: whiten a over the considered rows
      const double mean = cnt > 0 ? blocked_sum(code, n, partial.data(), [&](int64_t i) { return a[i]; }) / cnt : 0.0;
      const double m2 = blocked_sum(code, n, partial.data(), [&](int64_t i) {
        const double d = a[i] - mean;
        return d * d;
      });
      const double std = grpo::std_from(m2, cnt, o.unbiased);
      // all considered a equal (e.g. every group all-equal): exactly 0, never 0/0 at eps = 0
      int64_t first = 0;
      while (first < n && code[first] == kSkip) ++first;
      const double a0 = first < n ? a[first] : 0.0;
      const bool differs = blocked_sum(code, n, partial.data(), [&](int64_t i) { return a[i] != a0 ? 1.0 : 0.0; }) > 0.0;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        double adv = (code[i] == kSkip || !differs) ? 0.0 : (a[i] - mean) / (std + o.eps);
        if (flags != nullptr && flags[i] && adv > 0.0) adv = 0.0;
        out[i] = static_cast<T>(adv);
      }
    }
  }
  scratch.trim(n);
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
  if (n == 0) return out;
  const bool* vp = valid.has_value() ? valid->data_ptr<bool>() : nullptr;
  const bool* fp = flags.has_value() ? flags->data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "grpo_advantages_cpu", [&] {
    if (contiguous_fast_path_enabled() &&
        contiguous_advantages<scalar_t>(rewards.data_ptr<scalar_t>(), group_ids.data_ptr<int64_t>(), vp, fp,
                                        out.data_ptr<scalar_t>(), n, o, skip_nonfinite, threads_for(n)))
      return;
    if (n <= INT32_MAX)
      advantages_kernel<scalar_t, int32_t>(rewards.data_ptr<scalar_t>(), group_ids.data_ptr<int64_t>(), vp, fp,
                                           out.data_ptr<scalar_t>(), n, o, skip_nonfinite);
    else
      advantages_kernel<scalar_t, int64_t>(rewards.data_ptr<scalar_t>(), group_ids.data_ptr<int64_t>(), vp, fp,
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

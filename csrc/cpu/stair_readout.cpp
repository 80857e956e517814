// C++ CPU kernel of treadle.ops.stair_readout (spec: python/treadle/reference/stair.py; maths:
// DESIGN.md "STAIR", STAIR sec. 3.4 / 4.4).
//
// Forward: one pass over the bank in tiles of BK keys per (batch, head, query tile of BQ rows).
// Per tile, S = scale * Q K^T is one GEMM; the reflection logit t_ij = alpha_i * beta_j (alpha =
// u . q, beta = -2 scale u . k) is a rank-1 correction of the same tile, so three online-softmax
// accumulators run side by side: over s (pi_ref), over x = s + t (pi_R when eps = 0) and, when
// eps > 0, over t (the uniform part of pi_ref reweighted by e^t). Their probability rows are stacked
// so that one GEMM P V updates all accumulators. Nothing of size T x M is ever materialised.
// At eps = 0 this is 6 T M D FLOPs (S, then P V with twice the rows) against 8 T M D for two
// attention calls; GEMMs are ~80% of the time, so the element-wise tile work is kept to one pass
// (running maxima kept while a tile exceeds them by at most kLazyMax) and one exp per probability.
//
// Backward (flash-attention style): tiles are recomputed from the saved row statistics
// (lse_s = log sum e^s, logZ = log sum_j pi_ref_j e^{t_j}) and two saved row vectors per query
// (O_R and Y, below), so dO enters only through G = dO V^T (one GEMM per tile) and two per-row dot
// products. With out = a O_R + b O_ref ((a, b) = (1, -1) diff, (1, 0) reflected, (0, 1) reference),
// p = softmax(s), PE_j = p_j e^{t_j} / Z, E_j = e^{t_j} / Z:
//   dT_j = a pi_R_j (G_j - dO.O_R)                       (pi_R_j = (1-eps) PE_j + eps/L E_j)
//   dS_j = (1-eps) [ b p_j G_j + a PE_j (G_j - dO.O_R) - p_j dO.Y ],
//   Y    = b O_s + a (W - w O_R),  O_s = sum p v,  W = sum PE v,  w = sum PE
// (dO.Y is sum_j p_j dL/dpi_ref_j, the softmax-backward row term). Then
//   dq   = scale dS K + dalpha u,       dalpha_i = sum_j dT_ij beta_j
//   du   = sum_i dalpha_i q_i - 2 scale sum_j (sum_i alpha_i dT_ij) k_j,
//   dn   = (du - u (u . du)) / ||n||.
// Three GEMMs per tile (S, G, dS K): 6 T M D FLOPs, the bank gets no gradient.
//
// GEMMs go to the BLAS that torch links (MKL's sgemm_/dgemm_, called single-threaded inside the
// parallel region); if the symbol is absent a plain loop is used. The elementwise tile work is
// written with GCC vector extensions (16 lanes) and compiled for AVX-512 / AVX2 / baseline with
// function multiversioning, so the extension still loads on any x86-64 (and builds elsewhere).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*) __attribute__((weak));
}

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)  // ifunc-based multiversioning
#define TREADLE_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TREADLE_MULTIVERSION
#endif
#define TREADLE_INLINE inline __attribute__((always_inline))

namespace treadle {
namespace {

// Forward tiles: up to kBQ query rows per task (fewer when that would leave threads idle, see
// forward_query_tile) against kBK bank keys per tile. 256 x 512 is the shape torch's own CPU flash
// attention uses for long sequences: MKL's sgemm reaches ~10% more FLOP/s on it than on 128 x 256.
#ifndef TREADLE_STAIR_BQ
#define TREADLE_STAIR_BQ 256
#endif
#ifndef TREADLE_STAIR_BK
#define TREADLE_STAIR_BK 512
#endif
constexpr int64_t kBQ = TREADLE_STAIR_BQ;  // most query rows per forward task
constexpr int64_t kBK = TREADLE_STAIR_BK;  // bank keys per forward tile
// Backward tiles (three GEMMs and two tile-sized buffers per step).
constexpr int64_t kBQb = 128;
constexpr int64_t kBKb = 256;

// Query rows per forward task: kBQ, halved (down to 32) while that leaves fewer than four tasks per
// thread. Row results do not depend on it (each row's arithmetic is the same in any query tile).
inline int64_t forward_query_tile(int64_t BH, int64_t T) {
  const int64_t want = 4 * (int64_t)at::get_num_threads();
  int64_t bq = kBQ;
  while (bq > 32 && BH * ((T + bq - 1) / bq) < want) bq /= 2;
  return bq;
}

// ---------------------------------------------------------------------------------------------
// column-major GEMM: C (m x n) = alpha op(A) op(B) + beta C
template <typename T>
void gemm_plain(char ta, char tb, int m, int n, int k, T alpha, const T* A, int lda, const T* B, int ldb, T beta,
                T* C, int ldc) {
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      T acc = 0;
      for (int p = 0; p < k; ++p) {
        const T av = ta == 'N' ? A[i + (int64_t)p * lda] : A[p + (int64_t)i * lda];
        const T bv = tb == 'N' ? B[p + (int64_t)j * ldb] : B[j + (int64_t)p * ldb];
        acc += av * bv;
      }
      T& c = C[i + (int64_t)j * ldc];
      c = alpha * acc + (beta == T(0) ? T(0) : beta * c);
    }
  }
}

inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
  if (m == 0 || n == 0) return;
  if (sgemm_ != nullptr && k > 0) {
    sgemm_(&ta, &tb, &m, &n, &k, &alpha, A, &lda, B, &ldb, &beta, C, &ldc);
  } else {
    gemm_plain<float>(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

inline void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* A, int lda, const double* B,
                 int ldb, double beta, double* C, int ldc) {
  if (m == 0 || n == 0) return;
  if (dgemm_ != nullptr && k > 0) {
    dgemm_(&ta, &tb, &m, &n, &k, &alpha, A, &lda, B, &ldb, &beta, C, &ldc);
  } else {
    gemm_plain<double>(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

// Row-major helpers (all matrices row-major, leading dimension = row stride):
// C (r x c) = A (r x kk) . B^T, B is (c x kk)
template <typename T>
inline void mm_abt(int r, int c, int kk, const T* A, int lda, const T* B, int ldb, T* C, int ldc) {
  gemm('T', 'N', c, r, kk, T(1), B, ldb, A, lda, T(0), C, ldc);
}
// C (r x c) (+)= A (r x kk) . B, B is (kk x c)
template <typename T>
inline void mm_ab(int r, int c, int kk, const T* A, int lda, const T* B, int ldb, T beta, T* C, int ldc) {
  gemm('N', 'N', c, r, kk, T(1), B, ldb, A, lda, beta, C, ldc);
}

// ---------------------------------------------------------------------------------------------
// 16-lane float vectors (GCC/Clang vector extensions)
constexpr int VL = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

TREADLE_INLINE vf vsplat(float x) { return vf{} + x; }
TREADLE_INLINE vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
TREADLE_INLINE void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
TREADLE_INLINE vf vload_tail(const float* p, int n, float fill) {
  alignas(64) float tmp[VL];
  for (int l = 0; l < VL; ++l) tmp[l] = l < n ? p[l] : fill;
  return vload(tmp);
}
TREADLE_INLINE void vstore_tail(float* p, vf v, int n) {
  alignas(64) float tmp[VL];
  vstore(tmp, v);
  for (int l = 0; l < n; ++l) p[l] = tmp[l];
}
TREADLE_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }
TREADLE_INLINE float hmax(vf v) {
  float m = v[0];
  for (int l = 1; l < VL; ++l) m = v[l] > m ? v[l] : m;
  return m;
}
TREADLE_INLINE float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < VL; ++l) s += v[l];
  return s;
}
TREADLE_INLINE vf lane_mask(int n) {  // 1 for lanes < n, else 0
  vf m;
  for (int l = 0; l < VL; ++l) m[l] = l < n ? 1.f : 0.f;
  return m;
}
// Cephes expf's core: e^x = 2^n e^r with n = fx = round(x / ln 2) already computed, r = x - n ln 2
// (in two steps, for precision) and e^r a degree-6 polynomial; returns e^r (the caller scales by 2^n).
TREADLE_INLINE vf vexp_reduced(vf x, vf fx) {
  x = x - fx * 0.693359375f;
  x = x + fx * 2.12194440e-4f;
  vf y = vsplat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  return y * (x * x) + x + 1.0f;
}

// exp(x) to ~2 ulp (Cephes expf): round x / ln 2, reduce, degree-6 polynomial, scale by 2^n.
// Inputs below -87.3 give ~1e-38 (callers mask such lanes when exactness matters).
TREADLE_INLINE vf vexp(vf x) {
  const vf hi = vsplat(88.0f), lo = vsplat(-87.3f);
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const vf fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest integer
  const vi e = (__builtin_convertvector(fx, vi) + 127) << 23;
  return vexp_reduced(x, fx) * (vf)e;  // same-size vector cast: a bit reinterpretation
}

// exp(x) for arguments that are <= 88 or whose result is discarded (the forward tiles: x - max <= 0,
// or <= kLazyMax on rows that are kept): vexp without the upper clamp, 2^n from the bits of the
// rounding sum (its low mantissa bits hold n) rather than a float-to-int conversion.
TREADLE_INLINE vf vexp_fwd(vf x) {
  const vf lo = vsplat(-87.3f);
  x = x < lo ? lo : x;
  const vf r = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23 + n
  const vi e = ((vi)r + (127 - 0x4B400000)) << 23;      // (n + 127) << 23: the float 2^n
  return vexp_reduced(x, r - 12582912.0f) * (vf)e;
}

// The float forward tile keeps a row's running maxima while a new tile's maxima exceed them by at most
// kLazyMax (probabilities then reach e^8 ~ 3e3 before normalisation: far from float32 overflow; the
// ratios, hence the results, are the same): one pass over the tile instead of a max pass and an exp
// pass, and no accumulator rescale. A larger jump (and every row's first tile) takes the two passes.
constexpr float kLazyMax = 8.0f;

// The three lane vectors of a forward tile row, one per probability row of P: s (pi_ref), x = s + t
// (pi_R at eps = 0), t (eps > 0).
struct V3 {
  vf s, x, t;
};

// 16 lanes [j, j + VL) of a forward tile row (kTail: only the first n are keys; the others read s as
// -inf and t as 0, stay out of t's maximum, give exps of 0 and are not stored). With t = alpha beta,
// x = s + t: kMax takes the lane maxima of s, x (and t, use_t) into mx; kExp stores e^{s - m.s} to
// out_s, e^{x - m.x} to out_x (and e^{t - m.t} to out_t, use_t) and adds them into sum.
template <bool kMax, bool kExp, bool kTail>
TREADLE_INLINE void fwd_lanes(int j, int n, const float* s, const float* beta, float al, bool use_t, const V3& m,
                              float* out_s, float* out_x, float* out_t, V3& mx, V3& sum) {
  const float NEG = -std::numeric_limits<float>::infinity();
  const vf sv = kTail ? vload_tail(s + j, n, NEG) : vload(s + j);
  const vf tv = (kTail ? vload_tail(beta + j, n, 0.f) : vload(beta + j)) * al, xv = sv + tv;
  const vf keep = kTail ? lane_mask(n) : vsplat(1.f);
  if (kMax) {
    mx.s = vmax(mx.s, sv);
    mx.x = vmax(mx.x, xv);
    if (use_t) mx.t = vmax(mx.t, kTail ? (keep > 0.f ? tv : vsplat(NEG)) : tv);
  }
  if (kExp) {
    auto emit = [&](vf e, float* out, vf& acc) __attribute__((always_inline)) {
      if (kTail) {
        e *= keep;
        vstore_tail(out + j, e, n);
      } else {
        vstore(out + j, e);
      }
      acc += e;
    };
    emit(vexp_fwd(sv - m.s), out_s, sum.s);
    emit(vexp_fwd(xv - m.x), out_x, sum.x);
    if (use_t) emit(vexp_fwd(tv - m.t), out_t, sum.t);
  }
}

// One sweep of fwd_lanes over a tile row of nk scores s.
template <bool kMax, bool kExp>
TREADLE_INLINE void fwd_sweep(int nk, const float* s, const float* beta, float al, bool use_t, const V3& m,
                              float* out_s, float* out_x, float* out_t, V3& mx, V3& sum) {
  const int nfull = nk / VL * VL;
  for (int j = 0; j < nfull; j += VL) {
    fwd_lanes<kMax, kExp, false>(j, VL, s, beta, al, use_t, m, out_s, out_x, out_t, mx, sum);
  }
  if (nk > nfull) {
    fwd_lanes<kMax, kExp, true>(nfull, nk - nfull, s, beta, al, use_t, m, out_s, out_x, out_t, mx, sum);
  }
}

// Forward tile, float. S: nq x nk scores (row stride ld). Writes stacked probability rows into P
// (row stride ld): rows [0, nq) e^{s - m_s}, [nq, 2nq) e^{x - m_x}, [2nq, 3nq) e^{t - m_t} (use_t).
// Updates maxima/sums and writes the per-row rescale factors of the accumulators into corr
// (same row order as P). Returns whether any factor differs from 1 (else the rescale is skipped).
// A row whose running maxima exist is first swept once against them (exps into the scratch row E,
// the scores kept); when no maximum of the tile exceeds its running one by more than kLazyMax, that
// sweep is the result (factors 1). Otherwise, and on a row's first tile, two sweeps: the maxima, then
// the exps against the new maxima, written over the scores in place (each lane read before written).
TREADLE_MULTIVERSION
bool fwd_tile_f32(int nq, int nk, int ld, float* P, const float* beta, const float* alpha, bool use_t, float* E,
                  float* m_s, float* l_s, float* m_x, float* l_x, float* m_t, float* l_t, float* corr) {
  const float NEG = -std::numeric_limits<float>::infinity();
  const V3 none = {vsplat(NEG), vsplat(NEG), vsplat(NEG)};
  bool rescale = false;
  for (int i = 0; i < nq; ++i) {
    float* ps = P + (int64_t)i * ld;  // scores on entry, e^{s - m_s} on return
    float* px = P + (int64_t)(nq + i) * ld;
    float* pt = P + (int64_t)(2 * nq + i) * ld;
    const float al = alpha[i];
    float ms = m_s[i], mx = m_x[i], mt = use_t ? m_t[i] : 0.f, cs = 1.f, cx = 1.f, ct = 1.f;
    V3 tmax = none, sum = {};
    bool one_pass = false;
    if (ms != NEG && (!use_t || mt != NEG)) {
      fwd_sweep<true, true>(nk, ps, beta, al, use_t, V3{vsplat(ms), vsplat(mx), vsplat(mt)}, E, px, pt, tmax, sum);
      one_pass = hmax(tmax.s) <= ms + kLazyMax && hmax(tmax.x) <= mx + kLazyMax &&
                 (!use_t || hmax(tmax.t) <= mt + kLazyMax);
      if (one_pass) std::memcpy(ps, E, sizeof(float) * nk);
    }
    if (!one_pass) {
      tmax = none;
      sum = V3{};
      fwd_sweep<true, false>(nk, ps, beta, al, use_t, none, nullptr, nullptr, nullptr, tmax, sum);
      ms = std::max(m_s[i], hmax(tmax.s));
      mx = std::max(m_x[i], hmax(tmax.x));
      mt = use_t ? std::max(m_t[i], hmax(tmax.t)) : 0.f;
      cs = m_s[i] == NEG ? 0.f : std::exp(m_s[i] - ms);
      cx = m_x[i] == NEG ? 0.f : std::exp(m_x[i] - mx);
      ct = (!use_t || m_t[i] == NEG) ? 0.f : std::exp(m_t[i] - mt);
      rescale |= cs != 1.f || cx != 1.f || (use_t && ct != 1.f);
      fwd_sweep<false, true>(nk, ps, beta, al, use_t, V3{vsplat(ms), vsplat(mx), vsplat(mt)}, ps, px, pt, tmax, sum);
    }
    l_s[i] = l_s[i] * cs + hsum(sum.s);
    l_x[i] = l_x[i] * cx + hsum(sum.x);
    m_s[i] = ms;
    m_x[i] = mx;
    corr[i] = cs;
    corr[nq + i] = cx;
    if (use_t) {
      l_t[i] = l_t[i] * ct + hsum(sum.t);
      m_t[i] = mt;
      corr[2 * nq + i] = ct;
    }
  }
  return rescale;
}

// Backward tile, float. In: S (scores s), G (dO V^T), both nq x nk with row stride ld. Out: S is
// overwritten with scale * dS; colsum_j += sum_i alpha_i dT_ij; dalpha_i += sum_j dT_ij beta_j.
TREADLE_MULTIVERSION
void bwd_tile_f32(int nq, int nk, int ld, float* S, const float* G, const float* beta, const float* alpha,
                  const float* lse, const float* logZ, const float* gOR, const float* gY, float a, float b, float ome,
                  float epsL, float scale, float* colsum, float* dalpha) {
  const int nfull = nk / VL * VL, rem = nk - nfull;
  const vf tailmask = lane_mask(rem);
  const bool use_r = a != 0.f, use_e = use_r && epsL != 0.f;
  for (int i = 0; i < nq; ++i) {
    float* s = S + (int64_t)i * ld;
    const float* g = G + (int64_t)i * ld;
    const float al = alpha[i];
    const vf vlse = vsplat(lse[i]), vz = vsplat(logZ[i]);
    const vf vgor = vsplat(gOR[i]), vgy = vsplat(gY[i]);
    vf da = vf{};
    auto body = [&](vf sv, vf gv, vf bv, vf msk, vf& ds_out, vf& dt_out) __attribute__((always_inline)) {
      const vf tv = bv * al;
      const vf p = vexp(sv - vlse) * msk;
      vf ds = b * p * gv - p * vgy;
      vf dt = vf{};
      if (use_r) {
        const vf pe = vexp((sv - vlse) + (tv - vz)) * msk;  // two near-exact differences
        const vf gr = gv - vgor;
        ds += a * pe * gr;
        vf pr = ome * pe;
        if (use_e) pr += epsL * (vexp(tv - vz) * msk);
        dt = a * pr * gr;
      }
      ds_out = ds * (ome * scale);
      dt_out = dt;
    };
    const vf one = vsplat(1.f);
    for (int j = 0; j < nfull; j += VL) {
      vf ds, dt;
      const vf bv = vload(beta + j);
      body(vload(s + j), vload(g + j), bv, one, ds, dt);
      vstore(s + j, ds);
      vstore(colsum + j, vload(colsum + j) + dt * al);
      da += dt * bv;
    }
    if (rem) {
      vf ds, dt;
      const vf bv = vload_tail(beta + nfull, rem, 0.f);
      body(vload_tail(s + nfull, rem, 0.f), vload_tail(g + nfull, rem, 0.f), bv, tailmask, ds, dt);
      vstore_tail(s + nfull, ds, rem);
      vstore_tail(colsum + nfull, vload_tail(colsum + nfull, rem, 0.f) + dt * al, rem);
      da += dt * bv;
    }
    dalpha[i] += hsum(da);
  }
}

// Generic (double) versions: scalar loops, same maths.
template <typename T>
bool fwd_tile_generic(int nq, int nk, int ld, T* P, const T* beta, const T* alpha, bool use_t, T* m_s,
                      T* l_s, T* m_x, T* l_x, T* m_t, T* l_t, T* corr) {
  const T NEG = -std::numeric_limits<T>::infinity();
  for (int i = 0; i < nq; ++i) {
    const T* s = P + (int64_t)i * ld;  // scores, overwritten in place (each read before its write)
    T ms = m_s[i], mx = m_x[i], mt = m_t[i];
    for (int j = 0; j < nk; ++j) {
      const T t = alpha[i] * beta[j];
      ms = std::max(ms, s[j]);
      mx = std::max(mx, s[j] + t);
      mt = std::max(mt, t);
    }
    const T cs = m_s[i] == NEG ? T(0) : std::exp(m_s[i] - ms);
    const T cx = m_x[i] == NEG ? T(0) : std::exp(m_x[i] - mx);
    const T ct = (!use_t || m_t[i] == NEG) ? T(0) : std::exp(m_t[i] - mt);
    T ss = 0, sx = 0, st = 0;
    for (int j = 0; j < nk; ++j) {
      const T t = alpha[i] * beta[j];
      const T es = std::exp(s[j] - ms), ex = std::exp(s[j] + t - mx);
      P[(int64_t)i * ld + j] = es;
      P[(int64_t)(nq + i) * ld + j] = ex;
      ss += es;
      sx += ex;
      if (use_t) {
        const T et = std::exp(t - mt);
        P[(int64_t)(2 * nq + i) * ld + j] = et;
        st += et;
      }
    }
    l_s[i] = l_s[i] * cs + ss;
    l_x[i] = l_x[i] * cx + sx;
    m_s[i] = ms;
    m_x[i] = mx;
    corr[i] = cs;
    corr[nq + i] = cx;
    if (use_t) {
      l_t[i] = l_t[i] * ct + st;
      m_t[i] = mt;
      corr[2 * nq + i] = ct;
    }
  }
  return true;
}

template <typename T>
void bwd_tile_generic(int nq, int nk, int ld, T* S, const T* G, const T* beta, const T* alpha, const T* lse,
                      const T* logZ, const T* gOR, const T* gY, T a, T b, T ome, T epsL, T scale, T* colsum,
                      T* dalpha) {
  for (int i = 0; i < nq; ++i) {
    T* s = S + (int64_t)i * ld;
    const T* g = G + (int64_t)i * ld;
    T da = 0;
    for (int j = 0; j < nk; ++j) {
      const T t = alpha[i] * beta[j];
      const T p = std::exp(s[j] - lse[i]);
      T ds = b * p * g[j] - p * gY[i], dt = 0;
      if (a != T(0)) {
        const T pe = std::exp((s[j] - lse[i]) + (t - logZ[i]));
        const T gr = g[j] - gOR[i];
        ds += a * pe * gr;
        T pr = ome * pe;
        if (epsL != T(0)) pr += epsL * std::exp(t - logZ[i]);
        dt = a * pr * gr;
      }
      s[j] = ds * ome * scale;
      colsum[j] += alpha[i] * dt;
      da += dt * beta[j];
    }
    dalpha[i] += da;
  }
}

inline bool fwd_tile(int nq, int nk, int ld, float* P, const float* beta, const float* alpha, bool use_t, float* E,
                     float* m_s, float* l_s, float* m_x, float* l_x, float* m_t, float* l_t, float* corr) {
  return fwd_tile_f32(nq, nk, ld, P, beta, alpha, use_t, E, m_s, l_s, m_x, l_x, m_t, l_t, corr);
}
inline bool fwd_tile(int nq, int nk, int ld, double* P, const double* beta, const double* alpha, bool use_t,
                     double* /*E*/, double* m_s, double* l_s, double* m_x, double* l_x, double* m_t, double* l_t,
                     double* corr) {
  return fwd_tile_generic<double>(nq, nk, ld, P, beta, alpha, use_t, m_s, l_s, m_x, l_x, m_t, l_t, corr);
}
inline void bwd_tile(int nq, int nk, int ld, float* S, const float* G, const float* beta, const float* alpha,
                     const float* lse, const float* logZ, const float* gOR, const float* gY, float a, float b,
                     float ome, float epsL, float scale, float* colsum, float* dalpha) {
  bwd_tile_f32(nq, nk, ld, S, G, beta, alpha, lse, logZ, gOR, gY, a, b, ome, epsL, scale, colsum, dalpha);
}
inline void bwd_tile(int nq, int nk, int ld, double* S, const double* G, const double* beta, const double* alpha,
                     const double* lse, const double* logZ, const double* gOR, const double* gY, double a, double b,
                     double ome, double epsL, double scale, double* colsum, double* dalpha) {
  bwd_tile_generic<double>(nq, nk, ld, S, G, beta, alpha, lse, logZ, gOR, gY, a, b, ome, epsL, scale, colsum,
                           dalpha);
}

// ---------------------------------------------------------------------------------------------
struct Prep {
  at::Tensor q, k, v, u, nrm, alpha, beta, vbar;  // acc dtype, contiguous
  std::vector<int64_t> len;
  int64_t B, Hq, Hkv, T, M, D, Dv, group;
};

Prep prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& n,
             const c10::optional<at::Tensor>& lengths, double eps, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && n.dim() == 2, "stair_readout: bad ranks");
  Prep p;
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.T = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.M = k.size(2);
  p.Dv = v.size(3);
  TORCH_CHECK(p.Hkv > 0 && p.Hq % p.Hkv == 0, "stair_readout: Hq must be a multiple of Hkv");
  p.group = p.Hq / p.Hkv;
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  p.q = q.to(acc).contiguous();
  p.k = k.to(acc).contiguous();
  p.v = v.to(acc).contiguous();
  auto nf = n.to(acc);
  p.nrm = nf.norm(2, -1, true);                          // (Hq, 1)
  p.u = (nf / p.nrm).contiguous();                       // (Hq, D)
  p.alpha = at::matmul(p.q, p.u.unsqueeze(-1)).squeeze(-1).contiguous();  // (B, Hq, T)
  auto ug = p.u.view({p.Hkv, p.group, p.D}).transpose(1, 2);              // (Hkv, D, g)
  p.beta = (at::matmul(p.k, ug).permute({0, 1, 3, 2}).reshape({p.B, p.Hq, p.M}) * (-2.0 * scale)).contiguous();
  p.len.assign(p.B, p.M);
  if (lengths.has_value() && lengths->defined()) {
    auto l = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(l.numel() == p.B, "stair_readout: bank_lengths must have B entries");
    const int64_t* lp = l.data_ptr<int64_t>();
    for (int64_t b = 0; b < p.B; ++b) {
      TORCH_CHECK(lp[b] >= 0 && lp[b] <= p.M, "stair_readout: bank_lengths out of range");
      p.len[b] = lp[b];
    }
  }
  if (eps > 0.0) {
    p.vbar = at::zeros({p.B, p.Hkv, p.Dv}, p.v.options());
    for (int64_t b = 0; b < p.B; ++b) {
      if (p.len[b] > 0) p.vbar[b].copy_(p.v[b].narrow(1, 0, p.len[b]).mean(1));
    }
  }
  return p;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(const Prep& p, double eps, double scale, double a_,
                                                            double b_) {
  const int64_t B = p.B, Hq = p.Hq, T_ = p.T, M = p.M, D = p.D, Dv = p.Dv;
  auto opts = p.q.options();
  auto out = at::empty({B, Hq, T_, Dv}, opts);
  auto rows = at::empty({B, Hq, T_, 2, Dv}, opts);
  auto stats = at::empty({B, Hq, T_, 2}, opts);
  const T* qp = p.q.data_ptr<T>();
  const T* kp = p.k.data_ptr<T>();
  const T* vp = p.v.data_ptr<T>();
  const T* alp = p.alpha.data_ptr<T>();
  const T* bep = p.beta.data_ptr<T>();
  const T* vbp = eps > 0.0 ? p.vbar.data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  T* rp = rows.data_ptr<T>();
  T* sp = stats.data_ptr<T>();
  const bool use_t = eps > 0.0;
  const int ncomp = use_t ? 3 : 2;
  const int64_t bq = forward_query_tile(B * Hq, T_);
  const int64_t nqt = (T_ + bq - 1) / bq;
  const T a = (T)a_, b = (T)b_, ome = (T)(1.0 - eps);
  const T NEG = -std::numeric_limits<T>::infinity();

  // Per-thread buffers, sized to the rows and keys actually used (peak memory is part of the op's
  // contract, see bench/guard.py): P holds the scores in its first nq rows before the tile turns them
  // into probabilities in place; E is one row of scratch for the one-pass path.
  const int64_t nrow = std::min(bq, T_), bk = std::max<int64_t>(1, std::min(kBK, M));
  at::parallel_for(0, B * Hq * nqt, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> Qs(nrow * D), P(ncomp * nrow * bk), E(bk), A(ncomp * nrow * Dv), corr(ncomp * nrow);
    std::vector<T> m_s(nrow), l_s(nrow), m_x(nrow), l_x(nrow), m_t(nrow), l_t(nrow);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qt = task % nqt, bh = task / nqt, h = bh % Hq, bb = bh / Hq, kvh = h / p.group;
      const int64_t i0 = qt * bq;
      const int nq = (int)std::min(bq, T_ - i0);
      const int64_t L = p.len[bb];
      const int64_t rowbase = bh * T_ + i0;
      if (L == 0) {
        std::fill(op + rowbase * Dv, op + (rowbase + nq) * Dv, T(0));
        std::fill(rp + rowbase * 2 * Dv, rp + (rowbase + nq) * 2 * Dv, T(0));
        std::fill(sp + rowbase * 2, sp + (rowbase + nq) * 2, T(0));
        continue;
      }
      const T* qrow = qp + rowbase * D;
      for (int64_t e = 0; e < nq * D; ++e) Qs[e] = qrow[e] * (T)scale;
      const T* al = alp + rowbase;
      const T* be = bep + bh * M;
      const T* kb = kp + (bb * p.Hkv + kvh) * M * D;
      const T* vb = vp + (bb * p.Hkv + kvh) * M * Dv;
      std::fill(m_s.begin(), m_s.end(), NEG);
      std::fill(m_x.begin(), m_x.end(), NEG);
      std::fill(m_t.begin(), m_t.end(), NEG);
      std::fill(l_s.begin(), l_s.end(), T(0));
      std::fill(l_x.begin(), l_x.end(), T(0));
      std::fill(l_t.begin(), l_t.end(), T(0));
      std::fill(A.begin(), A.begin() + ncomp * nq * Dv, T(0));
      for (int64_t j0 = 0; j0 < L; j0 += bk) {
        const int nk = (int)std::min(bk, L - j0);
        mm_abt<T>(nq, nk, (int)D, Qs.data(), (int)D, kb + j0 * D, (int)D, P.data(), (int)bk);
        const bool rescale = fwd_tile(nq, nk, (int)bk, P.data(), be + j0, al, use_t, E.data(), m_s.data(),
                                      l_s.data(), m_x.data(), l_x.data(), m_t.data(), l_t.data(), corr.data());
        if (j0 > 0 && rescale) {
          for (int r = 0; r < ncomp * nq; ++r) {
            T* ar = A.data() + (int64_t)r * Dv;
            const T c = corr[r];
            for (int64_t d = 0; d < Dv; ++d) ar[d] *= c;
          }
        }
        mm_ab<T>(ncomp * nq, (int)Dv, nk, P.data(), (int)bk, vb + j0 * Dv, (int)Dv, T(1), A.data(), (int)Dv);
      }
      const T* vbar = use_t ? vbp + (bb * p.Hkv + kvh) * Dv : nullptr;
      for (int i = 0; i < nq; ++i) {
        const T lse = m_s[i] + std::log(l_s[i]);
        const T* As = A.data() + (int64_t)i * Dv;
        const T* Ax = A.data() + (int64_t)(nq + i) * Dv;
        const T* At = A.data() + (int64_t)(2 * nq + i) * Dv;
        T logZ, cx, ct = 0, cw, w;
        if (!use_t) {
          logZ = m_x[i] + std::log(l_x[i]) - lse;
          cx = T(1) / l_x[i];
          cw = cx;
          w = 1;
        } else {
          const T l1 = std::log1p(-(T)eps) + m_x[i] + std::log(l_x[i]) - lse;
          const T l2 = std::log((T)eps / (T)L) + m_t[i] + std::log(l_t[i]);
          const T mm = std::max(l1, l2);
          logZ = mm + std::log(std::exp(l1 - mm) + std::exp(l2 - mm));
          cx = std::exp(l1 - logZ) / l_x[i];
          ct = std::exp(l2 - logZ) / l_t[i];
          cw = std::exp(m_x[i] - lse - logZ);
          w = cw * l_x[i];
        }
        const T inv_ls = T(1) / l_s[i];
        T* o = op + (rowbase + i) * Dv;
        T* oR = rp + (rowbase + i) * 2 * Dv;
        T* y = oR + Dv;
        for (int64_t d = 0; d < Dv; ++d) {
          const T os = As[d] * inv_ls;
          const T orr = cx * Ax[d] + (use_t ? ct * At[d] : T(0));
          const T oref = use_t ? ome * os + (T)eps * vbar[d] : os;
          const T W = cw * Ax[d];
          o[d] = a * orr + b * oref;
          oR[d] = orr;
          y[d] = b * os + a * (W - w * orr);
        }
        sp[(rowbase + i) * 2] = lse;
        sp[(rowbase + i) * 2 + 1] = logZ;
      }
    }
  });
  return {out, rows, stats};
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> backward_impl(const Prep& p, const at::Tensor& dout_, const at::Tensor& rows_,
                                                 const at::Tensor& stats_, double eps, double scale, double a_,
                                                 double b_) {
  const int64_t B = p.B, Hq = p.Hq, T_ = p.T, M = p.M, D = p.D, Dv = p.Dv;
  auto acc = p.q.scalar_type();
  auto dout = dout_.to(acc).contiguous();
  auto rows = rows_.to(acc).contiguous();
  auto stats = stats_.to(acc).contiguous();
  const int64_t nqt = (T_ + kBQb - 1) / kBQb;
  auto dq = at::empty({B, Hq, T_, D}, p.q.options());
  auto dupart = at::zeros({B, Hq, nqt, D}, p.q.options());
  const T* qp = p.q.data_ptr<T>();
  const T* kp = p.k.data_ptr<T>();
  const T* vp = p.v.data_ptr<T>();
  const T* up = p.u.data_ptr<T>();
  const T* alp = p.alpha.data_ptr<T>();
  const T* bep = p.beta.data_ptr<T>();
  const T* dop = dout.data_ptr<T>();
  const T* rp = rows.data_ptr<T>();
  const T* sp = stats.data_ptr<T>();
  T* dqp = dq.data_ptr<T>();
  T* dup = dupart.data_ptr<T>();
  const T a = (T)a_, b = (T)b_, ome = (T)(1.0 - eps), sc = (T)scale;

  at::parallel_for(0, B * Hq * nqt, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> Qs(kBQb * D), S(kBQb * kBKb), G(kBQb * kBKb), dQ(kBQb * D), colsum(kBKb), dalpha(kBQb);
    std::vector<T> lse(kBQb), logZ(kBQb), gOR(kBQb), gY(kBQb);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qt = task % nqt, bh = task / nqt, h = bh % Hq, bb = bh / Hq, kvh = h / p.group;
      const int64_t i0 = qt * kBQb;
      const int nq = (int)std::min(kBQb, T_ - i0);
      const int64_t L = p.len[bb];
      const int64_t rowbase = bh * T_ + i0;
      T* dqrow = dqp + rowbase * D;
      if (L == 0) {
        std::fill(dqrow, dqrow + (int64_t)nq * D, T(0));
        continue;
      }
      const T* qrow = qp + rowbase * D;
      const T* dorow = dop + rowbase * Dv;
      for (int64_t e = 0; e < nq * D; ++e) Qs[e] = qrow[e] * sc;
      for (int i = 0; i < nq; ++i) {
        const T* oR = rp + (rowbase + i) * 2 * Dv;
        const T* y = oR + Dv;
        const T* g = dorow + (int64_t)i * Dv;
        T s1 = 0, s2 = 0;
        for (int64_t d = 0; d < Dv; ++d) {
          s1 += g[d] * oR[d];
          s2 += g[d] * y[d];
        }
        gOR[i] = s1;
        gY[i] = s2;
        lse[i] = sp[(rowbase + i) * 2];
        logZ[i] = sp[(rowbase + i) * 2 + 1];
        dalpha[i] = 0;
      }
      const T* al = alp + rowbase;
      const T* be = bep + bh * M;
      const T* kb = kp + (bb * p.Hkv + kvh) * M * D;
      const T* vb = vp + (bb * p.Hkv + kvh) * M * Dv;
      const T epsL = eps > 0.0 ? (T)(eps / (double)L) : T(0);
      T* du = dup + task * D;
      std::fill(dQ.begin(), dQ.begin() + (int64_t)nq * D, T(0));
      for (int64_t j0 = 0; j0 < L; j0 += kBKb) {
        const int nk = (int)std::min(kBKb, L - j0);
        mm_abt<T>(nq, nk, (int)D, Qs.data(), (int)D, kb + j0 * D, (int)D, S.data(), (int)kBKb);
        mm_abt<T>(nq, nk, (int)Dv, dorow, (int)Dv, vb + j0 * Dv, (int)Dv, G.data(), (int)kBKb);
        std::fill(colsum.begin(), colsum.begin() + nk, T(0));
        bwd_tile(nq, nk, (int)kBKb, S.data(), G.data(), be + j0, al, lse.data(), logZ.data(), gOR.data(), gY.data(),
                 a, b, ome, epsL, sc, colsum.data(), dalpha.data());
        mm_ab<T>(nq, (int)D, nk, S.data(), (int)kBKb, kb + j0 * D, (int)D, T(1), dQ.data(), (int)D);
        if (a != T(0)) {
          const T* kt = kb + j0 * D;
          for (int j = 0; j < nk; ++j) {
            const T c = colsum[j] * (T)(-2.0) * sc;
            const T* kr = kt + (int64_t)j * D;
            for (int64_t d = 0; d < D; ++d) du[d] += c * kr[d];
          }
        }
      }
      for (int i = 0; i < nq; ++i) {
        const T da = dalpha[i];
        const T* qr = qrow + (int64_t)i * D;
        const T* dqa = dQ.data() + (int64_t)i * D;
        T* dqo = dqrow + (int64_t)i * D;
        const T* uh = up + h * D;
        for (int64_t d = 0; d < D; ++d) {
          dqo[d] = dqa[d] + da * uh[d];
          du[d] += da * qr[d];
        }
      }
    }
  });
  auto du = dupart.sum(at::IntArrayRef{0, 2});                                      // (Hq, D)
  auto dn = (du - p.u * (p.u * du).sum(-1, true)) / p.nrm;          // normalisation Jacobian
  return std::make_tuple(dq, dn);
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& n) {
  for (const auto* t : {&q, &k, &v, &n}) {
    TORCH_CHECK(t->device().is_cpu(), "stair_readout (C++ CPU kernel): tensors must be on the CPU");
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "stair_readout: q, k_bank and v_bank must share one dtype");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
              "stair_readout: dtype must be float32, bfloat16, float16 or float64");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stair_readout_cpu(const at::Tensor& q, const at::Tensor& k_bank,
                                                                 const at::Tensor& v_bank, const at::Tensor& normals,
                                                                 const c10::optional<at::Tensor>& bank_lengths,
                                                                 double eps, double scale, double a, double b) {
  check_inputs(q, k_bank, v_bank, normals);
  auto p = prepare(q, k_bank, v_bank, normals, bank_lengths, eps, scale);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> r;
  if (q.scalar_type() == at::kDouble) {
    r = forward_impl<double>(p, eps, scale, a, b);
  } else {
    r = forward_impl<float>(p, eps, scale, a, b);
  }
  std::get<0>(r) = std::get<0>(r).to(q.scalar_type());
  return r;
}

std::tuple<at::Tensor, at::Tensor> stair_readout_backward_cpu(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k_bank, const at::Tensor& v_bank,
                                                              const at::Tensor& normals,
                                                              const c10::optional<at::Tensor>& bank_lengths,
                                                              const at::Tensor& rows, const at::Tensor& stats,
                                                              double eps, double scale, double a, double b) {
  check_inputs(q, k_bank, v_bank, normals);
  auto p = prepare(q, k_bank, v_bank, normals, bank_lengths, eps, scale);
  std::tuple<at::Tensor, at::Tensor> r;
  if (q.scalar_type() == at::kDouble) {
    r = backward_impl<double>(p, dout, rows, stats, eps, scale, a, b);
  } else {
    r = backward_impl<float>(p, dout, rows, stats, eps, scale, a, b);
  }
  std::get<0>(r) = std::get<0>(r).to(q.scalar_type());
  std::get<1>(r) = std::get<1>(r).to(normals.scalar_type());
  return r;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treadle_C, m) {
  m.def(
      "stair_readout(Tensor q, Tensor k_bank, Tensor v_bank, Tensor normals, Tensor? bank_lengths, float eps, "
      "float scale, float a, float b) -> (Tensor, Tensor, Tensor)");
  m.def(
      "stair_readout_backward(Tensor dout, Tensor q, Tensor k_bank, Tensor v_bank, Tensor normals, "
      "Tensor? bank_lengths, Tensor rows, Tensor stats, float eps, float scale, float a, float b) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(treadle_C, CPU, m) {
  m.impl("stair_readout", &stair_readout_cpu);
  m.impl("stair_readout_backward", &stair_readout_backward_cpu);
}

}  // namespace treadle

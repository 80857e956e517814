// C++ CPU kernel of treadle.ops.gated_lora (spec: python/treadle/reference/scale.py; maths and the
// backward derivation: python/treadle/ops/gated_lora.py).
//
// Forward, over (N, d) views of the contiguous x (..., d_in), base_out (..., d_out):
//   shrink:   z = x [A; w]^T          one GEMM over x gives (x A^T, x . w)  -> (N, r + 1); for bf16/fp16 x
//             the gate logit x . w is a separate float32 row pass (the gate is never rounded to x's dtype)
//   epilogue: g = z[:, r] + b, v = tanh(g / tau), lambda(v), s = scaling * lambda    (per token)
//   expand:   y = base_out + (s * z[:, :r]) B^T
// The epilogue is one OpenMP pass over the tokens (float32) producing s * x A^T (N, r); the expand adds
// su B^T into y by one BLAS addmm (in place for gated_lora_linear). No (N, d_out) delta is materialised.
// Backward (dy (N, d_out)):
//   p = dy B (N, r); ds = rowsum(p * u); dg = scaling * ds * lambda'(v) * (1 - v^2) / tau
//   dx = (s * p) A;  dw = x^T dg;  db = sum(dg)
// gated_lora_linear / gated_lora_linear_backward (treadle.ops.gated_lora_linear) fuse the frozen base
// linear: y = x W^T (+ bias) by one GEMM, then the same expand added into y in place; dx = dy W by one
// GEMM, then (s * p) A added into it in place (no base_out buffer, no separate LoRA dx, no extra sum).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace treadle {
namespace {

template <typename acc_t>
inline acc_t gate_lambda(acc_t v, acc_t L, acc_t U) {
  return acc_t(1) + (acc_t(1) - L) * std::min(v, acc_t(0)) + (U - acc_t(1)) * std::max(v, acc_t(0));
}

// d lambda / d v; at v == 0 the midpoint of the one-sided slopes (what torch.minimum/maximum give).
template <typename acc_t>
inline acc_t gate_lambda_slope(acc_t v, acc_t L, acc_t U) {
  if (v < acc_t(0)) return acc_t(1) - L;
  if (v > acc_t(0)) return U - acc_t(1);
  return acc_t(0.5) * (U - L);
}

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "gated_lora: ", name, " must be a contiguous 2-D tensor");
  TORCH_CHECK(t.device().is_cpu(), "gated_lora: ", name, " must be a CPU tensor");
}

// A contiguous (..., d) tensor seen as (N, d). Outputs keep the callers' N-D shapes, so autograd never
// sees a reshape view around the op (a view gradient makes it sum x's two gradients out of place).
at::Tensor rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1 && t.is_contiguous(), "gated_lora: ", name, " must be a contiguous (..., d) tensor");
  TORCH_CHECK(t.device().is_cpu(), "gated_lora: ", name, " must be a CPU tensor");
  const int64_t d = t.size(-1);
  return t.view({d == 0 ? 0 : t.numel() / d, d});
}

// Shrink + epilogue + expand over (N, d) views, writing y2 = base2 + (s * x A^T) B^T; y2 may be base2
// itself (in place). Returns (z, v).
std::tuple<at::Tensor, at::Tensor> forward_core(const at::Tensor& x2, const at::Tensor& base2, at::Tensor& y2,
                                                const at::Tensor& lora_A, const at::Tensor& lora_B,
                                                const at::Tensor& gate_weight, const at::Tensor& gate_bias,
                                                double scaling, double L, double U, double tau) {
  check_2d(lora_A, "lora_A");
  check_2d(lora_B, "lora_B");
  const int64_t n = x2.size(0), d_in = x2.size(1), d_out = base2.size(1), r = lora_A.size(0);
  TORCH_CHECK(base2.size(0) == n && lora_A.size(1) == d_in && lora_B.size(0) == d_out && lora_B.size(1) == r,
              "gated_lora: inconsistent shapes");
  TORCH_CHECK(gate_weight.numel() == d_in && gate_bias.numel() == 1, "gated_lora: gate shapes");
  const auto acc_type = x2.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool low = x2.scalar_type() == at::kBFloat16 || x2.scalar_type() == at::kHalf;
  at::Tensor v = at::empty({n}, x2.options().dtype(acc_type));
  const double b = gate_bias.to(at::kDouble).item<double>();
  at::Tensor z;  // (N, r + 1): x A^T and the gate logit x . w
  at::Tensor g;  // (N,) the gate logit in the accumulation dtype (low-precision x only)
  if (!low) {
    // shrink: one GEMM over x for the LoRA down-projection and the gate logit together (the gate,
    // float32 or x's dtype, is exact in x's dtype here: float32 or float64)
    at::Tensor stacked = at::cat({lora_A, gate_weight.reshape({1, d_in}).to(lora_A.scalar_type())}, 0);
    z = at::mm(x2, stacked.t());
  } else {
    // bf16/fp16 x: the gate logit is accumulated in float32 from x and the gate as given (a float32
    // gate is never rounded to x's dtype, and the logit is not rounded before tanh)
    at::Tensor u = at::mm(x2, lora_A.t());  // (N, r) in x's dtype, as a plain x @ A^T
    g = at::empty({n}, x2.options().dtype(at::kFloat));
    const at::Tensor w32 = gate_weight.to(at::kFloat).contiguous();
    AT_DISPATCH_REDUCED_FLOATING_TYPES(x2.scalar_type(), "gated_lora_gate", [&] {
      const scalar_t* xp = x2.data_ptr<scalar_t>();
      const float* wp = w32.data_ptr<float>();
      float* gp = g.data_ptr<float>();
      at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const scalar_t* xi = xp + i * d_in;
          float acc = 0.f;
          for (int64_t k = 0; k < d_in; ++k) acc += static_cast<float>(xi[k]) * wp[k];
          gp[i] = acc;
        }
      });
    });
    z = at::cat({u, g.to(x2.scalar_type()).unsqueeze(1)}, 1);
  }
  if (n == 0) return {z, v};
  // epilogue: su = scaling * lambda(v) * x A^T per token (N, r); float32 in one OpenMP pass
  at::Tensor su;
  if (x2.scalar_type() == at::kFloat) {
    su = at::empty({n, r}, x2.options());
    const float* zp = z.data_ptr<float>();
    float* vp = v.data_ptr<float>();
    float* sup = su.data_ptr<float>();
    const float fL = L, fU = U, fs = scaling, inv_tau = 1.0 / tau, fb = b;
    at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const float* zi = zp + i * (r + 1);
        const float vv = std::tanh((zi[r] + fb) * inv_tau);
        vp[i] = vv;
        const float s = fs * gate_lambda(vv, fL, fU);
        for (int64_t k = 0; k < r; ++k) sup[i * r + k] = s * zi[k];
      }
    });
  } else {  // float64, or bf16/fp16 with the float32 logit g: epilogue in the accumulation dtype
    at::Tensor zf = z.to(acc_type);
    at::Tensor logit = low ? g : zf.select(1, r);
    at::Tensor vv = at::tanh((logit + b) / tau);
    v.copy_(vv);
    at::Tensor lam = 1.0 + (1.0 - L) * at::clamp_max(vv, 0.0) + (U - 1.0) * at::clamp_min(vv, 0.0);
    su = (zf.narrow(1, 0, r) * (scaling * lam).unsqueeze(1)).to(x2.scalar_type());
  }
  // expand: y = base_out + su B^T by one BLAS call (in place when y is base_out's buffer, as in
  // gated_lora_linear); measured here as fast as or faster than a hand-written rank-r row loop
  if (y2.is_same(base2)) {
    y2.addmm_(su, lora_B.t());
  } else {
    at::addmm_out(y2, base2, su, lora_B.t());
  }
  return {z, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_lora_fwd_cpu(
    const at::Tensor& x, const at::Tensor& base_out, const at::Tensor& lora_A, const at::Tensor& lora_B,
    const at::Tensor& gate_weight, const at::Tensor& gate_bias, double scaling, double L, double U, double tau) {
  const at::Tensor x2 = rows(x, "x"), base2 = rows(base_out, "base_out");
  at::Tensor y = at::empty_like(base_out);
  at::Tensor y2 = y.view({x2.size(0), base2.size(1)});
  auto [z, v] = forward_core(x2, base2, y2, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau);
  return {y, z, v};
}

// The base linear fused in: y = x W^T (+ bias) by one GEMM, then the gated expand added into y in place
// (no separate base_out buffer, no extra pass to add it).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_lora_linear_cpu(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& lora_A,
    const at::Tensor& lora_B, const at::Tensor& gate_weight, const at::Tensor& gate_bias, double scaling, double L,
    double U, double tau) {
  const at::Tensor x2 = rows(x, "x");
  check_2d(weight, "weight");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  at::Tensor y = at::empty(shape, x.options());
  at::Tensor y2 = y.view({x2.size(0), weight.size(0)});
  if (bias.has_value() && bias->defined()) {
    at::addmm_out(y2, *bias, x2, weight.t());
  } else {
    at::mm_out(y2, x2, weight.t());
  }
  auto [z, v] = forward_core(x2, y2, y2, lora_A, lora_B, gate_weight, gate_bias, scaling, L, U, tau);
  return {y, z, v};
}

// Gate/LoRA backward over (N, d) views. If dx2 is defined, the LoRA path's (s * p) A is written into it
// (accumulate = false) or added to it in place (accumulate = true). Returns (dw, db).
std::tuple<at::Tensor, at::Tensor> backward_core(const at::Tensor& dy2, const at::Tensor& x2, const at::Tensor& lora_A,
                                                 const at::Tensor& lora_B, const at::Tensor& z, const at::Tensor& v,
                                                 double scaling, double L, double U, double tau, at::Tensor* dx2,
                                                 bool accumulate, bool need_dgate) {
  check_2d(z, "z");
  check_2d(lora_A, "lora_A");
  check_2d(lora_B, "lora_B");
  const int64_t n = x2.size(0), d_in = x2.size(1), r = lora_A.size(0);
  at::Tensor p = at::mm(dy2, lora_B);  // (N, r)
  at::Tensor q = at::empty({n, r}, p.options());
  const auto acc_type = x2.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor dg = at::empty({n}, x2.options().dtype(acc_type));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.scalar_type(), "gated_lora_bwd", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* pp = p.data_ptr<scalar_t>();
    const scalar_t* zp = z.data_ptr<scalar_t>();
    const acc_t* vp = v.data_ptr<acc_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    acc_t* dgp = dg.data_ptr<acc_t>();
    const acc_t aL = L, aU = U, as = scaling, inv_tau = acc_t(1) / acc_t(tau);
    at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const scalar_t* pi = pp + i * r;
        const scalar_t* zi = zp + i * (r + 1);
        acc_t ds = 0;
        for (int64_t k = 0; k < r; ++k) ds += acc_t(pi[k]) * acc_t(zi[k]);
        const acc_t vv = vp[i];
        const acc_t s = as * gate_lambda(vv, aL, aU);
        for (int64_t k = 0; k < r; ++k) qp[i * r + k] = scalar_t(s * acc_t(pi[k]));
        dgp[i] = acc_t(as * ds * gate_lambda_slope(vv, aL, aU) * (acc_t(1) - vv * vv) * inv_tau);
      }
    });
  });
  if (dx2 != nullptr && n > 0) {  // rank-r expand: one write (or read + write) of dx
    if (accumulate) {
      dx2->addmm_(q, lora_A);
    } else {
      at::mm_out(*dx2, q, lora_A);
    }
  }
  at::Tensor dw, db;  // in the accumulation dtype (float32, or float64 for float64 inputs)
  if (need_dgate) {
    dw = at::mv(x2.t().to(acc_type), dg);
    db = dg.sum().reshape({1});
  } else {
    dw = at::zeros({d_in}, x2.options().dtype(acc_type));
    db = at::zeros({1}, x2.options().dtype(acc_type));
  }
  return {dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_lora_bwd_cpu(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& lora_A, const at::Tensor& lora_B,
    const at::Tensor& z, const at::Tensor& v, double scaling, double L, double U, double tau, bool need_dx,
    bool need_dgate) {
  const at::Tensor dy2 = rows(dy, "grad_y"), x2 = rows(x, "x");
  at::Tensor dx = need_dx ? at::empty_like(x) : at::zeros_like(x);
  at::Tensor dx2 = dx.view({x2.size(0), x2.size(1)});
  auto [dw, db] = backward_core(dy2, x2, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx ? &dx2 : nullptr,
                                /*accumulate=*/false, need_dgate);
  return {dx, dw, db};
}

// Backward of gated_lora_linear: dx = dy W (one GEMM) + (s * p) A added in place; W and its bias frozen.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_lora_linear_bwd_cpu(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
    const at::Tensor& lora_B, const at::Tensor& z, const at::Tensor& v, double scaling, double L, double U, double tau,
    bool need_dx, bool need_dgate) {
  const at::Tensor dy2 = rows(dy, "grad_y"), x2 = rows(x, "x");
  check_2d(weight, "weight");
  at::Tensor dx = need_dx ? at::empty_like(x) : at::zeros_like(x);
  at::Tensor dx2 = dx.view({x2.size(0), x2.size(1)});
  if (need_dx) at::mm_out(dx2, dy2, weight);
  auto [dw, db] = backward_core(dy2, x2, lora_A, lora_B, z, v, scaling, L, U, tau, need_dx ? &dx2 : nullptr,
                                /*accumulate=*/true, need_dgate);
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treadle_C, m) {
  m.def(
      "gated_lora(Tensor x, Tensor base_out, Tensor lora_A, Tensor lora_B, Tensor gate_weight, "
      "Tensor gate_bias, float scaling, float L, float U, float tau) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gated_lora_backward(Tensor grad_y, Tensor x, Tensor lora_A, Tensor lora_B, Tensor z, Tensor v, float scaling, "
      "float L, float U, float tau, bool need_dx, bool need_dgate) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gated_lora_linear(Tensor x, Tensor weight, Tensor? bias, Tensor lora_A, Tensor lora_B, Tensor gate_weight, "
      "Tensor gate_bias, float scaling, float L, float U, float tau) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gated_lora_linear_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor lora_A, Tensor lora_B, Tensor z, "
      "Tensor v, float scaling, float L, float U, float tau, bool need_dx, bool need_dgate) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(treadle_C, CPU, m) {
  m.impl("gated_lora", &gated_lora_fwd_cpu);
  m.impl("gated_lora_backward", &gated_lora_bwd_cpu);
  m.impl("gated_lora_linear", &gated_lora_linear_cpu);
  m.impl("gated_lora_linear_backward", &gated_lora_linear_bwd_cpu);
}

}  // namespace treadle

// Θ = l2_norm_gelu on the CPU in one memory pass per direction (tokenformer.kernels loads this).
//
// The scores S [L, n] are processed one row at a time, in float32 whatever their storage dtype: a
// row (a few KB) is read from memory once, its norm and Θ (or its gradient) are computed while it
// sits in L1/L2 (the second pass over it reads the cache, or a float32 row buffer), and the
// results are written once. An MLP's GELU does about the same reads and writes, so the Pattention
// step costs what the MLP's does plus in-cache arithmetic (docs/performance.md).
//
//   theta_forward(S, scale, eps)           -> (Θ, r)     r = ‖S_i‖₂ per row, float32 [L]
//   theta_backward(G!, S!, r, scale, eps)  -> ()         G (= dΘ) becomes Θ and S becomes dS
//
// The backward allocates nothing: it turns the two [L, n] tensors it reads into the two it
// returns, so its peak memory is two scores-sized tensors where a GELU MLP's is three.
//
// With c = scale / (r + eps), u = c·S, Θ = GELU(u) and dU = GELU'(u)·G:
//   dS = c·(dU − S·(S·dU) / (r·(r + eps)))      (the second term is 0 for an all-zero row)

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kW = fVec::size();
constexpr int64_t kStep = 2 * kW;  // elements per loop step: one Vectorized<bf16/fp16> register

// Up to kStep elements of a row as two float32 vectors (lanes past `w` read as 0), and back.
template <typename T>
inline void load(const T* p, int64_t w, fVec& a, fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = fVec::loadu(p, std::min(w, kW));
    b = w > kW ? fVec::loadu(p + kW, w - kW) : fVec(0.f);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p, w));
  }
}

template <typename T>
inline void store(T* p, int64_t w, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p, std::min(w, kW));
    if (w > kW) b.store(p + kW, w - kW);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    // One instruction for what ATen emulates with integer rounding (both round to nearest even).
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    if (w == kStep) {
      _mm512_storeu_si512(p, packed);
    } else {
      _mm512_mask_storeu_epi16(p, static_cast<__mmask32>((1ULL << w) - 1), packed);
    }
#endif
  } else {
    at::vec::convert_from_float<T>(a, b).store(p, w);
  }
}

float hsum(const fVec& v) {
  float lanes[kW];
  v.store(lanes);
  float total = 0.f;
  for (int64_t k = 0; k < kW; ++k) total += lanes[k];
  return total;
}

// 1/d for d >= 1: a 14-bit estimate refined by one Newton step (≈ float precision) where the
// ISA has one, a division elsewhere.
inline fVec reciprocal(const fVec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 r = _mm512_rcp14_ps(d);
  return fVec(_mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f))));
#else
  return fVec(1.f) / d;
#endif
}

// Φ(u) = ½(1 + erf(u/√2)) and, optionally, φ(u) = exp(−u²/2)/√(2π), sharing one exponential.
// erf is the Abramowitz–Stegun 7.1.26 form torch's vectorised erf uses (|error| < 1.5e-7):
// ½·erfc(|x|) ≈ h = t·P(t)·exp(−x²)/2 with t = 1/(1 + p·|x|), x = u/√2, and exp(−x²) is the
// exponential φ needs. The constants below fold in the 1/√2 and the ½.
inline fVec normal_cdf(const fVec& u, fVec* pdf) {
  const fVec one(1.f), zero(0.f), minus_half(-0.5f);
  const fVec p(0.3275911f * static_cast<float>(M_SQRT1_2));
  const fVec p1(0.5f * 0.254829592f), p2(0.5f * -0.284496736f), p3(0.5f * 1.421413741f),
      p4(0.5f * -1.453152027f), p5(0.5f * 1.061405429f);
  const fVec t = reciprocal(at::vec::fmadd(p, u.abs(), one));
  const fVec poly = at::vec::fmadd(
      at::vec::fmadd(at::vec::fmadd(at::vec::fmadd(p5, t, p4), t, p3), t, p2), t, p1);
  const fVec e = (u * u * minus_half).exp_u20();
  const fVec h = poly * t * e;  // Φ(−|u|)
  if (pdf != nullptr) *pdf = e * fVec(static_cast<float>(0.5 * M_2_SQRTPI * M_SQRT1_2));
  return fVec::blendv(one - h, h, u < zero);
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& scores, double scale,
                                                double eps) {
  const int64_t L = scores.size(0), n = scores.size(1);
  at::Tensor theta = at::empty_like(scores);
  at::Tensor norms = at::empty({L}, scores.options().dtype(at::kFloat));
  const T* s = scores.data_ptr<T>();
  T* th = theta.data_ptr<T>();
  float* r = norms.data_ptr<float>();
  at::parallel_for(0, L, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* srow = s + i * n;
      fVec a, b, acc(0.f);
      for (int64_t j = 0; j < n; j += kStep) {
        load(srow + j, std::min(kStep, n - j), a, b);
        acc = at::vec::fmadd(b, b, at::vec::fmadd(a, a, acc));
      }
      r[i] = std::sqrt(hsum(acc));
      const fVec c(static_cast<float>(scale / (r[i] + eps)));
      for (int64_t j = 0; j < n; j += kStep) {  // the row is still in L1/L2
        const int64_t w = std::min(kStep, n - j);
        load(srow + j, w, a, b);
        const fVec ua = a * c, ub = b * c;
        store(th + i * n + j, w, ua * normal_cdf(ua, nullptr), ub * normal_cdf(ub, nullptr));
      }
    }
  });
  return {theta, norms};
}

template <typename T>
void backward_impl(at::Tensor& grad, at::Tensor& scores, const at::Tensor& norms, double scale,
                   double eps) {
  const int64_t L = scores.size(0), n = scores.size(1);
  T* s = scores.data_ptr<T>();
  T* g = grad.data_ptr<T>();
  const float* r = norms.data_ptr<float>();
  at::parallel_for(0, L, 16, [&](int64_t begin, int64_t end) {
    // One row of S and of dU in float32, between the two passes.
    std::vector<float> sbuf(n + kStep), du(n + kStep);
    for (int64_t i = begin; i < end; ++i) {
      T* srow = s + i * n;
      T* grow = g + i * n;
      const float ri = r[i];
      const fVec c(static_cast<float>(scale / (ri + eps)));
      fVec sa, sb, ga, gb, dot(0.f);
      for (int64_t j = 0; j < n; j += kStep) {
        const int64_t w = std::min(kStep, n - j);
        load(srow + j, w, sa, sb);
        load(grow + j, w, ga, gb);
        sa.store(sbuf.data() + j);
        sb.store(sbuf.data() + j + kW);
        const fVec ua = sa * c, ub = sb * c;
        fVec pa, pb;
        const fVec ca = normal_cdf(ua, &pa), cb = normal_cdf(ub, &pb);
        store(grow + j, w, ua * ca, ub * cb);  // Θ over dΘ, already read
        const fVec da = ga * at::vec::fmadd(ua, pa, ca), db = gb * at::vec::fmadd(ub, pb, cb);
        da.store(du.data() + j);
        db.store(du.data() + j + kW);
        dot = at::vec::fmadd(sb, db, at::vec::fmadd(sa, da, dot));  // lanes past w are 0
      }
      const float q = ri > 0.f ? static_cast<float>(1.0 / (ri * (ri + eps))) : 0.f;
      const fVec corr(hsum(dot) * q);
      for (int64_t j = 0; j < n; j += kStep) {  // dS = c·(dU − S·corr), over S
        const int64_t w = std::min(kStep, n - j);
        store(srow + j, w, c * (fVec::loadu(du.data() + j) - fVec::loadu(sbuf.data() + j) * corr),
              c * (fVec::loadu(du.data() + j + kW) - fVec::loadu(sbuf.data() + j + kW) * corr));
      }
    }
  });
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D tensor");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

std::tuple<at::Tensor, at::Tensor> theta_forward(const at::Tensor& scores, double scale,
                                                 double eps) {
  check(scores, "scores");
  std::tuple<at::Tensor, at::Tensor> result;
  AT_DISPATCH_V2(scores.scalar_type(), "theta_forward", AT_WRAP([&] {
    result = forward_impl<scalar_t>(scores, scale, eps);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return result;
}

void theta_backward(at::Tensor& grad, at::Tensor& scores, const at::Tensor& norms,
                    double scale, double eps) {
  check(grad, "grad");
  check(scores, "scores");
  TORCH_CHECK(grad.sizes() == scores.sizes() && grad.scalar_type() == scores.scalar_type(),
              "grad and scores must match in shape and dtype");
  TORCH_CHECK(norms.dim() == 1 && norms.size(0) == scores.size(0) &&
              norms.scalar_type() == at::kFloat && norms.is_contiguous(),
              "norms must be float32 of shape [L]");
  AT_DISPATCH_V2(scores.scalar_type(), "theta_backward", AT_WRAP([&] {
    backward_impl<scalar_t>(grad, scores, norms, scale, eps);
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

}  // namespace

TORCH_LIBRARY(tokenformer_kernels, m) {
  m.def("theta_forward(Tensor scores, float scale, float eps) -> (Tensor, Tensor)");
  m.def("theta_backward(Tensor(a!) grad, Tensor(b!) scores, Tensor norms, float scale, "
        "float eps) -> ()");
}

TORCH_LIBRARY_IMPL(tokenformer_kernels, CPU, m) {
  m.impl("theta_forward", &theta_forward);
  m.impl("theta_backward", &theta_backward);
}

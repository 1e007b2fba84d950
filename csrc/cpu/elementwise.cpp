// The decoder's elementwise ops on x86-64 CPUs (AVX2): residual add + RMSNorm, SiLU·mul and the rotary
// embedding, one call each instead of 5-12 torch ops (on a 2-core VM, one decode step of SmolLM2-135M
// spent ~4.7 ms in those ops' overheads: 37, 13 and 68 µs a call). Each rounds where torch's code (HF's
// Llama) rounds, in float32 and in bfloat16; only the RMSNorm's sum of squares may add in another order.
// Every row is computed alone, so a token gets the same bits in any batch.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "ops.h"
#include "simd.h"

namespace {

using vllm_spec_cpu::exp8;
using vllm_spec_cpu::load8;
using vllm_spec_cpu::widen;

// float32 -> T, rounded to nearest even as torch rounds (NaN stays NaN).
inline float narrow(float v, float*) { return v; }

inline uint16_t narrow(float v, uint16_t*) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

template <typename T>
inline T to(float v) { return narrow(v, static_cast<T*>(nullptr)); }

// v rounded to T and back (what a tensor of T holds).
template <typename T>
inline float round_as(float v) { return widen(to<T>(v)); }

// out = RMSNorm(h) * w for h = x + residual (rounded to T as torch's add; written to res_out), or h = x.
template <typename T>
void add_rms_norm_rows(const T* x, const T* res, int64_t sx, int64_t sr, const T* w, T* out, T* res_out,
                       int64_t rows, int64_t N, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* h = x + r * sx;
      if (res != nullptr) {
        T* rr = res_out + r * N;
        for (int64_t i = 0; i < N; ++i) rr[i] = to<T>(widen(h[i]) + widen(res[r * sr + i]));
        h = rr;
      }
      // The sum of squares in double: one chain of float adds lost up to ~1e-6 (relative) at 8192 wide
      // heavy-tailed rows, where torch's pairwise sum kept 2e-7.
      __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
      int64_t i = 0;
      for (; i + 8 <= N; i += 8) {
        const __m256 v = load8(h + i);
        const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        lo = _mm256_fmadd_pd(a, a, lo);
        hi = _mm256_fmadd_pd(b, b, hi);
      }
      alignas(32) double lanes[4];
      _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
      double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
      for (; i < N; ++i) sum += static_cast<double>(widen(h[i])) * widen(h[i]);
      const float mean = static_cast<float>(sum / static_cast<double>(N));
      const float inv = 1.0f / std::sqrt(mean + eps);
      T* o = out + r * N;
      for (i = 0; i < N; ++i) o[i] = to<T>(widen(w[i]) * round_as<T>(widen(h[i]) * inv));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, int64_t sx, T* out, int64_t rows, int64_t I) {
  // (8 rows a thread: 16 rows of 1536 on one thread took 21 µs, an exp per element)
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * sx;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {   // (one rounding per op, as the lane-by-lane code below)
        for (; i + 8 <= I; i += 8) {
          const __m256 gate = _mm256_loadu_ps(g + i);
          const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate)));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gate, denominator), _mm256_loadu_ps(u + i)));
        }
      }
      alignas(32) float gv[8], ev[8];
      for (; i < I; i += 8) {
        const int64_t n = std::min<int64_t>(8, I - i);
        for (int64_t j = 0; j < 8; ++j) gv[j] = j < n ? widen(g[i + j]) : 0.0f;
        _mm256_store_ps(ev, exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_load_ps(gv))));
        for (int64_t j = 0; j < n; ++j) {
          const float s = round_as<T>(gv[j] / (1.0f + ev[j]));   // silu, rounded to T as F.silu's output
          o[i + j] = to<T>(s * widen(u[i + j]));
        }
      }
    }
  });
}

// x [rows, heads, D] rotated in the rotate-half layout into out: x*cos + rotate_half(x)*sin, each product
// and the sum rounded to T (torch's ops in T).
template <typename T>
void rotate_rows(const T* x, int64_t sx, int64_t heads, int64_t D, const T* cos, const T* sin, int64_t sc, T* out,
                 int64_t rows) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* c = cos + r * sc;
      const T* s = sin + r * sc;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + r * sx + h * D;
        T* o = out + (r * heads + h) * D;
        for (int64_t i = 0; i < D; ++i) {
          const float rot = i < half ? -widen(xr[i + half]) : widen(xr[i - half]);
          o[i] = to<T>(round_as<T>(widen(xr[i]) * widen(c[i])) + round_as<T>(rot * widen(s[i])));
        }
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() >= 1 && t.stride(-1) == 1, what, ": CPU rows with contiguous elements");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16");
}

template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  if (t == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<uint16_t*>(nullptr));
  }
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(weight, "add_rms_norm weight");
  if (residual.has_value()) check_rows(*residual, "add_rms_norm residual");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous()
                  && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: x [T, N], weight [N] of x's dtype");
  const bool has_res = residual.has_value();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(-1) == 1 && residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual like x");
  const int64_t T = x.size(0), N = x.size(1);
  auto out = torch::empty({T, N}, x.options());
  auto res_out = has_res ? torch::empty({T, N}, x.options()) : x;   // without a residual: x itself
  dispatch(x.scalar_type(), [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    add_rms_norm_rows<E>(ptr<E>(x), has_res ? ptr<E>(*residual) : nullptr, x.stride(0), has_res ? residual->stride(0) : 0,
                         ptr<E>(weight), ptr<E>(out), ptr<E>(res_out), T, N, static_cast<float>(eps));
  });
  return {out, res_out};
}

torch::Tensor silu_mul(const torch::Tensor& x) {
  check_rows(x, "silu_mul");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  dispatch(x.scalar_type(), [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows<E>(ptr<E>(x), x.stride(0), ptr<E>(out), T, I);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                                                const torch::Tensor& sin) {
  for (const auto* t : {&q, &k}) {
    check_rows(*t, "rotary");
    TORCH_CHECK(t->dim() == 3 && t->stride(1) == t->size(2) && t->size(2) % 2 == 0 && t->scalar_type() == q.scalar_type(),
                "rotary: q/k [T, heads, D] with each token's heads contiguous, D even, one dtype");
  }
  check_rows(cos, "rotary cos");
  check_rows(sin, "rotary sin");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T
                  && cos.size(1) == D && cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0)
                  && cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type(),
              "rotary: cos/sin [T, D] of q's dtype");
  auto q_out = torch::empty({T, q.size(1), D}, q.options());
  auto k_out = torch::empty({T, k.size(1), D}, k.options());
  dispatch(q.scalar_type(), [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    rotate_rows<E>(ptr<E>(q), q.stride(0), q.size(1), D, ptr<E>(cos), ptr<E>(sin), cos.stride(0), ptr<E>(q_out), T);
    rotate_rows<E>(ptr<E>(k), k.stride(0), k.size(1), D, ptr<E>(cos), ptr<E>(sin), cos.stride(0), ptr<E>(k_out), T);
  });
  return {q_out, k_out};
}

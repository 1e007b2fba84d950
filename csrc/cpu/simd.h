// AVX2 (and AVX-512) helpers shared by the CPU kernels: widening loads of float32 / bfloat16 / float16 to
// float32 lanes (exact), and the lanes' sum in one fixed order.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace vllm_spec_cpu {

// IEEE float16 bits (bfloat16 are plain uint16_t): a type of their own picks their widening.
struct Half {
  uint16_t bits;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {   // 8 bfloat16 -> float32: the bits move to the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const Half* p) {   // 8 float16 -> float32 (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float widen(float v) { return v; }

inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float widen(Half v) { return _cvtsh_ss(v.bits); }

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The matmul's vectors (csrc/cpu/rows_linear.cpp): kLanes = 16 float32 lanes where the build has AVX-512F,
// else 8. A build sums in one order (kLanes lanes over k, then vsum) whatever the number of rows: the bits
// of an AVX-512 build and an AVX2 one differ, those of one build's decode step and verification do not.
// With AVX-512 the lanes are a __m512 (WideVec: where widening blocks bounds the time, fewer instructions)
// or two __m256 halves (DenseVec: the same sums lane for lane; FMA-bound tiles of float32 weights ran at
// 80% of their 256-bit speed with __m512 on Zen 4, which splits a 512-bit op into two 256-bit ones).
template <typename V>
constexpr int registers_of = 1;   // a vector's share of the registers
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;   // zmm / ymm registers
struct Halves {
  __m256 lo, hi;
};
using WideVec = __m512;
using DenseVec = Halves;
template <>
constexpr int registers_of<Halves> = 2;
#else
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using WideVec = __m256;
using DenseVec = __m256;
#endif

inline __m256 load8_i8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <typename V>
V vzero();
template <typename V>
V vset1(float v);
// kLanes elements of T (float, bfloat16 bits, Half) widened to float32: a DenseVec through 8-lane loads
// (a __m512 takes float32 only, below).
template <typename V, typename T>
inline V vload(const T* p) {
  if constexpr (std::is_same_v<V, __m256>) return load8(p);
  else return V{load8(p), load8(p + 8)};
}
template <typename V>
inline V vload_i8(const uint8_t* p) {   // kLanes int8 widened to float32 (a DenseVec)
  if constexpr (std::is_same_v<V, __m256>) return load8_i8(p);
  else return V{load8_i8(p), load8_i8(p + 8)};
}

template <>
inline __m256 vzero<__m256>() { return _mm256_setzero_ps(); }
template <>
inline __m256 vset1<__m256>(float v) { return _mm256_set1_ps(v); }
inline __m256 vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline void vstore(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

#if defined(__AVX512F__)
template <>
inline __m512 vzero<__m512>() { return _mm512_setzero_ps(); }
template <>
inline __m512 vload<__m512, float>(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline float vsum(__m512 v) {
  return lane_sum(_mm256_add_ps(_mm512_castps512_ps256(v),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

template <>
inline Halves vzero<Halves>() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
template <>
inline Halves vset1<Halves>(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Halves vfma(Halves a, Halves b, Halves c) { return {vfma(a.lo, b.lo, c.lo), vfma(a.hi, b.hi, c.hi)}; }
inline Halves vmul(Halves a, Halves b) { return {vmul(a.lo, b.lo), vmul(a.hi, b.hi)}; }
inline void vstore(float* p, Halves v) {
  vstore(p, v.lo);
  vstore(p + 8, v.hi);
}
inline float vsum(Halves v) { return lane_sum(_mm256_add_ps(v.lo, v.hi)); }
#else
inline float vsum(__m256 v) { return lane_sum(v); }
#endif

// exp(x) for 8 lanes (Cephes' float polynomial, within 2 ulp; std::exp one lane at a time was most of
// the attention kernel's time). Anything below float's smallest normal result (-inf included) gives 0;
// above log(FLT_MAX) it is inf; NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.33654475f);   // exp() of it: FLT_MIN
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  // (NaN passes: max/min return their second operand when either is NaN.)
  x = _mm256_min_ps(_mm256_set1_ps(88.72283935546875f), _mm256_max_ps(lowest, x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);   // x - n ln2, ln2 in two parts
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  // 2^n as two float factors 2^(n/2) 2^(n - n/2): n reaches 128 at the top of the range, past a single
  // float exponent (the product is then FLT_MAX's neighbourhood or inf).
  const __m256i e = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(e, 1);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 p2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(_mm256_mul_ps(y, p1), p2));
}

}  // namespace vllm_spec_cpu

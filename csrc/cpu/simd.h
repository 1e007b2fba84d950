// AVX2 helpers shared by the CPU kernels: widening loads of float32 / bfloat16 / float16 to 8 float32
// lanes (exact), and the lanes' sum in one fixed order.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

}  // namespace vllm_spec_cpu

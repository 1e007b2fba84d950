// y = x W^T for x86-64 CPUs with AVX2 and FMA: the CPU decode path's matmul (vllm_spec/model/cpu_linear.py
// builds this file on first use and falls back to torch without it). x and y are float32; W is float32 or
// bfloat16 (widened in registers: half the memory traffic, where the CPU has no bf16 arithmetic of its own).
//
// Decoding multiplies a few rows of activations by every weight once per step, so the weights'
// memory traffic sets the time. Each tile keeps 4 weight rows x up to 3 activation rows of sums in
// registers and reads each weight row once for all activation rows; the first pass over a tile
// prefetches the tile PREFETCH_TILES ahead, so the FMAs on one tile overlap the load of the next
// (without it a single core's loads and FMAs ran one after the other: 8 GB/s at 5 rows, 13 at 1).
//
// Every output element is summed in the same order (8 lanes over k, the lanes added pairwise, then
// the k tail) whatever the number of rows and tiles: a row gets bit-for-bit the same result in a
// 1-row decode step and in a (k+1)-row verification.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <torch/extension.h>

namespace {

constexpr int kTileRows = 4;        // weight rows per tile
constexpr int kMaxActRows = 3;      // activation rows per pass: 4 x 3 sums + 1 weight + 3 inputs in 16 registers
constexpr int kPrefetchTiles = 3;   // how far ahead the first pass prefetches (measured: 1-4 alike, 0 slower)
// Activation rows per sweep over the weights: every tile re-reads them, so they must stay in L2 (2048
// rows at once took 1.5-2x torch's time; the weights' extra sweeps cost little where rows are many).
constexpr int64_t kRowsPerSweep = 256;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {   // 8 bfloat16 -> float32: the bits move to the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float widen(float v) { return v; }

inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m * ldy + r] = dot(x[m * K ...], w[r * K ...]) for r < R, m < MC; with prefetch, the R rows
// kPrefetchTiles tiles further on exist and are prefetched.
template <typename W, int R, int MC>
void tile(const float* x, const W* w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  __m256 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm256_setzero_ps();
  const W* ahead = prefetch ? w + static_cast<int64_t>(kPrefetchTiles) * kTileRows * K : w;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MC];
    for (int m = 0; m < MC; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    if (prefetch && (k & 15) == 0)   // one 64-byte line per weight row every other step
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w + r * K + k);
      for (int m = 0; m < MC; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) {
      float s = lane_sum(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += widen(w[r * K + t]) * x[m * K + t];
      y[m * ldy + r] = s;
    }
}

// All M activation rows against R weight rows: passes of up to kMaxActRows rows; only the first
// prefetches (the later ones read the tile's weights from cache).
template <typename W, int R>
void rows(const float* x, int64_t M, const W* w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  int64_t m = 0;
  for (; m + kMaxActRows <= M; m += kMaxActRows)
    tile<W, R, kMaxActRows>(x + m * K, w, K, y + m * ldy, ldy, prefetch && m == 0);
  if (M - m == 2) tile<W, R, 2>(x + m * K, w, K, y + m * ldy, ldy, prefetch && m == 0);
  else if (M - m == 1) tile<W, R, 1>(x + m * K, w, K, y + m * ldy, ldy, prefetch && m == 0);
}

template <typename W>
void matmul(const float* xp, const W* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  constexpr int64_t kAhead = static_cast<int64_t>(kPrefetchTiles + 1) * kTileRows;   // rows a prefetch reaches
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerSweep) {
    const int64_t mc = std::min(kRowsPerSweep, M - m0);
    const float* xs = xp + m0 * K;
    float* ys = yp + m0 * N;
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kTileRows;
        if (n0 + kTileRows <= N) {
          rows<W, kTileRows>(xs, mc, wp + n0 * K, K, ys + n0, N, n0 + kAhead <= N);
        } else {
          for (int64_t n = n0; n < N; ++n) rows<W, 1>(xs, mc, wp + n * K, K, ys + n, N, false);
        }
      }
    });
  }
}

torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rows_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "rows_linear: x float32, w float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "rows_linear: contiguous CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (w.scalar_type() == at::kFloat) {
    matmul(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  } else {
    matmul(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), y.data_ptr<float>(),
           M, K, N);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: the engine's thread multiplies while the server's threads run Python.
  m.def("rows_linear", &rows_linear, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [M, K] (float32) @ w [N, K]^T (float32 or bfloat16) in float32 (AVX2/FMA)");
}

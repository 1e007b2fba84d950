// y = x W^T for x86-64 CPUs with AVX2 and FMA: the CPU decode path's matmul (vllm_spec/model/cpu_linear.py
// builds this file on first use and falls back to torch without it). x and y are float32; W is float32,
// bfloat16 or float16 (widened in registers, exactly: half the memory traffic; a float32 model's weights
// that a half type holds exactly are stored in it, and a bf16 model's where the CPU has no bf16 arithmetic).
//
// Decoding multiplies a few rows of activations by every weight once per step, so the weights'
// memory traffic sets the time. A tile of 4 weight rows keeps its sums in registers (4 x up to 3
// activation rows, or 2 x up to 6 with the weights held) and reads each weight row once per pass; the
// first pass over a tile prefetches the tile kPrefetchTiles ahead, so the FMAs on one tile overlap the
// load of the next (without it a single core's loads and FMAs ran one after the other: 8 GB/s at 5
// rows, 13 at 1).
//
// Every output element is summed in the same order (8 lanes over k, the lanes added pairwise, then
// the k tail, each product rounded before its add: built with -ffp-contract=off, so no compiler choice
// of fusing differs between instantiations) whatever the number of rows and tiles: a row gets
// bit-for-bit the same result in a 1-row decode step and in a (k+1)-row verification.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "ops.h"
#include "simd.h"

namespace {

using vllm_spec_cpu::Half;
using vllm_spec_cpu::lane_sum;
using vllm_spec_cpu::load8;
using vllm_spec_cpu::widen;

constexpr int kTileRows = 4;        // weight rows per tile
constexpr int kHeldRows = 6;        // rows per pass with the weights held (see tile)
constexpr int64_t kHeldMaxRows = 18;   // up to here, passes of kHeldRows (see rows)
constexpr int kPrefetchTiles = 3;   // how far ahead the first pass prefetches (measured: 1-4 alike, 0 slower)
// Activation rows per sweep over the weights: every tile re-reads them, so they must stay in L2 (2048
// rows at once took 1.5-2x torch's time; the weights' extra sweeps cost little where rows are many).
constexpr int64_t kRowsPerSweep = 256;

// y[m * ldy + r] = dot(x[m * K ...], w[r * K ...]) for r < R, m < MC; with prefetch, the R rows
// kPrefetchTiles tiles further on exist and are prefetched. Two loop orders, one order of sums per
// element: HoldInputs keeps the MC input vectors in registers and loads each weight vector once per
// step (4 x 3 sums + 3 inputs + 1 weight fill the 16 registers); otherwise the R weight vectors are held
// and the inputs stream past them (2 x 6 sums + 2 weights + 1 input), so 4-6 rows take one pass where
// the other order needs two (5 rows of gate_up: 1.15x a row's time against 1.28x).
template <typename W, int R, int MC, bool HoldInputs>
void tile(const float* x, const W* w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  __m256 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm256_setzero_ps();
  const W* ahead = prefetch ? w + static_cast<int64_t>(kPrefetchTiles) * kTileRows * K : w;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (prefetch && k % (64 / sizeof(W)) == 0)   // one 64-byte line per weight row as the loads reach it
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead + r * K + k), _MM_HINT_T0);
    if constexpr (HoldInputs) {
      __m256 xv[MC];
      for (int m = 0; m < MC; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = load8(w + r * K + k);
        for (int m = 0; m < MC; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    } else {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load8(w + r * K + k);
      for (int m = 0; m < MC; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) {
      float s = lane_sum(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += widen(w[r * K + t]) * x[m * K + t];
      y[m * ldy + r] = s;
    }
}

// Up to kHeldRows activation rows in one pass: the tile's weight rows two at a time.
template <typename W, int R, int MC>
void rows_in_one_pass(const float* x, const W* w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  static_assert(R % 2 == 0 || R == 1, "pairs of weight rows");
  if constexpr (R == 1) {
    tile<W, 1, MC, false>(x, w, K, y, ldy, prefetch);
  } else {
    for (int r = 0; r < R; r += 2) tile<W, 2, MC, false>(x, w + r * K, K, y + r, ldy, prefetch);
  }
}

// All M activation rows against R weight rows: up to 3 in one pass of tile; up to kHeldMaxRows in passes
// of up to 6 with the weights held (fewer passes over the tile); more in passes of 3 (the arithmetic
// bounds many rows, and tile's does more per load: 64 rows of gate_up took 95 ms that way, 106 held).
// Only the first pass prefetches (the later ones read the tile's weights from cache).
template <typename W, int R>
void rows(const float* x, int64_t M, const W* w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  switch (M) {
    case 1: return tile<W, R, 1, true>(x, w, K, y, ldy, prefetch);
    case 2: return tile<W, R, 2, true>(x, w, K, y, ldy, prefetch);
    case 3: return tile<W, R, 3, true>(x, w, K, y, ldy, prefetch);
    default: break;
  }
  if (M > kHeldMaxRows) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) tile<W, R, 3, true>(x + m * K, w, K, y + m * ldy, ldy, prefetch && m == 0);
    if (M - m == 2) tile<W, R, 2, true>(x + m * K, w, K, y + m * ldy, ldy, false);
    else if (M - m == 1) tile<W, R, 1, true>(x + m * K, w, K, y + m * ldy, ldy, false);
    return;
  }
  for (int64_t m = 0; m < M; m += kHeldRows) {
    const float* xm = x + m * K;
    float* ym = y + m * ldy;
    const bool first = prefetch && m == 0;
    switch (std::min<int64_t>(kHeldRows, M - m)) {
      case 6: rows_in_one_pass<W, R, 6>(xm, w, K, ym, ldy, first); break;
      case 5: rows_in_one_pass<W, R, 5>(xm, w, K, ym, ldy, first); break;
      case 4: rows_in_one_pass<W, R, 4>(xm, w, K, ym, ldy, first); break;
      case 3: rows_in_one_pass<W, R, 3>(xm, w, K, ym, ldy, first); break;
      case 2: rows_in_one_pass<W, R, 2>(xm, w, K, ym, ldy, first); break;
      default: rows_in_one_pass<W, R, 1>(xm, w, K, ym, ldy, first); break;
    }
  }
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

}  // namespace

torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rows_linear: x [M, K] and w [N, K]");
  const auto wt = w.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat && (wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf),
              "rows_linear: x float32, w float32, bfloat16 or float16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "rows_linear: contiguous CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (wt == at::kFloat) {
    matmul(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  } else if (wt == at::kHalf) {
    matmul(x.data_ptr<float>(), reinterpret_cast<const Half*>(w.data_ptr<at::Half>()), y.data_ptr<float>(), M, K, N);
  } else {
    matmul(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), y.data_ptr<float>(),
           M, K, N);
  }
  return y;
}


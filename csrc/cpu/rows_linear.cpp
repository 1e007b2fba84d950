// y = x W^T for x86-64 CPUs with AVX2 and FMA: the CPU decode path's matmul (vllm_spec/model/cpu_linear.py
// builds this file on first use and falls back to torch without it). x and y are float32; W is float32,
// bfloat16 or float16, or 32-column Q4_1 / Q8_0 / U8X16 blocks (all widened in registers, exactly: a float32 model's
// weights that a half type or such blocks hold exactly are stored so, vllm_spec/model/cpu_linear.py; a
// bf16 model's where the CPU has no bf16 arithmetic).
//
// Decoding multiplies a few rows of activations by every weight once per step, so the weights'
// memory traffic sets the time. A tile of 4 weight rows keeps its sums in registers (4 x up to 3
// activation rows, or 2 x up to 6 with the weights held) and reads each weight row once per pass; the
// first pass over a tile prefetches the tile kPrefetchTiles ahead, so the FMAs on one tile overlap the
// load of the next (without it a single core's loads and FMAs ran one after the other: 8 GB/s at 5
// rows, 13 at 1), into L2 where the weights' stream bounds the time (kPrefetchHint).
//
// Built with AVX-512F/VL where the CPU has them (vllm_spec/cpu_ops.py), the vectors are 16 lanes wide
// (simd.h's WideVec / DenseVec) and Q4_1 blocks widen through a table of their 16 values (Q4_1Blocks).
//
// Every output element is summed in the same order (a build's kLanes lanes over k, the lanes added by
// vsum, then the k tail, each product rounded before its add: built with -ffp-contract=off, so no compiler
// choice of fusing differs between instantiations) whatever the number of rows and tiles: a row gets
// bit-for-bit the same result in a 1-row decode step and in a (k+1)-row verification.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using vllm_spec_cpu::Half;
using vllm_spec_cpu::kLanes;
using vllm_spec_cpu::widen;

constexpr int kTileRows = 4;        // weight rows per tile
constexpr int kPanelRows = 12;      // widened weight rows per panel (see panel_widened)
constexpr int kHeldRows = 6;        // rows per pass with the weights held (see tile)
constexpr int kPrefetchTiles = 3;   // how far ahead the first pass prefetches (measured: 1-4 alike, 0 slower)
// Activation rows per sweep over the weights: every tile re-reads them, so they must stay in L2 (2048
// rows at once took 1.5-2x torch's time; the weights' extra sweeps cost little where rows are many).
constexpr int64_t kRowsPerSweep = 256;

// A weight matrix as the kernel reads it: kVectors x kLanes float32 lanes of row r from column k (a multiple
// of kLanes kVectors), the rows from r on, an address to prefetch every kLineElems columns (one 64-byte line)
// and the cache level to prefetch into, and for dense weights one column (the k tail).
//
// Prefetched into L2 (_MM_HINT_T1) rather than L1, weights streamed from memory up to 3.4x as fast (one
// core of a 2-core AMD EPYC, one activation row: 16384 x 576 float16 1.94 -> 0.57 ms, as Q8_0 blocks 1.26
// -> 0.72 ms, 1536 x 576 float32 0.28 -> 0.19 ms). Q4_1 blocks, bound by their widening, lost 5-10% that
// way and keep L1.
template <typename W>
struct Dense {   // float32, bfloat16 or float16 elements, ld per row
  static constexpr int64_t kLineElems = 64 / sizeof(W);
  static constexpr bool kWidenOnce = false;
  static constexpr int kVectors = 1;
  static constexpr _mm_hint kPrefetchHint = _MM_HINT_T1;
  using Vector = vllm_spec_cpu::DenseVec;
  const W* p;
  int64_t ld;
  Dense rows_from(int64_t r) const { return {p + r * ld, ld}; }
  void load(int64_t r, int64_t k, Vector* out) const { out[0] = vllm_spec_cpu::vload<Vector>(p + r * ld + k); }
  float at(int64_t r, int64_t k) const { return widen(p[r * ld + k]); }
  const void* addr(int64_t r, int64_t k) const { return p + r * ld + k; }
};

// 32-column blocks (vllm_spec/model/block_quant.py writes them), ld bytes per row: w = d q + m (Q4_1) or
// d q (Q8_0), float32 d and m, small integers q. d q is exact (block_quant checks it), so one rounding,
// fused or not, gives the float32 weight the blocks were made from, bit for bit.
// Many rows are read best widened once (see panel_widened): kWidenOnce.
template <typename Self, int64_t Bytes>
struct Blocks {
  static constexpr int64_t kBytes = Bytes;
  static constexpr bool kWidenOnce = true;
  // A whole block per load: its bytes and scalars read once for its 32 columns (per half block, a Q4_1
  // 1536 x 576 layer took 78 us a row and 114 us for 3 rows, streamed from memory; per block 76 / 105).
  static constexpr int kVectors = 32 / kLanes;
  const uint8_t* p;
  int64_t ld;
  Self rows_from(int64_t r) const { return Self{{p + r * ld, ld}}; }
  const uint8_t* block(int64_t r, int64_t k) const { return p + r * ld + (k >> 5) * kBytes; }
  const void* addr(int64_t r, int64_t k) const { return block(r, k); }
  static float scalar(const uint8_t* b, int at) {
    float v;
    std::memcpy(&v, b + at, sizeof v);
    return v;
  }
  // Row r's K columns into out, a block at a time (widen_block: one load of its bytes for the block's
  // vectors); prefetching the row in `ahead` if given.
  void widen_row(int64_t r, int64_t K, float* out, const Self* ahead) const {
    for (int64_t k = 0; k < K; k += 32) {
      if (ahead && k % Self::kLineElems == 0)
        _mm_prefetch(reinterpret_cast<const char*>(ahead->block(r, k)), _MM_HINT_T0);
      widen_block(block(r, k), out + k);
    }
  }
  template <typename V>
  void load(int64_t r, int64_t k, V* out) const { Self::widen(block(r, k), out); }
  static void widen_block(const uint8_t* b, float* out) {
    typename Self::Vector v[kVectors];
    Self::widen(b, v);
    for (int c = 0; c < kVectors; ++c) vllm_spec_cpu::vstore(out + kLanes * c, v[c]);
  }
};

struct Q4_1Blocks : Blocks<Q4_1Blocks, 24> {   // d, m, then q[j] in byte j's low nibble, q[j + 16] in its high one
  static constexpr int64_t kLineElems = 64;
  static constexpr _mm_hint kPrefetchHint = _MM_HINT_T0;
  using Vector = vllm_spec_cpu::WideVec;
  // widen is forced inline: the tiles' loads and the panels' widening share it, and GCC then left the
  // AVX-512 one out of line (5 rows of a 1536 x 576 layer: 127-188 us against 118-122 inlined).
#if defined(__AVX512F__)
  // With AVX-512 a block's 16 values d q + m (the same FMA per q as below: the same weights) form a table
  // that one permute per 16 columns reads by nibble (permutexvar takes an index's low 4 bits). Widening
  // bounds these steps (a layer takes as long with its weights in L2 as streamed): with the table the
  // 1536 x 576 layer took 74 us a row, 96 us for 3 rows and 123 for 5, against 76 / 105 / 144 (one core of
  // a 2-core AMD EPYC, where a 512-bit op costs two 256-bit ones: a table per half block lost, 100 us a row).
  __attribute__((always_inline)) static void widen(const uint8_t* b, __m512* out) {   // 32 columns as 2 vectors
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(scalar(b, 0)), iota, _mm512_set1_ps(scalar(b, 4)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8)));
    out[0] = _mm512_permutexvar_ps(q, table);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
#else
  __attribute__((always_inline)) static void widen(const uint8_t* b, __m256* out) {   // 32 columns as 4 vectors
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256 d = _mm256_set1_ps(scalar(b, 0)), m = _mm256_set1_ps(scalar(b, 4));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8));
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int c = 0; c < 4; ++c) out[c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[c])), m);
  }
#endif
};

struct Q8_0Blocks : Blocks<Q8_0Blocks, 36> {   // d, then q[0..31] as int8
  static constexpr int64_t kLineElems = 32;
  static constexpr _mm_hint kPrefetchHint = _MM_HINT_T1;
  using Vector = vllm_spec_cpu::DenseVec;
  static void widen(const uint8_t* b, Vector* out) {
    using namespace vllm_spec_cpu;
    const Vector d = vset1<Vector>(scalar(b, 0));
    for (int c = 0; c < kVectors; ++c) out[c] = vmul(d, vload_i8<Vector>(b + 4 + kLanes * c));
  }
};

struct U8x16Blocks : Blocks<U8x16Blocks, 48> {   // d0, m0, d1, m1 (columns 0-15, 16-31), then q[0..31] as uint8
  static constexpr int64_t kLineElems = 32;
  static constexpr _mm_hint kPrefetchHint = _MM_HINT_T1;
  using Vector = vllm_spec_cpu::WideVec;
#if defined(__AVX512F__)
  __attribute__((always_inline)) static void widen(const uint8_t* b, __m512* out) {   // a group per vector
    for (int c = 0; c < 2; ++c) {
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 16 * c)));
      out[c] = _mm512_fmadd_ps(_mm512_set1_ps(scalar(b, 8 * c)), _mm512_cvtepi32_ps(q), _mm512_set1_ps(scalar(b, 8 * c + 4)));
    }
  }
#else
  __attribute__((always_inline)) static void widen(const uint8_t* b, __m256* out) {   // half a group per vector
    for (int c = 0; c < 4; ++c) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 8 * c))));
      out[c] = _mm256_fmadd_ps(_mm256_set1_ps(scalar(b, 4 * (c & 2))), q, _mm256_set1_ps(scalar(b, 4 * (c & 2) + 4)));
    }
  }
#endif
};

// y[m * ldy + r] = dot(x[m * K ...], w[r * K ...]) for r < R, m < MC; with prefetch, the R rows
// kPrefetchTiles tiles further on exist and are prefetched. Two loop orders, one order of sums per
// element: HoldInputs loads each weight vector once per step against the MC rows' inputs, held in
// registers where they fit beside the sums (AVX2, one vector per load: 4 x 3 sums + 3 inputs + 1 weight fill
// the 16 registers; a DenseVec takes two), else read from L1; otherwise the R weight vectors are held and the inputs stream past
// them (2 x 6 sums + 2 weights + 1 input), so 4-6 rows take one pass where the other order needs two (5 rows
// of gate_up: 1.15x a row's time against 1.28x).
template <typename Wt, int R, int MC, bool HoldInputs>
void tile(const float* x, Wt w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  using namespace vllm_spec_cpu;
  using Vec = typename Wt::Vector;
  Vec acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = vzero<Vec>();
  const Wt ahead = prefetch ? w.rows_from(static_cast<int64_t>(kPrefetchTiles) * kTileRows) : w;
  int64_t k = 0;
  constexpr int V = Wt::kVectors;
  for (; k + kLanes * V <= K; k += kLanes * V) {
    if (prefetch && k % Wt::kLineElems == 0)   // one 64-byte line per weight row as the loads reach it
      for (int r = 0; r < R; ++r) _mm_prefetch(static_cast<const char*>(ahead.addr(r, k)), Wt::kPrefetchHint);
    if constexpr (HoldInputs && (V * MC + R * MC + V) * registers_of<Vec> <= kRegisters) {
      Vec xv[V][MC];
      for (int v = 0; v < V; ++v)
        for (int m = 0; m < MC; ++m) xv[v][m] = vload<Vec>(x + m * K + k + kLanes * v);
      for (int r = 0; r < R; ++r) {
        Vec wv[V];
        w.load(r, k, wv);
        for (int v = 0; v < V; ++v)
          for (int m = 0; m < MC; ++m) acc[r][m] = vfma(wv[v], xv[v][m], acc[r][m]);
      }
    } else if constexpr (HoldInputs) {
      for (int r = 0; r < R; ++r) {
        Vec wv[V];
        w.load(r, k, wv);
        for (int v = 0; v < V; ++v)
          for (int m = 0; m < MC; ++m) acc[r][m] = vfma(wv[v], vload<Vec>(x + m * K + k + kLanes * v), acc[r][m]);
      }
    } else {
      Vec wv[R][V];
      for (int r = 0; r < R; ++r) w.load(r, k, wv[r]);
      for (int v = 0; v < V; ++v)
        for (int m = 0; m < MC; ++m) {
          const Vec xv = vload<Vec>(x + m * K + k + kLanes * v);
          for (int r = 0; r < R; ++r) acc[r][m] = vfma(wv[r][v], xv, acc[r][m]);
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) {
      float s = vsum(acc[r][m]);
      if constexpr (!Wt::kWidenOnce)   // (blocks: K is a multiple of 32, no tail)
        for (int64_t t = k; t < K; ++t) s += w.at(r, t) * x[m * K + t];
      y[m * ldy + r] = s;
    }
}

// Up to kHeldRows activation rows in one pass: the tile's weight rows two at a time.
template <typename Wt, int R, int MC>
void rows_in_one_pass(const float* x, Wt w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  static_assert(R % 2 == 0 || R == 1, "pairs of weight rows");
  if constexpr (R == 1) {
    tile<Wt, 1, MC, false>(x, w, K, y, ldy, prefetch);
  } else {
    for (int r = 0; r < R; r += 2) tile<Wt, 2, MC, false>(x, w.rows_from(r), K, y + r, ldy, prefetch);
  }
}

// Passes of 3 rows with the inputs held (tile's 4 x 3 sums read each x vector from L2 once per 4 weight
// rows, where 2 x 6 with the weights held reads it once per 2: 16 rows of gate_up took 1.45x the time
// that way); a remainder of one row is taken as 2 + 2 (a 1-row pass keeps 4 sums in flight, too few for
// the FMA units: 83% of a 3-row pass's time). Only the first pass prefetches. M > 3 (rows' switch).
template <typename Wt, int R>
void passes_of_three(const float* x, int64_t M, Wt w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  const int64_t threes = M % 3 == 1 ? (M - 4) / 3 : M / 3;
  int64_t m = 0;
  for (; m < 3 * threes; m += 3) tile<Wt, R, 3, true>(x + m * K, w, K, y + m * ldy, ldy, prefetch && m == 0);
  for (; m < M; m += 2) tile<Wt, R, 2, true>(x + m * K, w, K, y + m * ldy, ldy, prefetch && m == 0);
}

// All M activation rows against R weight rows: up to 3 in one pass of tile; up to kHeldRows in one pass
// with the weights held (one read of the weights from memory); more in passes of 3 (passes_of_three).
template <typename Wt, int R>
void rows(const float* x, int64_t M, Wt w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  switch (M) {
    case 1: return tile<Wt, R, 1, true>(x, w, K, y, ldy, prefetch);
    case 2: return tile<Wt, R, 2, true>(x, w, K, y, ldy, prefetch);
    case 3: return tile<Wt, R, 3, true>(x, w, K, y, ldy, prefetch);
    case 4: return rows_in_one_pass<Wt, R, 4>(x, w, K, y, ldy, prefetch);
    case 5: return rows_in_one_pass<Wt, R, 5>(x, w, K, y, ldy, prefetch);
    case 6: return rows_in_one_pass<Wt, R, 6>(x, w, K, y, ldy, prefetch);
    default: return passes_of_three<Wt, R>(x, M, w, K, y, ldy, prefetch);
  }
}

// Many activation rows against a tile of blocks (a panel's last rows): its weights widened once into a
// float32 buffer that the passes then read from L1/L2 (widening in every pass made 16 rows 1.3x float32
// weights' time; the values are the same, and so are the sums).
template <typename Wt, int R>
void rows_widened(const float* x, int64_t M, Wt w, int64_t K, float* y, int64_t ldy) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(R * K));
  for (int r = 0; r < R; ++r) w.widen_row(r, K, buffer.data() + r * K, nullptr);
  rows<Dense<float>, R>(x, M, Dense<float>{buffer.data(), K}, K, y, ldy, false);
}

// Blocks against more than kHeldRows rows: kPanelRows weight rows widened once into a float32 buffer,
// then every group of its rows against every pass of activation rows in tiles of 12 sums, 4 weight rows x 3
// activation rows (inputs held) or 3 x 4 (weights held), M = 3 t + 4 f: no pass of fewer rows, whose
// few sums in flight leave the FMA units idle (16 rows as 3, 3, 3, 3, 2, 2 over 4-row tiles: 36.4 ms a
// step of the default model's products, as 3, 3, 3, 3, 4 over 12-row panels 32.0-32.4; 8 rows 22.3 ->
// 19.5). Passes outside, groups inside: a pass's rows stay in L1 for the panel's groups. M > 5 (matmul
// takes this path past kHeldRows).
template <typename Wt>
void panel_widened(const float* x, int64_t M, Wt w, int64_t K, float* y, int64_t ldy, bool prefetch) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(kPanelRows * K));
  const Wt ahead = w.rows_from(prefetch ? kPanelRows : 0);
  for (int r = 0; r < kPanelRows; ++r) w.widen_row(r, K, buffer.data() + r * K, prefetch ? &ahead : nullptr);
  const Dense<float> b{buffer.data(), K};
  const int64_t threes_end = M - 4 * (M % 3);   // (M > 6: f = M % 3 passes of 4 fit)
  int64_t m = 0;
  for (; m < threes_end; m += 3)
    for (int g = 0; g < kPanelRows; g += 4)
      tile<Dense<float>, 4, 3, true>(x + m * K, b.rows_from(g), K, y + m * ldy + g, ldy, false);
  for (; m < M; m += 4)
    for (int g = 0; g < kPanelRows; g += 3)
      tile<Dense<float>, 3, 4, false>(x + m * K, b.rows_from(g), K, y + m * ldy + g, ldy, false);
}

// All of N in panels (the next one prefetched as a panel widens), the rows past the last whole panel in
// tiles of 4, then one by one.
template <typename Wt>
void widened_sweep(const float* xs, int64_t mc, Wt w, int64_t K, float* ys, int64_t N) {
  const int64_t panels = N / kPanelRows;
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      panel_widened(xs, mc, w.rows_from(p * kPanelRows), K, ys + p * kPanelRows, N, p + 1 < panels);
  });
  int64_t n = panels * kPanelRows;
  for (; n + kTileRows <= N; n += kTileRows) rows_widened<Wt, kTileRows>(xs, mc, w.rows_from(n), K, ys + n, N);
  for (; n < N; ++n) rows<Wt, 1>(xs, mc, w.rows_from(n), K, ys + n, N, false);
}

template <typename Wt>
void matmul(const float* xp, Wt w, float* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  constexpr int64_t kAhead = static_cast<int64_t>(kPrefetchTiles + 1) * kTileRows;   // rows a prefetch reaches
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerSweep) {
    const int64_t mc = std::min(kRowsPerSweep, M - m0);
    const float* xs = xp + m0 * K;
    float* ys = yp + m0 * N;
    if constexpr (Wt::kWidenOnce) {
      if (mc > kHeldRows) {   // (up to there one pass: widened as they are read, 5% faster)
        widened_sweep(xs, mc, w, K, ys, N);
        continue;
      }
    }
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kTileRows;
        if (n0 + kTileRows <= N) {
          rows<Wt, kTileRows>(xs, mc, w.rows_from(n0), K, ys + n0, N, n0 + kAhead <= N);
        } else {
          for (int64_t n = n0; n < N; ++n) rows<Wt, 1>(xs, mc, w.rows_from(n), K, ys + n, N, false);
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
    matmul(x.data_ptr<float>(), Dense<float>{w.data_ptr<float>(), K}, y.data_ptr<float>(), M, K, N);
  } else if (wt == at::kHalf) {
    matmul(x.data_ptr<float>(), Dense<Half>{reinterpret_cast<const Half*>(w.data_ptr<at::Half>()), K},
           y.data_ptr<float>(), M, K, N);
  } else {
    matmul(x.data_ptr<float>(), Dense<uint16_t>{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K},
           y.data_ptr<float>(), M, K, N);
  }
  return y;
}


torch::Tensor rows_linear_blocks(const torch::Tensor& x, const torch::Tensor& blocks, const std::string& format) {
  TORCH_CHECK(format == "q4_1" || format == "q8_0" || format == "q8_0_i8" || format == "u8x16",
              "rows_linear_blocks: format q4_1, q8_0, q8_0_i8 or u8x16, not ", format);
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2 && x.size(1) % 32 == 0, "rows_linear_blocks: x [M, K], K % 32 == 0");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  const int64_t ld = K / 32 * (format == "q4_1" ? Q4_1Blocks::kBytes : format == "u8x16" ? U8x16Blocks::kBytes
                                                                                        : Q8_0Blocks::kBytes);
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocks.scalar_type() == at::kByte && blocks.size(1) == ld,
              "rows_linear_blocks: x float32, blocks uint8 [N, ", ld, "] for K = ", K);
  TORCH_CHECK(x.is_contiguous() && blocks.is_contiguous() && x.device().is_cpu() && blocks.device().is_cpu(),
              "rows_linear_blocks: contiguous CPU tensors");
  if (format == "q8_0_i8") return rows_linear_int8(x, blocks);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* p = blocks.data_ptr<uint8_t>();
  if (format == "q4_1") {
    matmul(x.data_ptr<float>(), Q4_1Blocks{{p, ld}}, y.data_ptr<float>(), M, K, N);
  } else if (format == "u8x16") {
    matmul(x.data_ptr<float>(), U8x16Blocks{{p, ld}}, y.data_ptr<float>(), M, K, N);
  } else {
    matmul(x.data_ptr<float>(), Q8_0Blocks{{p, ld}}, y.data_ptr<float>(), M, K, N);
  }
  return y;
}

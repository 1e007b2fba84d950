// y = x W^T with Q8_0 weights and the activations rounded to int8 blocks too, as llama.cpp's Q8_0 dot
// product: a draft's matmul (rows_linear_blocks's format q8_0_i8, vllm_spec/model/block_quant.py's
// int8_tiles). Lossy, so never a target's: a draft's numerics only set how often its tokens are accepted.
//
// rows_linear.cpp widens every weight to float32 and spends a float32 FMA per product, which bounds a
// Q8_0 matmul at one row (16384 x 576: 0.52 ms with its 10.6 MB in cache). Here the weights come in tiles
// of 8 rows laid out so that one vpdpbusd (AVX512-VNNI) multiplies 4 columns of x by those columns of all 8
// rows into each row's own int32 lane: a block of 32 columns is 8 of them, then one float32 FMA scales the
// 8 rows' block sums (0.17 ms for the same matmul).
//
// Tile layout, per block of 32 columns (kTileBlockBytes): the 8 rows' float32 scales d, then for each 4
// columns the 8 rows' 4 values q + 128 as uint8 (q in -127..127, w = d q). Each activation row's block:
// dx = max |x| / 127 (float32), q = the nearest integer to x * (127 / max |x|) (ties to even). vpdpbusd
// multiplies unsigned by signed bytes, so it sums (q_w + 128) q_x: the block's 128 * sum(q_x), computed
// once per activation row, is taken off. Without VNNI (AVX2) maddubs / madd give the same int32 lanes:
// the integers are exact, so every build gives the same bits, and a row the same bits whatever the number
// of rows (each output: its blocks in order of k, even and odd blocks in two float32 sums, then added).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kTileBlockBytes = 8 * 4 + 8 * 32;   // a tile's block: 8 rows' scales and values (see tile)
constexpr int kRowsPerPass = 3;   // activation rows per read of a tile
constexpr int kPrefetchTiles = 3;

// Activation rows rounded to int8 blocks: q [M, K]; per row and block the scale d and 128 * sum(q)
// (what vpdpbusd's offset weights add).
struct Int8Rows {
  int64_t K;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> offset;
};

Int8Rows round_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / 32;
  Int8Rows out{K, std::vector<int8_t>(static_cast<size_t>(M * K)), std::vector<float>(static_cast<size_t>(M * blocks)),
               std::vector<int32_t>(static_cast<size_t>(M * blocks))};
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + m * K + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        v[c] = _mm256_loadu_ps(p + 8 * c);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[c]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      __m256i i[4];
      for (int c = 0; c < 4; ++c) i[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], inv));   // nearest, ties to even
      // packs works within 128-bit halves: the permute puts the 32 bytes back in order.
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + m * K + b * 32), bytes);
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      out.d[m * blocks + b] = top / 127.0f;
      out.offset[m * blocks + b] = 128 * _mm_cvtsi128_si32(s);
    }
  return out;
}

// acc + per lane i: the sum over bytes 4i..4i+3 of w's (unsigned) times x's (signed).
inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#else
  // The weights' q + 128 times x would overflow maddubs's int16 pairs: q x from |q| and x with q's sign
  // instead, and the 128 x that vpdpbusd adds too (taken off with the rows' offsets after either).
  const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i qx = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), ones);
  const __m256i off = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(static_cast<char>(0x80)), x), ones);
  return _mm256_add_epi32(acc, _mm256_add_epi32(qx, off));
#endif
}

inline __m256i broadcast4(const int8_t* p) {   // 4 bytes into every int32 lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// A tile of 8 weight rows against MC activation rows from row m0 of xs: y[m * ldy + r]. A block's 32-byte
// vector holds a 4-column slice of every row, so a dot product against those 4 columns of x (in every
// lane) adds to each row's own lane, with no sums across lanes. With Prefetch the tile kPrefetchTiles on
// is prefetched into L2 as this one is read.
template <int MC, bool Prefetch>
void tile(const Int8Rows& xs, int64_t m0, const uint8_t* w, int64_t blocks, float* y, int64_t ldy) {
  const int64_t K = xs.K;
  __m256 acc[MC][2];
  for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const int8_t* xq = xs.q.data() + m0 * K;
  const float* xd = xs.d.data() + m0 * blocks;
  const int32_t* xo = xs.offset.data() + m0 * blocks;
  for (int64_t j = 0; j < blocks; ++j) {
    const uint8_t* b = w + j * kTileBlockBytes;
    if constexpr (Prefetch)
      for (int64_t at = 0; at < kTileBlockBytes; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchTiles * blocks * kTileBlockBytes + at), _MM_HINT_T1);
    const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(b));
    __m256i wv[8];
    for (int c = 0; c < 8; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * c));
    for (int m = 0; m < MC; ++m) {
      const int8_t* x = xq + m * K + j * 32;
      __m256i s[4];
      for (int c = 0; c < 4; ++c) s[c] = dot_acc(_mm256_setzero_si256(), wv[c], broadcast4(x + 4 * c));
      for (int c = 0; c < 4; ++c) s[c] = dot_acc(s[c], wv[c + 4], broadcast4(x + 16 + 4 * c));
      const __m256i sum = _mm256_sub_epi32(_mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])),
                                           _mm256_set1_epi32(xo[m * blocks + j]));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[m * blocks + j]));
      acc[m][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m][j & 1]);
    }
  }
  for (int m = 0; m < MC; ++m) {
    _mm256_storeu_ps(y + m * ldy, _mm256_add_ps(acc[m][0], acc[m][1]));
  }
}

template <int MC>
void tile(const Int8Rows& xs, int64_t m0, const uint8_t* w, int64_t blocks, float* y, int64_t ldy, bool prefetch) {
  if (prefetch) return tile<MC, true>(xs, m0, w, blocks, y, ldy);
  tile<MC, false>(xs, m0, w, blocks, y, ldy);
}

}  // namespace

torch::Tensor rows_linear_int8(const torch::Tensor& x, const torch::Tensor& weight) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), blocks = K / 32;
  TORCH_CHECK(N % 8 == 0, "rows_linear_blocks: q8_0_i8 weights come in tiles of 8 rows, not ", N);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const Int8Rows xs = round_rows(x.data_ptr<float>(), M, K);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = N / 8, ld = blocks * kTileBlockBytes;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bool prefetch = t + kPrefetchTiles < tiles;
      int64_t m = 0;
      for (; m + kRowsPerPass <= M; m += kRowsPerPass)
        tile<kRowsPerPass>(xs, m, w + t * ld, blocks, yp + m * N + 8 * t, N, prefetch && m == 0);
      if (M - m == 2) tile<2>(xs, m, w + t * ld, blocks, yp + m * N + 8 * t, N, prefetch && m == 0);
      if (M - m == 1) tile<1>(xs, m, w + t * ld, blocks, yp + m * N + 8 * t, N, prefetch && m == 0);
    }
  });
  return y;
}

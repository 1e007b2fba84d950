// Causal attention over the paged KV cache for x86-64 CPUs with AVX2/FMA: every query block of the CPU path
// (vllm_spec/attention/cpu_backend.py), decode, verification of k drafts, the draft's catch-up and prompt
// chunks alike. torch's version gathers every sequence's keys into a padded copy and runs a dozen small ops
// per layer (0.18 ms a layer for one 200-token sequence, 1.2 ms for 16 of 80 tokens on two cores); here each
// (sequence, KV head, tile of query tokens) reads its keys and values where the block table puts them,
// once for all the query heads that share them, and only the keys the tile's last token sees.
//
// Each query row is computed alone (scores in float32, softmax, the probabilities times the values in
// key order), so a token's output is the same bits whatever else is in the batch or its query block:
// a draft verified in a (k+1)-token block gets what a 1-token step gives it, and a prompt token what it
// gets in any other chunking of the prompt (a prefix-cache hit, a token budget), also in bfloat16.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using vllm_spec_cpu::exp8;
using vllm_spec_cpu::lane_sum;
using vllm_spec_cpu::load8;
using vllm_spec_cpu::widen;

// scores[r * ld + j] = dot(q rows r, keys j) for NK keys and NR rows at once: NK x NR sums in flight (chains
// of FMAs that do not wait on each other), each key and row vector loaded once per 8 columns. Every sum
// in the same order (8 lanes over d, the lanes added pairwise, then the tail's fused multiply-adds)
// however rows and keys are grouped.
template <typename C, int NK, int NR>
void dots(const float* const* q, const C* const* keys, int64_t D, float* scores, int64_t ld) {
  __m256 acc[NK][NR];
  for (int j = 0; j < NK; ++j)
    for (int r = 0; r < NR; ++r) acc[j][r] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(q[r] + d);
    for (int j = 0; j < NK; ++j) {
      const __m256 kv = load8(keys[j] + d);
      for (int r = 0; r < NR; ++r) acc[j][r] = _mm256_fmadd_ps(qv[r], kv, acc[j][r]);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int r = 0; r < NR; ++r) {
      float s = lane_sum(acc[j][r]);
      for (int64_t t = d; t < D; ++t) s = std::fma(q[r][t], widen(keys[j][t]), s);
      scores[r * ld + j] = s;
    }
}

// The scores of NK keys for all R rows, Group rows at a time, then the rest. Keys go kKeysAtOnce at a
// time with 3 rows (12 sums: one key at a time left a GQA group of 3 with 3 chains, latency-bound), the
// last keys one at a time with kRowsAtOnce rows.
constexpr int kKeysAtOnce = 4;
constexpr int kRowsAtOnce = 4;

template <typename C, int NK, int Group>
void key_rows(const float* const* q, int64_t R, const C* const* keys, int64_t D, float* scores, int64_t ld) {
  int64_t r = 0;
  for (; r + Group <= R; r += Group) dots<C, NK, Group>(q + r, keys, D, scores + r * ld, ld);
  const int64_t rest = R - r;   // (below Group)
  if (rest == 3) dots<C, NK, 3>(q + r, keys, D, scores + r * ld, ld);
  else if (rest == 2) dots<C, NK, 2>(q + r, keys, D, scores + r * ld, ld);
  else if (rest == 1) dots<C, NK, 1>(q + r, keys, D, scores + r * ld, ld);
}

// acc_r += p_r[s] * v_s[d0, d0 + 8 Regs) for keys s in [begin, end), for NR rows at once (each value vector
// loaded once for them), in key order.
template <typename C, int NR, int Regs>
inline void multiply_in(const float* const* p, const C* const* values, int64_t begin, int64_t end, int64_t d0,
                        __m256 (&acc)[NR][Regs]) {
  for (int64_t s = begin; s < end; ++s) {
    if constexpr (NR == 1) {   // (Regs sums, the broadcast and each value vector as it is loaded: no spills)
      const __m256 ps = _mm256_set1_ps(p[0][s]);
      for (int i = 0; i < Regs; ++i) acc[0][i] = _mm256_fmadd_ps(ps, load8(values[s] + d0 + 8 * i), acc[0][i]);
    } else {
      __m256 v[Regs];
      for (int i = 0; i < Regs; ++i) v[i] = load8(values[s] + d0 + 8 * i);
      for (int r = 0; r < NR; ++r) {
        const __m256 ps = _mm256_set1_ps(p[r][s]);
        for (int i = 0; i < Regs; ++i) acc[r][i] = _mm256_fmadd_ps(ps, v[i], acc[r][i]);
      }
    }
  }
}

// out_r[0, D) += sum over the keys s in [lo_r, hi_r) of p_r[s] * v_s[0, D) (the keys row r sees), for NR
// <= 2 rows, Regs vectors of columns at a time held in registers: the keys both rows see for both at once.
// Every element is one chain of fused multiply-adds in key order (the column tail too, and across calls
// over consecutive keys: a float's store and load are exact), so its bits depend on neither NR, Regs nor
// how the keys are split between calls.
template <typename C, int NR, int Regs>
void weighted_values(const float* const* p, const int64_t* lo, const int64_t* hi, const C* const* values,
                     int64_t D, float* const* out) {
  static_assert(NR == 1 || NR == 2, "one row or a pair");
  int64_t d0 = 0;
  for (; d0 + 8 * Regs <= D; d0 += 8 * Regs) {
    // Row r's sums over keys [begin, end), from and back to its output.
    auto alone = [&](int r, int64_t begin, int64_t end) {
      __m256 one[1][Regs];
      for (int i = 0; i < Regs; ++i) one[0][i] = _mm256_loadu_ps(out[r] + d0 + 8 * i);
      multiply_in<C, 1, Regs>(p + r, values, begin, end, d0, one);
      for (int i = 0; i < Regs; ++i) _mm256_storeu_ps(out[r] + d0 + 8 * i, one[0][i]);
    };
    if constexpr (NR == 1) {
      alone(0, lo[0], hi[0]);
    } else {   // the keys only one row sees (at either end), one row at a time; those both see, both at once
      const int64_t both_lo = std::max(lo[0], lo[1]), both_hi = std::max(both_lo, std::min(hi[0], hi[1]));
      for (int r = 0; r < 2; ++r) alone(r, lo[r], std::min(hi[r], both_lo));
      __m256 acc[2][Regs];
      for (int r = 0; r < 2; ++r)
        for (int i = 0; i < Regs; ++i) acc[r][i] = _mm256_loadu_ps(out[r] + d0 + 8 * i);
      multiply_in<C, 2, Regs>(p, values, both_lo, both_hi, d0, acc);
      for (int r = 0; r < 2; ++r) {
        for (int i = 0; i < Regs; ++i) _mm256_storeu_ps(out[r] + d0 + 8 * i, acc[r][i]);
        alone(r, std::max(lo[r], both_hi), hi[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int64_t d = d0; d < D; ++d) {
      float acc = out[r][d];
      for (int64_t s = lo[r]; s < hi[r]; ++s) acc = std::fma(p[r][s], widen(values[s][d]), acc);
      out[r][d] = acc;
    }
}

struct Shape {
  int64_t H, KVH, D, block_size, width, num_slots;
};

// Query tokens per task: bounds a task's scores (keys x tile rows) and splits a long prompt chunk among
// the threads; a tile reads only the keys its last token sees (the causal triangle's half of the work).
constexpr int64_t kTileTokens = 16;
// Keys whose values are multiplied in for all of a tile's rows before the next ones (their rows in L1).
constexpr int64_t kValueKeys = 32;

// Query tokens [j0, j1) of one sequence's q_len for one KV head: the `group` query heads that share it, for
// each token (token j sits at position seq_len - q_len + j and sees keys up to it, within `window`). Scores
// become softcap * tanh(score / softcap) where softcap > 0 (Gemma 2's).
template <typename C>
void attend(const float* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t seq_len,
            int64_t first_row, int64_t q_len, int64_t j0, int64_t j1, int64_t kvh, const Shape& sh, float scale,
            int64_t window, float softcap, float* out) {
  const int64_t group = sh.H / sh.KVH, D = sh.D, first_pos = seq_len - q_len + j0;
  first_row += j0;
  q_len = j1 - j0;
  // Keys from lo, a multiple of 8, so that key s sits in lane s % 8 of the probabilities' vectors in every
  // block that holds the token (their sums then add the same numbers in the same order: the keys before
  // a token's window add zeros); S rounded up to whole vectors (the padding: probability 0).
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / 8 * 8 : 0;
  const int64_t S = first_pos + q_len - lo, R = q_len * group, S8 = (S + 7) / 8 * 8;
  std::vector<float> probs(R * S8);   // [row][key]: the scores, then in place the probabilities
  std::vector<const C*> keys(S), values(S);
  std::vector<const float*> rows(R);
  for (int64_t j = 0; j < q_len; ++j)
    for (int64_t g = 0; g < group; ++g) rows[j * group + g] = q + ((first_row + j) * sh.H + kvh * group + g) * D;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t pos = lo + s;
    const int64_t slot = table[pos / sh.block_size] * sh.block_size + pos % sh.block_size;
    TORCH_CHECK(slot >= 0 && slot < sh.num_slots, "paged_attention: block table entry outside the cache");
    keys[s] = k_cache + (slot * sh.KVH + kvh) * D;
    values[s] = v_cache + (slot * sh.KVH + kvh) * D;
  }
  int64_t s0 = 0;
  for (; s0 + kKeysAtOnce <= S; s0 += kKeysAtOnce)
    key_rows<C, kKeysAtOnce, 3>(rows.data(), R, keys.data() + s0, D, probs.data() + s0, S8);
  for (; s0 < S; ++s0) key_rows<C, 1, kRowsAtOnce>(rows.data(), R, keys.data() + s0, D, probs.data() + s0, S8);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> seen_lo(R), seen_hi(R);   // the keys row r sees: its position and before, in the window
  for (int64_t r = 0; r < R; ++r) {   // softmax: exp(x - max) / sum
    const int64_t pos = first_pos + r / group;
    seen_lo[r] = window > 0 ? std::max<int64_t>(0, pos - window + 1 - lo) : 0;
    seen_hi[r] = pos + 1 - lo;
    float* p = probs.data() + r * S8;
    const __m256 scales = _mm256_set1_ps(scale);
    for (int64_t s = 0; s < S8; s += 8) _mm256_storeu_ps(p + s, _mm256_mul_ps(_mm256_loadu_ps(p + s), scales));
    if (softcap > 0)
      for (int64_t s = seen_lo[r]; s < seen_hi[r]; ++s) p[s] = softcap * std::tanh(p[s] / softcap);
    std::fill(p, p + seen_lo[r], kNegInf);
    std::fill(p + seen_hi[r], p + S8, kNegInf);
    __m256 tops = _mm256_set1_ps(kNegInf);
    for (int64_t s = 0; s < S8; s += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(p + s));
    // Every token sees itself: top is finite unless the scores hold NaN or +inf (a NaN's exp then makes the
    // row NaN, as torch's, whichever top the vector maximum keeps).
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    const __m256 top = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
    __m256 sums = _mm256_setzero_ps();
    for (int64_t s = 0; s < S8; s += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), top));
      _mm256_storeu_ps(p + s, e);
      sums = _mm256_add_ps(sums, e);
    }
    const __m256 sum = _mm256_set1_ps(lane_sum(sums));
    for (int64_t s = 0; s < S8; s += 8) _mm256_storeu_ps(p + s, _mm256_div_ps(_mm256_loadu_ps(p + s), sum));
  }
  // The probabilities times the values kValueKeys keys at a time for every row, rows in pairs: the block's
  // values stay in L1 for all rows (a long prompt chunk's whole values would be read from L3 per row). The
  // output starts at 0 (zeros_like).
  std::vector<float*> outs(R);
  std::vector<const float*> ps(R);
  for (int64_t r = 0; r < R; ++r) {
    outs[r] = out + ((first_row + r / group) * sh.H + kvh * group + r % group) * D;
    ps[r] = probs.data() + r * S8;
  }
  for (int64_t s0 = 0; s0 < S; s0 += kValueKeys) {
    const int64_t s1 = std::min(S, s0 + kValueKeys);
    int64_t lo_r[2], hi_r[2];
    auto clip = [&](int64_t r, int i) {
      lo_r[i] = std::clamp(seen_lo[r], s0, s1);
      hi_r[i] = std::clamp(seen_hi[r], lo_r[i], s1);
    };
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) {
      clip(r, 0);
      clip(r + 1, 1);
      weighted_values<C, 2, 4>(ps.data() + r, lo_r, hi_r, values.data(), D, outs.data() + r);
    }
    if (r < R) {
      clip(r, 0);
      weighted_values<C, 1, 8>(ps.data() + r, lo_r, hi_r, values.data(), D, outs.data() + r);
    }
  }
}

template <typename C>
void run(const torch::Tensor& q, const C* k_cache, const C* v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, const Shape& sh, float scale,
         int64_t window, float softcap, torch::Tensor& out) {
  const int64_t B = seq_lens.size(0);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  std::vector<int64_t> first_task(B + 1, 0);   // tasks: (sequence, KV head, tile), a sequence's in a row
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && lens[b] <= sh.width * sh.block_size,
                "paged_attention: sequence ", b, " has ", q_len, " queries and length ", lens[b],
                " for a block table of ", sh.width, " blocks");
    first_task[b + 1] = first_task[b] + (q_len + kTileTokens - 1) / kTileTokens * sh.KVH;
  }
  at::parallel_for(0, first_task[B], 1, [&](int64_t i0, int64_t i1) {
    int64_t b = std::upper_bound(first_task.begin(), first_task.end(), i0) - first_task.begin() - 1;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= first_task[b + 1]) ++b;
      const int64_t t = (i - first_task[b]) / sh.KVH, kvh = (i - first_task[b]) % sh.KVH;
      const int64_t q_len = starts[b + 1] - starts[b], j0 = t * kTileTokens;
      attend(qp, k_cache, v_cache, tables + b * sh.width, lens[b], starts[b], q_len, j0,
             std::min(q_len, j0 + kTileTokens), kvh, sh, scale, window, softcap, op);
    }
  });
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const torch::Tensor& query_start_loc, double scale, int64_t window,
                              double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "paged_attention: q [T, H, D] contiguous float32 on the CPU");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type()
                  && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.device().is_cpu()
                  && (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "paged_attention: K/V caches [blocks, block_size, KVH, D], contiguous float32 or bfloat16");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "paged_attention: head sizes of q and the caches");
  const int64_t B = seq_lens.size(0);
  for (const auto* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: int64 contiguous CPU metadata");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && query_start_loc.numel() == B + 1,
              "paged_attention: block_tables [B, W], seq_lens [B], query_start_loc [B + 1]");
  TORCH_CHECK(query_start_loc[0].item<int64_t>() == 0 && query_start_loc[B].item<int64_t>() == q.size(0),
              "paged_attention: query_start_loc must run from 0 to q's token count");
  const Shape sh{H, KVH, D, k_cache.size(1), block_tables.size(1), k_cache.size(0) * k_cache.size(1)};
  auto out = torch::zeros_like(q);
  if (k_cache.scalar_type() == at::kFloat) {
    run(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_tables, seq_lens, query_start_loc, sh,
        static_cast<float>(scale), window, static_cast<float>(softcap), out);
  } else {
    run(q, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), block_tables, seq_lens, query_start_loc,
        sh, static_cast<float>(scale), window, static_cast<float>(softcap), out);
  }
  return out;
}

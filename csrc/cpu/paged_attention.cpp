// Causal attention of short query blocks over the paged KV cache, for x86-64 CPUs with AVX2/FMA: the CPU
// path's decode, verification of k drafts and the draft's catch-up (vllm_spec/attention/cpu_backend.py;
// prompts take torch's SDPA). torch's version gathers every sequence's keys into a padded copy and runs
// a dozen small ops per layer (0.18 ms a layer for one 200-token sequence, 1.2 ms for 16 of 80 tokens on
// two cores); here each (sequence, KV head) reads its keys and values where the block table puts them,
// once for all the query heads that share them.
//
// Each query row is computed alone (scores in float32, softmax, the probabilities times the values in
// key order), so a token's output is the same bits whatever else is in the batch or its query block:
// a draft verified in a (k+1)-token block gets what a 1-token step gives it, also in bfloat16.

#include <ATen/Parallel.h>

#include <algorithm>
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

// scores[j * R + r] = dot(q rows r, keys j) for NK keys and NR rows at once: NK x NR sums in flight (chains
// of FMAs that do not wait on each other), each key and row vector loaded once per 8 columns. Every sum
// in the same order (8 lanes over d, the lanes added pairwise, then the tail) however rows and keys are
// grouped.
template <typename C, int NK, int NR>
void dots(const float* const* q, const C* const* keys, int64_t D, float* scores, int64_t R) {
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
      for (int64_t t = d; t < D; ++t) s += q[r][t] * widen(keys[j][t]);
      scores[j * R + r] = s;
    }
}

// The scores of NK keys for all R rows, Group rows at a time, then the rest. Keys go kKeysAtOnce at a
// time with 3 rows (12 sums: one key at a time left a GQA group of 3 with 3 chains, latency-bound), the
// last keys one at a time with kRowsAtOnce rows.
constexpr int kKeysAtOnce = 4;
constexpr int kRowsAtOnce = 4;

template <typename C, int NK, int Group>
void key_rows(const float* const* q, int64_t R, const C* const* keys, int64_t D, float* scores) {
  int64_t r = 0;
  for (; r + Group <= R; r += Group) dots<C, NK, Group>(q + r, keys, D, scores + r, R);
  const int64_t rest = R - r;   // (below Group)
  if (rest == 3) dots<C, NK, 3>(q + r, keys, D, scores + r, R);
  else if (rest == 2) dots<C, NK, 2>(q + r, keys, D, scores + r, R);
  else if (rest == 1) dots<C, NK, 1>(q + r, keys, D, scores + r, R);
}

// out[0, D) = sum over s of p[s] * v_s[0, D), in key order, 64 columns at a time held in registers.
template <typename C>
void weighted_values(const float* p, const C* const* values, int64_t S, int64_t D, float* out) {
  constexpr int kRegs = 8;
  int64_t d0 = 0;
  for (; d0 + 8 * kRegs <= D; d0 += 8 * kRegs) {
    __m256 acc[kRegs];
    for (int i = 0; i < kRegs; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      if (p[s] == 0.0f) continue;   // masked keys (exp(-inf))
      const __m256 ps = _mm256_set1_ps(p[s]);
      for (int i = 0; i < kRegs; ++i) acc[i] = _mm256_fmadd_ps(ps, load8(values[s] + d0 + 8 * i), acc[i]);
    }
    for (int i = 0; i < kRegs; ++i) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
  }
  for (int64_t d = d0; d < D; ++d) {   // (head sizes that are not a multiple of 64)
    float acc = 0.0f;
    for (int64_t s = 0; s < S; ++s)
      if (p[s] != 0.0f) acc += p[s] * widen(values[s][d]);
    out[d] = acc;
  }
}

struct Shape {
  int64_t H, KVH, D, block_size, width, num_slots;
};

// One sequence's query rows for one KV head: the `group` query heads that share it, for each of its
// q_len tokens (token j sits at position seq_len - q_len + j and sees keys up to it, within `window`).
template <typename C>
void attend(const float* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t seq_len,
            int64_t first_row, int64_t q_len, int64_t kvh, const Shape& sh, float scale, int64_t window,
            float* out) {
  const int64_t group = sh.H / sh.KVH, D = sh.D, first_pos = seq_len - q_len;
  // Keys from lo, a multiple of 8, so that key s sits in lane s % 8 of the probabilities' vectors in every
  // block that holds the token (their sums then add the same numbers in the same order); S rounded up
  // to whole vectors (the padding: probability 0).
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / 8 * 8 : 0;
  const int64_t S = seq_len - lo, R = q_len * group, S8 = (S + 7) / 8 * 8;
  std::vector<float> scores(S * R);   // [key][row]
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
    key_rows<C, kKeysAtOnce, 3>(rows.data(), R, keys.data() + s0, D, scores.data() + s0 * R);
  for (; s0 < S; ++s0) key_rows<C, 1, kRowsAtOnce>(rows.data(), R, keys.data() + s0, D, scores.data() + s0 * R);
  std::vector<float> probs(S8);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < q_len; ++j) {
    const int64_t pos = first_pos + j;
    for (int64_t g = 0; g < group; ++g) {   // softmax: exp(x - max) / sum
      const int64_t r = j * group + g;
      float* p = probs.data();
      for (int64_t s = 0; s < S8; ++s) {
        const int64_t key_pos = lo + s;
        const bool seen = s < S && key_pos <= pos && (window <= 0 || pos - key_pos < window);
        p[s] = seen ? scores[s * R + r] * scale : kNegInf;
      }
      // Every token sees itself: top is finite unless the scores hold NaN or +inf (then the row is NaN, as torch's).
      const __m256 top = _mm256_set1_ps(*std::max_element(p, p + S8));
      __m256 sums = _mm256_setzero_ps();
      for (int64_t s = 0; s < S8; s += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), top));
        _mm256_storeu_ps(p + s, e);
        sums = _mm256_add_ps(sums, e);
      }
      const __m256 sum = _mm256_set1_ps(lane_sum(sums));
      for (int64_t s = 0; s < S8; s += 8) _mm256_storeu_ps(p + s, _mm256_div_ps(_mm256_loadu_ps(p + s), sum));
      weighted_values(p, values.data(), S, D, out + ((first_row + j) * sh.H + kvh * group + g) * D);
    }
  }
}

template <typename C>
void run(const torch::Tensor& q, const C* k_cache, const C* v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, const Shape& sh, float scale,
         int64_t window, int64_t max_q_len, torch::Tensor& out) {
  const int64_t B = seq_lens.size(0);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && lens[b] <= sh.width * sh.block_size,
                "paged_attention: sequence ", b, " has ", q_len, " queries and length ", lens[b],
                " for a block table of ", sh.width, " blocks");
  }
  at::parallel_for(0, B * sh.KVH, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / sh.KVH, kvh = i % sh.KVH;
      const int64_t q_len = starts[b + 1] - starts[b];
      if (q_len > 0 && q_len <= max_q_len)
        attend(qp, k_cache, v_cache, tables + b * sh.width, lens[b], starts[b], q_len, kvh, sh, scale, window, op);
    }
  });
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const torch::Tensor& query_start_loc, double scale, int64_t window,
                              int64_t max_q_len) {
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
        static_cast<float>(scale), window, max_q_len, out);
  } else {
    run(q, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), block_tables, seq_lens, query_start_loc,
        sh, static_cast<float>(scale), window, max_q_len, out);
  }
  return out;
}

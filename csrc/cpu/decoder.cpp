// The decoder layers of a short-query step (decode, verification of drafts, the draft's catch-up) in one
// call: vllm_spec/model/cpu_decoder.py builds a Decoder from a model's layers and runs it in place of the
// Python loop over them. Each layer is the ops the Python layers call, in their order and with their
// rounding (the same functions: add_rms_norm, rows_linear, rotary, paged_attention, silu_mul), so the
// bits are those of the Python path; what goes is the Python between the ops (at batch 1 on 2 cores,
// 6.6 ms of a 17 ms step for the default model's 30 layers against about 1 ms in the ops).

#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

// One projection as vllm_spec.model.layers.linear runs it on the CPU kernel: float32 rows times a dense
// (float32 / bfloat16 / float16) weight or a BlockWeight's blocks, then the bias. A column-parallel
// layer adds its bias to the float32 product (cpu_linear.linear), a row-parallel one after the product
// is in the model's dtype (RowParallelLinear._reduce): bias_after.
struct Projection {
  torch::Tensor weight;   // [N, K], or uint8 blocks [N, bytes] with format
  std::string format;     // "" (dense), or a block format of rows_linear_blocks
  std::optional<torch::Tensor> bias;
  bool bias_after = false;

  torch::Tensor operator()(const torch::Tensor& x) const {
    const torch::Tensor rows = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    torch::Tensor y = format.empty() ? rows_linear(rows, weight) : rows_linear_blocks(rows, weight, format);
    if (bias && !bias_after) y.add_(*bias);
    if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
    return bias && bias_after ? y + *bias : y;
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  double eps;
  Projection qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;
  double scale;
  int64_t window;   // 0: none
  std::optional<torch::Tensor> q_norm, k_norm;   // Qwen3, Gemma 3: each query and key head RMS-normed before the rotation
  // Gemma 3: the attention's and the MLP's outputs normed before their residual adds (post_norm is then the
  // former, pre_mlp_norm the one before the MLP), a GELU (tanh) MLP, and windowed layers rotated by their
  // own cos / sin (local_rope).
  std::optional<torch::Tensor> pre_mlp_norm, post_mlp_norm;
  bool gelu = false;
  bool local_rope = false;
  double softcap = 0;   // Gemma 2's attention scores soft cap (0: none)
};

// Layer by layer: (x, residual) in, (x, residual) out, the K/V of the step's tokens written into each
// layer's cache at slot_mapping first (attention/torch_backend.write_kv_cache's copy).
class Decoder {
 public:
  void add_layer(Layer layer) { layers_.push_back(std::move(layer)); }
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                                  const std::vector<torch::Tensor>& k_caches,
                                                  const std::vector<torch::Tensor>& v_caches,
                                                  const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                                  const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                                                  const std::optional<torch::Tensor>& local_cos,
                                                  const std::optional<torch::Tensor>& local_sin) const {
    TORCH_CHECK(size() > 0 && static_cast<int64_t>(k_caches.size()) == size()
                    && static_cast<int64_t>(v_caches.size()) == size(),
                "Decoder.forward: layers, and one K and one V cache per layer");
    const int64_t T = x.size(0);
    std::optional<torch::Tensor> residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const int64_t q_size = L.heads * L.head_dim, kv_size = L.kv_heads * L.head_dim;
      auto [h, res] = add_rms_norm(x, residual, L.input_norm, L.eps);
      const torch::Tensor qkv = L.qkv(h);
      torch::Tensor q_rows = qkv.narrow(1, 0, q_size), k_rows = qkv.narrow(1, q_size, kv_size);
      if (L.q_norm) {   // (the Python layer's reshape to one row per head, then the same norm)
        q_rows = std::get<0>(add_rms_norm(q_rows.reshape({T * L.heads, L.head_dim}), std::nullopt, *L.q_norm, L.eps));
        k_rows = std::get<0>(add_rms_norm(k_rows.reshape({T * L.kv_heads, L.head_dim}), std::nullopt, *L.k_norm, L.eps));
      }
      TORCH_CHECK(!L.local_rope || (local_cos && local_sin), "Decoder.forward: a layer rotated locally needs local cos / sin");
      auto [q, k] = rotary(q_rows.view({T, L.heads, L.head_dim}), k_rows.view({T, L.kv_heads, L.head_dim}),
                           L.local_rope ? *local_cos : cos, L.local_rope ? *local_sin : sin);
      const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, L.kv_heads, L.head_dim});
      write_kv(k, v, k_caches[i], v_caches[i], slot_mapping);
      const torch::Tensor q32 = q.scalar_type() == at::kFloat ? q : q.to(at::kFloat);
      torch::Tensor attn = paged_attention(q32, k_caches[i], v_caches[i], block_tables, seq_lens, query_start_loc,
                                           L.scale, L.window, L.softcap);
      if (attn.scalar_type() != x.scalar_type()) attn = attn.to(x.scalar_type());
      x = L.o(attn.view({T, q_size}));
      if (L.pre_mlp_norm) x = std::get<0>(add_rms_norm(x, std::nullopt, L.post_norm, L.eps));
      auto [h2, res2] = add_rms_norm(x, res, L.pre_mlp_norm ? *L.pre_mlp_norm : L.post_norm, L.eps);
      const torch::Tensor gate_up = L.gate_up(h2);
      if (L.gelu) {   // (the Python layer's ops: chunk, gelu, mul)
        const auto halves = gate_up.chunk(2, -1);
        x = L.down(at::gelu(halves[0], "tanh") * halves[1]);
      } else {
        x = L.down(silu_mul(gate_up));
      }
      if (L.post_mlp_norm) x = std::get<0>(add_rms_norm(x, std::nullopt, *L.post_mlp_norm, L.eps));
      residual = res2;
    }
    return {x, *residual};
  }

 private:
  // Each token's K and V rows copied to its slot (torch_backend.write_kv_cache's index_copy_, without its
  // per-call dispatch: 60 of them a step). The caches are the queries' dtype (CpuDecoder checks it).
  static void write_kv(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& slots) {
    const int64_t T = k.size(0), row = k.size(1) * k.size(2);
    TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() && k.is_contiguous()
                    && v.stride(2) == 1 && v.stride(1) == v.size(2) && slots.scalar_type() == at::kLong
                    && slots.is_contiguous() && slots.numel() == T,
                "Decoder.write_kv: K/V rows of the caches' dtype, one int64 slot per token");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous()
                    && v_cache.is_contiguous() && k_cache.device().is_cpu() && v_cache.device().is_cpu()
                    && k_cache.size(2) * k_cache.size(3) == row,
                "Decoder.write_kv: K/V caches [blocks, block_size, KVH, D], contiguous, on the CPU");
    const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)   // (all checked before the first copy: an error writes nothing)
      TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "Decoder.write_kv: slot ", slot[t], " outside the cache");
    const size_t bytes = static_cast<size_t>(row) * k.element_size();
    auto* kc = static_cast<char*>(k_cache.data_ptr());
    auto* vc = static_cast<char*>(v_cache.data_ptr());
    const auto* kp = static_cast<const char*>(k.data_ptr());
    const auto* vp = static_cast<const char*>(v.data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(kc + slot[t] * bytes, kp + t * bytes, bytes);
      std::memcpy(vc + slot[t] * bytes, vp + t * v.stride(0) * v.element_size(), bytes);
    }
  }

  std::vector<Layer> layers_;
};

}  // namespace

void bind_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection", "one projection's weight (dense, or blocks of a format) and bias")
      .def(py::init<torch::Tensor, std::string, std::optional<torch::Tensor>, bool>(), py::arg("weight"),
           py::arg("format"), py::arg("bias"), py::arg("bias_after"));
  py::class_<Layer>(m, "Layer", "one decoder layer's norms, projections and attention shape")
      .def(py::init<torch::Tensor, torch::Tensor, double, Projection, Projection, Projection, Projection, int64_t,
                    int64_t, int64_t, double, int64_t, std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, std::optional<torch::Tensor>, bool, bool, double>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("scale"), py::arg("window"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("pre_mlp_norm") = py::none(), py::arg("post_mlp_norm") = py::none(), py::arg("gelu") = false,
           py::arg("local_rope") = false, py::arg("softcap") = 0.0);
  py::class_<Decoder>(m, "Decoder", "decoder layers run in one call for short query blocks")
      .def(py::init<>())
      .def("add_layer", &Decoder::add_layer)
      .def("__len__", &Decoder::size)
      .def("forward", &Decoder::forward, py::call_guard<py::gil_scoped_release>(),
           "(x, residual) after every layer, for x [T, hidden] and the step's metadata", py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("local_cos") = py::none(),
           py::arg("local_sin") = py::none());
}

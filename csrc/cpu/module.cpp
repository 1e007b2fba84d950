// Python bindings of the CPU extension. The GIL is released in every op: the engine's thread computes
// while the server's threads run Python.
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("rows_linear", &rows_linear, release(),
        "x [M, K] (float32) @ w [N, K]^T (float32, bfloat16 or float16) in float32 (AVX2/FMA/F16C)");
  m.def("rows_linear_blocks", &rows_linear_blocks, release(),
        "x [M, K] (float32) @ w^T, w [N, K] held as 32-column blocks (uint8 [N, bytes], format q4_1, q8_0, u8x16 or q8_0_i8:\n"
        "Q8_0 in tiles of 8 rows, the activations rounded to int8 blocks too)");
  m.def("paged_attention", &paged_attention, release(),
        "causal attention of q [T, H, D] (float32) over a paged float32/bfloat16 KV cache -> [T, H, D] float32");
  m.def("add_rms_norm", &add_rms_norm, release(),
        "(RMSNorm(x + residual) * weight, x + residual) for rows of float32/bfloat16, rounded as torch's ops");
  m.def("silu_mul", &silu_mul, release(), "silu(gate) * up for rows [gate | up] of float32/bfloat16");
  m.def("rotary", &rotary, release(), "q, k [T, heads, D] rotated (rotate-half layout) by cos/sin [T, D]");
  m.def("argmax_rows", &argmax_rows, release(), "first maximal index of each float32 row (NaN first), as torch.argmax");
  bind_decoder(m);
}

// The CPU extension's ops (module.cpp binds them; cpu_ops.py builds the folder on first use).
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& w);

torch::Tensor rows_linear_blocks(const torch::Tensor& x, const torch::Tensor& blocks, const std::string& format);

// rows_linear_blocks's q8_0_i8 weights (q8_int8.cpp): activations rounded to int8 blocks too (lossy, a draft's).
torch::Tensor rows_linear_int8(const torch::Tensor& x, const torch::Tensor& weight);

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const torch::Tensor& query_start_loc, double scale, int64_t window,
                              double softcap);

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                                      const torch::Tensor& weight, double eps);

torch::Tensor silu_mul(const torch::Tensor& x);

std::tuple<torch::Tensor, torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                                                const torch::Tensor& sin);

torch::Tensor argmax_rows(const torch::Tensor& x);

// Decoder, Layer and Projection (decoder.cpp): a model's layers run in one call for short query blocks.
void bind_decoder(pybind11::module& m);

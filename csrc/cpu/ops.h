// The CPU extension's ops (module.cpp binds them; cpu_ops.py builds the folder on first use).
#pragma once

#include <torch/extension.h>

torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& w);

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const torch::Tensor& query_start_loc, double scale, int64_t window);

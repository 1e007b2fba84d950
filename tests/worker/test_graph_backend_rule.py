"""Which attention runs where, and where CUDA graphs may be captured: the torch reference reads lengths on
the host, so a runner whose attention would be the torch one on CUDA must stay eager. (Building a runner
for a CUDA device touches no GPU: this runs on CPU-only machines.)"""

from __future__ import annotations

import types

import pytest
import torch

from vllm_spec.attention import layer, torch_backend
from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.llama import LlamaForCausalLM
from vllm_spec.worker.model_runner import ModelRunner

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
TRITON = types.ModuleType("triton_backend_stand_in")


@pytest.mark.parametrize("device, head_dim, dtype, triton", [
    (CPU, 64, torch.float32, False),
    (CUDA, 64, torch.bfloat16, True),
    (CUDA, 80, torch.float16, True),       # padded to 128 by the kernels
    (CUDA, 192, torch.bfloat16, True),
    (CUDA, 128, torch.float32, True),
    (CUDA, 192, torch.float32, False),     # a 256-wide float32 tile: more shared memory than an H200 has
])
def test_backend_choice(monkeypatch, device, head_dim, dtype, triton):
    monkeypatch.setattr(layer, "triton_backend_or_none", lambda: TRITON)
    assert (layer.select_backend(device, head_dim, dtype) is TRITON) == triton


@pytest.mark.parametrize("triton_imports, graphs", [(True, True), (False, False)])
def test_cuda_graphs_only_where_the_triton_kernels_run(monkeypatch, triton_imports, graphs):
    monkeypatch.setattr(layer, "triton_backend_or_none", lambda: TRITON if triton_imports else None)
    arch = ArchConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                                        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=64))
    model = LlamaForCausalLM(arch, GroupCoordinator(), torch.bfloat16, max_positions=64)
    runner = ModelRunner(model, CUDA, block_size=16, max_model_len=64, cuda_graphs=True)
    assert runner.cuda_graphs == graphs
    assert layer.select_backend(CUDA, arch.head_dim, torch.bfloat16) is (TRITON if triton_imports else torch_backend)

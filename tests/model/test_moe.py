"""Mixtral (MixtralForCausalLM): the sparse MoE block against transformers', its configuration and its errors.

The greedy tokens and logits are in test_hf_equality.py (mixtral), speculation in
tests/spec_decode/test_spec_decode_e2e.py, tensor parallelism in tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import edit_checkpoint, finish_gguf, make_tiny_model

from vllm_spec import LLM
from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.layers import RMSNorm
from vllm_spec.model.moe import SparseMoE
from vllm_spec.model.moe_config import MoeConfig

KV = dict(kv_cache_memory_bytes=1 << 24)
BASE = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 96}


@pytest.mark.parametrize("experts, top_k", [(4, 1), (4, 2), (5, 3), (3, 3)])
def test_the_block_is_transformers_block(experts, top_k):
    """Random tokens through our block and transformers' MixtralSparseMoeBlock with the same weights: equal outputs
    (the unpicked experts' zero weights change no sum), and the routing picks top_k experts a token."""
    config = tf.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=experts,
                              num_experts_per_tok=top_k)
    torch.manual_seed(experts * 10 + top_k)
    theirs = tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    moe = MoeConfig(experts, top_k, 48, True, False, (0,), "mixtral")
    ours = SparseMoE(32, moe, "silu", GroupCoordinator(), torch.float32)
    gate_up, down = theirs.experts.gate_up_proj.detach(), theirs.experts.down_proj.detach()
    ours.gate.weight.weight_loader(ours.gate.weight, theirs.gate.weight.detach())
    for e in range(experts):
        ours.w13.weight_loader(ours.w13, gate_up[e, :48], (e, "gate"))
        ours.w13.weight_loader(ours.w13, gate_up[e, 48:], (e, "up"))
        ours.w2.weight_loader(ours.w2, down[e], (e, "down"))
    x = torch.randn(9, 32)
    norm = RMSNorm(32, 1e-6, torch.float32)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    with torch.no_grad():
        out, residual = ours(x, None, norm)
        ref = theirs(norm(x)[0].unsqueeze(0))[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)   # (float32 sums in another order)
    assert torch.equal(residual, x)
    weights, picked = ours.routing(norm(x)[0])
    assert (picked.sum(-1) == top_k).all() and torch.equal(weights > 0, picked)


def test_an_unpicked_experts_overflow_stays_out():
    """float16, one expert's weights so large its output overflows: the tokens that did not pick it stay finite
    (transformers never runs it for them)."""
    moe = MoeConfig(4, 1, 16, True, False, (0,), "mixtral")
    block = SparseMoE(8, moe, "silu", GroupCoordinator(), torch.float16)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in (block.gate.weight, block.w13, block.w2):
            p.normal_(0, 0.5)
        block.w13[3] *= 400
        block.w2[3] *= 400
    norm = RMSNorm(8, 1e-6, torch.float16)
    torch.nn.init.ones_(norm.weight)
    x = torch.randn(32, 8, dtype=torch.float16)
    with torch.no_grad():
        out, _ = block(x, None, norm)
        _, picked = block.routing(norm(x)[0])
    others = ~picked[:, 3]
    assert picked[:, 3].any() and others.any()
    assert torch.isfinite(out[others]).all()


def test_config_defaults_as_transformers():
    """What a Mixtral config leaves out: 8 experts, 2 a token, rope_theta 1e6, no window."""
    cfg = ArchConfig.from_hf_dict(dict(BASE))
    theirs = tf.MixtralConfig(hidden_size=64, num_attention_heads=4)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.rope_theta, cfg.sliding_window) == \
        (theirs.num_local_experts, theirs.num_experts_per_tok, theirs.rope_parameters["rope_theta"], None)
    assert ArchConfig.from_hf_dict({**BASE, "sliding_window": 9}).sliding_window == 9
    assert ArchConfig.from_hf_dict({**BASE, "num_experts": 4}).moe.num_experts == 4   # (transformers' alias)
    assert ArchConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"]}).moe is None


@pytest.mark.parametrize("extra, match", [
    ({"num_local_experts": 0}, r"num_local_experts must be an integer >= 1, got 0"),
    ({"num_experts_per_tok": 1.5}, r"num_experts_per_tok must be an integer >= 1, got 1.5"),
    ({"num_local_experts": 2, "num_experts_per_tok": 3},
     r"num_experts_per_tok \(3\) must be <= num_local_experts \(2\)"),
])
def test_bad_expert_counts_are_named(extra, match):
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf_dict({**BASE, **extra})


def test_checkpoint_errors_name_the_expert_tensors(tmp_path):
    path = make_tiny_model(tmp_path / "m", "mixtral", seed=3)
    edit_checkpoint(path, lambda w: w.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(ValueError, match=r"Checkpoint is missing weights: "
                                         r"\['model.layers.1.block_sparse_moe.experts.2.w3.weight'\]"):
        LLM(str(path), **KV)
    path = make_tiny_model(tmp_path / "m2", "mixtral", seed=3)
    edit_checkpoint(path, lambda w: w.update({"model.layers.0.block_sparse_moe.experts.4.w2.weight": torch.zeros(64, 128)}))
    with pytest.raises(ValueError, match=r"Checkpoint tensor 'model.layers.0.block_sparse_moe.experts.4.w2.weight': "
                                         r"expert 4 is not one of the model's 4 experts"):
        LLM(str(path), **KV)
    path = make_tiny_model(tmp_path / "m3", "mixtral", seed=3)
    edit_checkpoint(path, lambda w: w.update({"model.layers.0.block_sparse_moe.experts.1.w1.weight": torch.zeros(100, 64)}))
    with pytest.raises(ValueError, match=r"Checkpoint tensor 'model.layers.0.block_sparse_moe.experts.1.w1.weight'"):
        LLM(str(path), **KV)
    path = make_tiny_model(tmp_path / "m4", "mixtral", seed=3)
    edit_checkpoint(path, lambda w: w.pop("model.layers.0.block_sparse_moe.gate.weight"))
    with pytest.raises(ValueError, match=r"Checkpoint is missing weights: "
                                         r"\['model.layers.0.block_sparse_moe.gate.weight'\]"):
        LLM(str(path), **KV)


def test_qwen3_moe_config_as_transformers():
    """Qwen3-MoE's keys (num_experts, or num_local_experts as transformers 5 writes it; moe_intermediate_size;
    norm_topk_prob; decoder_sparse_step and mlp_only_layers: which layers are sparse) and their defaults."""
    qwen = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6}
    moe = ArchConfig.from_hf_dict(dict(qwen)).moe
    theirs = tf.Qwen3MoeConfig()
    assert (moe.num_experts, moe.top_k, moe.intermediate, moe.renormalize, moe.layers) == \
        (theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size, theirs.norm_topk_prob,
         tuple(range(6)))
    moe = ArchConfig.from_hf_dict({**qwen, "num_local_experts": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                   "norm_topk_prob": True, "num_experts_per_tok": 2}).moe
    assert (moe.num_experts, moe.layers, moe.renormalize) == (6, (1, 5), True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(8\) must be <= num_experts \(4\)"):
        ArchConfig.from_hf_dict({**qwen, "num_experts": 4})
    with pytest.raises(ValueError, match=r"mlp_only_layers must be a list of layer indices, got 'all'"):
        ArchConfig.from_hf_dict({**qwen, "mlp_only_layers": "all"})
    with pytest.raises(ValueError, match=r"norm_topk_prob must be true or false, got 1"):
        ArchConfig.from_hf_dict({**qwen, "norm_topk_prob": 1})


def test_qwen3_moe_checkpoint_errors_name_its_tensors(tmp_path):
    path = make_tiny_model(tmp_path / "q", "qwen3_moe", seed=3, mlp_only_layers=[0])
    edit_checkpoint(path, lambda w: w.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"Checkpoint is missing weights: "
                                         r"\['model.layers.1.mlp.experts.3.up_proj.weight'\]"):
        LLM(str(path), **KV)
    path = make_tiny_model(tmp_path / "q2", "qwen3_moe", seed=3, mlp_only_layers=[0])
    edit_checkpoint(path, lambda w: w.pop("model.layers.0.mlp.down_proj.weight"))   # (layer 0's dense MLP)
    with pytest.raises(ValueError, match=r"Checkpoint is missing weights: \['model.layers.0.mlp.down_proj.weight'\]"):
        LLM(str(path), **KV)


def test_qwen2_moe_config_as_transformers():
    """Qwen2-MoE: q/k/v biases unless qkv_bias is false, the shared expert's size, windows on the even layers below
    max_window_layers (with use_sliding_window), transformers' defaults."""
    qwen = {**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 6}
    cfg = ArchConfig.from_hf_dict(dict(qwen))
    theirs = tf.Qwen2MoeConfig()
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate, cfg.moe.shared_intermediate,
            cfg.moe.renormalize, cfg.attention_bias, cfg.o_proj_bias, cfg.sliding_window) == \
        (theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
         theirs.shared_expert_intermediate_size, theirs.norm_topk_prob, True, False, None)
    assert not ArchConfig.from_hf_dict({**qwen, "qkv_bias": False}).attention_bias
    windowed = ArchConfig.from_hf_dict({**qwen, "use_sliding_window": True, "sliding_window": 5,
                                        "max_window_layers": 5})
    theirs = tf.Qwen2MoeConfig(num_hidden_layers=6, use_sliding_window=True, sliding_window=5, max_window_layers=5)
    assert windowed.windowed_layers == tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
    assert windowed.windowed_layers == (0, 2, 4) and windowed.sliding_window == 5
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size must be an integer >= 1, got 0"):
        ArchConfig.from_hf_dict({**qwen, "shared_expert_intermediate_size": 0})
    with pytest.raises(ValueError, match=r"max_window_layers must be an integer >= 0, got None"):
        ArchConfig.from_hf_dict({**qwen, "use_sliding_window": True, "max_window_layers": None})
    # (transformers' Qwen2-MoE reads num_experts alone, unlike Mixtral's and Qwen3-MoE's)
    assert ArchConfig.from_hf_dict({**qwen, "num_experts": 4, "num_local_experts": 3}).moe.num_experts == 4


def test_qwen2_moe_without_its_shared_expert_names_it(tmp_path):
    path = make_tiny_model(tmp_path / "q", "qwen2_moe", seed=3)
    edit_checkpoint(path, lambda w: w.pop("model.layers.1.mlp.shared_expert_gate.weight"))
    with pytest.raises(ValueError, match=r"Checkpoint is missing weights: "
                                         r"\['model.layers.1.mlp.shared_expert_gate.weight'\]"):
        LLM(str(path), **KV)
    path = make_tiny_model(tmp_path / "q2", "qwen2_moe", seed=3)
    edit_checkpoint(path, lambda w: w.pop("model.layers.0.mlp.shared_expert.up_proj.weight"))
    with pytest.raises(ValueError, match=r"Checkpoint is missing weights: "
                                         r"\['model.layers.0.mlp.shared_expert.up_proj.weight'\]"):
        LLM(str(path), **KV)


@pytest.mark.parametrize("arch, old, new", [
    ("qwen3_moe", "model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.w1.weight"),
    ("qwen3_moe", "model.layers.0.mlp.gate.weight", "model.layers.0.block_sparse_moe.gate.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w1.weight",
     "model.layers.0.block_sparse_moe.experts.1.gate_proj.weight"),
])
def test_the_other_layouts_names_are_unexpected(tmp_path, arch, old, new):
    """Each model takes its own checkpoint layout's names (as transformers): the other MoE's are refused."""
    path = make_tiny_model(tmp_path / "m", arch, seed=5)
    edit_checkpoint(path, lambda w: w.update({new: w.pop(old)}))
    with pytest.raises(ValueError, match=f"Unexpected weight '{new}'"):
        LLM(str(path), **KV)


def test_expert_sizes_are_checked_against_tensor_parallelism():
    from vllm_spec.config.engine import check_tensor_parallel

    qwen = {**BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2}
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        arch = ArchConfig.from_hf_dict({**qwen, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80,
                                        key: 81})
        with pytest.raises(ValueError, match=rf"The target model's {key} \(81\) must be divisible by "
                                             r"tensor_parallel_size \(2\)"):
            check_tensor_parallel(arch, 2, "target model", "tensor_parallel_size")


def test_the_layers_stay_in_python_on_the_cpu(tmp_path):
    """The C++ decoder takes dense MLPs only: a Mixtral's layers run in Python (and its attention's C++ kernel)."""
    llm = LLM(str(make_tiny_model(tmp_path / "m", "mixtral", seed=4)), device="cpu", **KV)
    assert llm.llm_engine.executor.worker.runner.model.cpu_decoder is None


def test_a_mixture_of_experts_gguf_is_refused_by_name(tmp_path):
    import gguf
    import numpy as np

    from vllm_spec.model.gguf_loader import read_gguf_config

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_block_count(1)
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    finish_gguf(w)
    with pytest.raises(ValueError, match=r"Mixture-of-experts GGUF files \(llama.expert_count 8\) are not supported"):
        read_gguf_config(tmp_path / "m.gguf")

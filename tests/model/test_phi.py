"""Phi (PhiForCausalLM, phi-1 to phi-2): its configuration as transformers' PhiConfig reads it, its biased LM head.

The greedy tokens and logits are in test_hf_equality.py (phi, phi_qk_norm); speculation with Phi pairs in
tests/spec_decode/test_spec_decode_e2e.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import (
    GREEDY,
    assert_matches_transformers,
    copy_with_config,
    make_noisy_draft,
    make_prompts,
    make_tiny_model,
    output_ids,
)

from vllm_spec import LLM
from vllm_spec.model.arch_config import ArchConfig

KV = dict(kv_cache_memory_bytes=1 << 24)
BASE = {"architectures": ["PhiForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 100, "intermediate_size": 96}


def test_config_defaults_as_transformers():
    """What a Phi config leaves out is transformers' PhiConfig default: half of each head rotated (base 10000),
    tanh GELU, eps 1e-5, biases, no q/k norms, every head a KV head, an untied head, bos 1 / eos 2."""
    cfg = ArchConfig.from_hf_dict(dict(BASE))
    theirs = tf.PhiConfig(**{k: v for k, v in BASE.items() if k != "architectures"})
    assert cfg.rotary_dim == int(16 * theirs.rope_parameters["partial_rotary_factor"]) == 8
    assert (cfg.rope_theta, cfg.hidden_act, cfg.rms_norm_eps, cfg.tie_word_embeddings) == \
        (theirs.rope_parameters["rope_theta"], "gelu_tanh", theirs.layer_norm_eps, theirs.tie_word_embeddings)
    assert (cfg.attention_bias, cfg.mlp_bias, cfg.qk_norm, cfg.num_key_value_heads) == (True, True, False, 4)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (theirs.bos_token_id, [theirs.eos_token_id])
    assert ArchConfig.from_hf_dict({**BASE, "architectures": None, "model_type": "phi"}).neox is not None
    # the rotated share from rope_parameters first, then the top level
    params = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.25}
    assert ArchConfig.from_hf_dict({**BASE, "rope_parameters": params, "partial_rotary_factor": 1.0}).rotary_dim == 4
    assert ArchConfig.from_hf_dict({**BASE, "partial_rotary_factor": 1.0}).rotary_dim is None
    assert ArchConfig.from_hf_dict({**BASE, "partial_rotary_factor": None}).rotary_dim == 8
    # a head_dim key sets the heads' width (then hidden_size need not divide by the heads)
    wide = ArchConfig.from_hf_dict({**BASE, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16})
    assert (wide.head_dim, wide.rotary_dim) == (16, 8)


@pytest.mark.parametrize("extra, match", [
    ({"qk_layernorm": "yes"}, r"qk_layernorm must be true or false, got 'yes'"),
    ({"layer_norm_eps": -1}, r"layer_norm_eps must be a finite number >= 0, got -1"),
    ({"partial_rotary_factor": 2}, r"partial_rotary_factor must be a number in \(0, 1\], got 2"),
])
def test_config_errors_name_the_key(extra, match):
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf_dict({**BASE, **extra})


def test_a_draft_of_part_of_the_vocabulary_keeps_its_head_bias(tmp_path):
    """A Phi draft restricted to part of the vocabulary ("vllm_spec_draft_vocab") keeps those tokens' LM head bias
    (the restricted head's bias is the full head's for the subset), and speculation stays lossless."""
    target = make_tiny_model(tmp_path / "target", "phi", seed=62)
    full = make_noisy_draft(target, tmp_path / "draft", 0.04)
    draft = copy_with_config(full, tmp_path / "subset", vllm_spec_draft_vocab=200)
    prompts = make_prompts(8, seed=6)
    expected = output_ids(LLM(str(target), **KV).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3, speculative_policy="fixed", **KV)
    assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    model = llm.llm_engine.executor.worker.proposer.runner.model
    assert model.output_bias is not None and model.output_bias.shape == (200,)
    torch.testing.assert_close(model.output_bias, model.lm_head.bias[:200])


def test_a_head_dim_key_as_transformers(tmp_path):
    """6 heads of 16 over a hidden size of 64 (head_dim given), GQA: transformers' tokens and prompt logprobs."""
    path = make_tiny_model(tmp_path / "phi", "phi", seed=63, num_attention_heads=6, num_key_value_heads=2,
                           head_dim=16)
    assert_matches_transformers(LLM(str(path), **KV), path, [[3 + (7 * i) % 300 for i in range(n)] for n in (5, 37)])

"""GPT-NeoX (GPTNeoXForCausalLM, Pythia's architecture): its configuration as transformers reads it, its
checkpoints' per-head fused q/k/v and old buffers.

The greedy tokens and logits of the parallel and sequential residual layouts are in test_hf_equality.py (gpt_neox,
gpt_neox_sequential); speculation with GPT-NeoX pairs in tests/spec_decode/test_spec_decode_e2e.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import GREEDY, assert_matches_transformers, edit_checkpoint, make_prompts, make_tiny_model, output_ids

from vllm_spec import LLM
from vllm_spec.model.arch_config import ArchConfig

KV = dict(kv_cache_memory_bytes=1 << 24)
BASE = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 96}


def test_config_defaults_as_transformers():
    """What a GPT-NeoX config leaves out is transformers' GPTNeoXConfig default: a quarter of each head rotated with
    base 10000, exact GELU, eps 1e-5, biases, the parallel residual, an untied head, 2048 positions, bos 0 / eos 2."""
    cfg = ArchConfig.from_hf_dict(dict(BASE))
    theirs = tf.GPTNeoXConfig(**{k: v for k, v in BASE.items() if k != "architectures"})
    assert cfg.rotary_dim == int(16 * theirs.rope_parameters["partial_rotary_factor"]) == 4
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert (cfg.hidden_act, cfg.rms_norm_eps, cfg.tie_word_embeddings, cfg.max_position_embeddings) == \
        ("gelu", theirs.layer_norm_eps, theirs.tie_word_embeddings, theirs.max_position_embeddings)
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.neox.use_parallel_residual) == \
        (True, True, True, True)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == (4, 16, None)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (theirs.bos_token_id, [theirs.eos_token_id])
    assert ArchConfig.from_hf_dict({**BASE, "architectures": None, "model_type": "gpt_neox"}).neox is not None


@pytest.mark.parametrize("extra, rotary_dim, theta", [
    ({"rotary_pct": 0.5, "rotary_emb_base": 500}, 8, 500.0),                      # Pythia's config.json keys
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 20.0, "partial_rotary_factor": 1.0}}, None, 20.0),
    ({"rotary_pct": 0.5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 8, 10000.0),
])
def test_rotary_keys_as_transformers_standardizes_them(extra, rotary_dim, theta):
    """rope_parameters (or a legacy rope_scaling in its place) first, then rotary_pct and rotary_emb_base."""
    cfg = ArchConfig.from_hf_dict({**BASE, **extra})
    theirs = tf.GPTNeoXConfig(**{k: v for k, v in {**BASE, **extra}.items() if k != "architectures"})
    assert (cfg.rotary_dim, cfg.rope_theta) == (rotary_dim, theta) == (
        None if theirs.rope_parameters["partial_rotary_factor"] == 1 else
        int(16 * theirs.rope_parameters["partial_rotary_factor"]), theirs.rope_parameters["rope_theta"])


def test_linear_rope_scaling_stretches_the_context(tmp_path):
    """Linear rope scaling: max_model_len is max_position_embeddings x factor (as vLLM), and a prompt past the
    unscaled context gets transformers' prompt logprobs and greedy tokens."""
    path = make_tiny_model(tmp_path / "neox", "gpt_neox", seed=34, max_position_embeddings=64, rotary_pct=0.5,
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    llm = LLM(str(path), **KV)
    assert llm.llm_engine.model_config.max_model_len == 128
    assert_matches_transformers(llm, path, [[3 + (7 * i) % 300 for i in range(100)]])


@pytest.mark.parametrize("extra, match", [
    ({"hidden_size": 66}, r"hidden_size \(66\) must be divisible by num_attention_heads \(4\) for GPTNeoXForCausalLM"),
    ({"use_parallel_residual": 1}, r"use_parallel_residual must be true or false, got 1"),
    ({"attention_bias": "no"}, r"attention_bias must be true or false, got 'no'"),
    ({"rotary_pct": 0}, r"rotary_pct must be a number in \(0, 1\], got 0"),
    ({"rotary_pct": 0.1}, r"must give an even number of rotated dimensions >= 2, got 1"),
    ({"rotary_emb_base": -1}, r"rotary_emb_base must be a positive number, got -1"),
    ({"layer_norm_eps": "tiny"}, r"layer_norm_eps must be a finite number >= 0, got 'tiny'"),
    ({"hidden_act": "relu6"}, r"Unsupported hidden_act 'relu6'"),
    ({"rope_parameters": [1]}, r"rope_parameters must be an object \(dict\) or null, got \[1\]"),
    ({"rope_scaling": []}, r"rope_scaling must be an object \(dict\) or null, got \[\]"),
])
def test_config_errors_name_the_key(extra, match):
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf_dict({**BASE, **extra})


def test_old_buffers_are_skipped_and_the_fused_projection_is_checked(tmp_path):
    """Older Pythia checkpoints hold attention.bias / masked_bias / rotary_emb.inv_freq buffers (and some trainers'
    cos_cached / sin_cached tables), which transformers ignores: so do we; so are GPTNeoXModel's unprefixed names. The
    per-head fused query_key_value must have 3 x hidden rows; a missing tensor is named as the checkpoint names it."""
    path = make_tiny_model(tmp_path / "neox", "gpt_neox", seed=33)
    expected = output_ids(LLM(str(path), **KV).generate(make_prompts(4), GREEDY, use_tqdm=False))
    edit_checkpoint(path, lambda w: w.update({"gpt_neox.layers.0.attention.bias": torch.ones(1, 1, 8, 8),
                                              "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9),
                                              "gpt_neox.layers.1.attention.rotary_emb.inv_freq": torch.ones(2),
                                              "gpt_neox.layers.1.attention.rotary_emb.cos_cached": torch.ones(4, 4),
                                              "gpt_neox.rotary_emb.inv_freq": torch.ones(2)}))
    assert output_ids(LLM(str(path), **KV).generate(make_prompts(4), GREEDY, use_tqdm=False)) == expected
    # GPTNeoXModel's names (no gpt_neox. prefix), which transformers maps too
    edit_checkpoint(path, lambda w: w.update({k.removeprefix("gpt_neox."): w.pop(k) for k in list(w)}))
    assert output_ids(LLM(str(path), **KV).generate(make_prompts(4), GREEDY, use_tqdm=False)) == expected
    name = "layers.1.attention.query_key_value.weight"
    edit_checkpoint(path, lambda w: w.update({name: w[name][:-16]}))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(176, 64\): a fused projection of 192 rows"):
        LLM(str(path), **KV)
    edit_checkpoint(path, lambda w: w.pop(name))
    with pytest.raises(ValueError, match=rf"missing weights: \['gpt_neox.{name}'\]"):
        LLM(str(path), **KV)


@pytest.mark.parametrize("act", ["gelu_fast", "quick_gelu", "relu"])
def test_activations_as_transformers(tmp_path, act):
    """transformers' ACT2FN activations: greedy tokens and prompt logprobs as its model's."""
    path = make_tiny_model(tmp_path / "neox", "gpt_neox", seed=35, hidden_act=act)
    assert_matches_transformers(LLM(str(path), **KV), path, [[3 + (5 * i) % 300 for i in range(30)]])

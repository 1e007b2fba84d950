"""GPT-2 (GPT2LMHeadModel) and GPT-BigCode (GPTBigCodeForCausalLM): their n_* configuration keys as transformers
reads them, GPT-2's Conv1D checkpoints, GPT-BigCode's multi-query c_attn.

The greedy tokens and logits are in test_hf_equality.py (gpt2, gpt2_options, gpt_bigcode, gpt_bigcode_mha);
speculation with these targets and drafts in tests/spec_decode/test_spec_decode_e2e.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import GREEDY, edit_checkpoint, make_prompts, make_tiny_model, output_ids

from vllm_spec import LLM
from vllm_spec.model.arch_config import ArchConfig

KV = dict(kv_cache_memory_bytes=1 << 24)
BASE = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100}


def test_config_defaults_as_transformers():
    """What a GPT-2 config leaves out is transformers' GPT2Config default: 1024 positions, an MLP 4 x n_embd wide
    with tanh GELU, eps 1e-5, biases everywhere, a tied head, bos / eos 50256, scores scaled by head_dim ** -0.5."""
    cfg = ArchConfig.from_hf_dict(dict(BASE))
    theirs = tf.GPT2Config(**{k: v for k, v in BASE.items() if k != "architectures"})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers, cfg.max_position_embeddings) == \
        (theirs.n_embd, theirs.n_head, theirs.n_layer, theirs.n_positions)
    assert (cfg.intermediate_size, cfg.hidden_act, cfg.rms_norm_eps, cfg.tie_word_embeddings) == \
        (4 * theirs.n_embd, "gelu_tanh", theirs.layer_norm_epsilon, theirs.tie_word_embeddings)
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias, cfg.num_key_value_heads, cfg.head_dim) == \
        (True, True, True, 4, 16)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (theirs.bos_token_id, [theirs.eos_token_id])
    assert (cfg.opt.position_offset, cfg.opt.unscaled_attention, cfg.opt.scale_by_inverse_layer) == (0, False, False)
    assert ArchConfig.from_hf_dict({**BASE, "architectures": None, "model_type": "gpt2"}).opt is not None
    assert ArchConfig.from_hf_dict({**BASE, "n_inner": 96}).intermediate_size == 96
    assert cfg.key("num_attention_heads") == "n_head" and cfg.key("intermediate_size") == "n_inner"


def test_keys_spelled_either_way_as_transformers():
    """transformers' attribute_map: hidden_size, num_attention_heads, num_hidden_layers and max_position_embeddings
    stand for n_embd, n_head, n_layer and n_positions (and win over them); other Llama-family keys (an
    intermediate_size, a hidden_act) are no GPT-2 keys and change nothing."""
    spelled = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "hidden_size": 32, "n_embd": 64,
               "num_attention_heads": 2, "num_hidden_layers": 3, "max_position_embeddings": 256,
               "intermediate_size": 100, "hidden_act": "relu"}
    cfg = ArchConfig.from_hf_dict(spelled)
    theirs = tf.GPT2Config(**{k: v for k, v in spelled.items() if k != "architectures"})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers, cfg.max_position_embeddings) == \
        (theirs.n_embd, theirs.n_head, theirs.n_layer, theirs.n_positions) == (32, 2, 3, 256)
    assert (cfg.intermediate_size, cfg.hidden_act) == (4 * 32, "gelu_tanh")


@pytest.mark.parametrize("extra, match", [
    ({"n_head": None}, r"config.json\) has no 'n_head'"),
    ({"n_embd": 66}, r"n_embd \(66\) must be divisible by n_head \(4\) for GPT2LMHeadModel"),
    ({"n_head": 0}, r"n_head must be an integer >= 1, got 0"),
    ({"n_positions": "1k"}, r"n_positions must be an integer >= 1, got '1k'"),
    ({"n_inner": 0}, r"n_inner must be an integer >= 1 or None, got 0"),
    ({"layer_norm_epsilon": -1}, r"layer_norm_epsilon must be a finite number >= 0, got -1"),
    ({"scale_attn_weights": "yes"}, r"scale_attn_weights must be true or false, got 'yes'"),
    ({"add_cross_attention": True}, r"add_cross_attention is not supported: it must be false"),
    ({"activation_function": "tanh"}, r"Unsupported activation_function 'tanh'"),
])
def test_config_errors_name_the_key(extra, match):
    with pytest.raises(ValueError, match=match):   # (None: the key left out)
        ArchConfig.from_hf_dict({k: v for k, v in {**BASE, **extra}.items() if v is not None})


def test_engine_errors_name_gpt2_keys(tmp_path):
    path = make_tiny_model(tmp_path / "gpt2", "gpt2", seed=42, n_head=3, n_embd=48, n_positions=32)
    with pytest.raises(ValueError, match=r"n_head \(3\) must be divisible by tensor_parallel_size \(2\)"):
        LLM(str(path), tensor_parallel_size=2, **KV)
    with pytest.raises(ValueError, match=r"max_model_len \(64\) must be <= the model's n_positions \(32\)"):
        LLM(str(path), max_model_len=64, **KV)


def test_gpt2_model_checkpoints_and_buffers(tmp_path):
    """OpenAI's gpt2 ships GPT2Model's names (no transformer. prefix, no lm_head) with attn.bias / attn.masked_bias
    buffers, which transformers ignores: it loads as the GPT2LMHeadModel checkpoint does. A Conv1D weight of the
    wrong shape and a missing tensor are named."""
    path = make_tiny_model(tmp_path / "gpt2", "gpt2", seed=43)
    expected = output_ids(LLM(str(path), **KV).generate(make_prompts(4), GREEDY, use_tqdm=False))

    def strip(w: dict) -> None:
        w.update({k.removeprefix("transformer."): w.pop(k) for k in list(w) if k.startswith("transformer.")})
        w.update({"h.0.attn.bias": torch.ones(1, 1, 8, 8), "h.1.attn.masked_bias": torch.tensor(-1e4)})

    edit_checkpoint(path, strip)
    assert output_ids(LLM(str(path), **KV).generate(make_prompts(4), GREEDY, use_tqdm=False)) == expected
    name = "h.1.attn.c_attn.weight"
    edit_checkpoint(path, lambda w: w.update({name: w[name][:, :96].contiguous()}))
    with pytest.raises(ValueError, match=r"h.1.attn.c_attn.weight.*shape \(64, 96\): a Conv1D weight of shape "
                                         r"\(64, 192\) \(\[in, out\]\) was expected"):
        LLM(str(path), **KV)
    edit_checkpoint(path, lambda w: w.pop("h.1.attn.c_attn.weight"))
    with pytest.raises(ValueError, match=r"missing weights: \['transformer.h.1.attn.c_attn.weight'\]"):
        LLM(str(path), **KV)
    edit_checkpoint(path, lambda w: w.update({"h.1.attn.c_attn.weight": torch.zeros(64, 192),
                                              "h.0.mlp.c_proj.weight": torch.zeros(64, 256)}))
    with pytest.raises(ValueError, match=r"h.0.mlp.c_proj.weight.*shape \(64, 256\): a Conv1D weight of shape "
                                         r"\(256, 64\)"):
        LLM(str(path), **KV)


def test_bigcode_config_defaults_as_transformers():
    """GPT-BigCode's defaults: multi-query (one KV head), tanh GELU (gelu_pytorch_tanh), no per-layer scaling (its
    config has no such key); multi_query false gives every head its K/V."""
    base = {**BASE, "architectures": ["GPTBigCodeForCausalLM"]}
    cfg = ArchConfig.from_hf_dict(base)
    theirs = tf.GPTBigCodeConfig(**{k: v for k, v in BASE.items() if k != "architectures"})
    assert (cfg.num_key_value_heads, cfg.hidden_act, cfg.max_position_embeddings, cfg.tie_word_embeddings) == \
        (1 if theirs.multi_query else 4, "gelu_tanh", theirs.n_positions, theirs.tie_word_embeddings)
    assert not cfg.opt.scale_by_inverse_layer and cfg.key("num_attention_heads") == "n_head"
    assert ArchConfig.from_hf_dict({**base, "multi_query": False}).num_key_value_heads == 4
    by_type = ArchConfig.from_hf_dict({**base, "architectures": None, "model_type": "gpt_bigcode"})
    assert by_type.num_key_value_heads == 1
    with pytest.raises(ValueError, match=r"multi_query must be true or false, got 1"):
        ArchConfig.from_hf_dict({**base, "multi_query": 1})


def test_bigcode_c_attn_shape_is_checked(tmp_path):
    path = make_tiny_model(tmp_path / "bigcode", "gpt_bigcode", seed=52)
    name = "transformer.h.0.attn.c_attn.weight"
    edit_checkpoint(path, lambda w: w.update({name: w[name][:80].contiguous()}))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(80, 64\): a multi-query c_attn of 96 rows \(64 \+ 16 \+ "
                                         r"16\) was expected"):
        LLM(str(path), **KV)

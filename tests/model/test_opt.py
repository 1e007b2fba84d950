"""OPT (OPTForCausalLM): its configuration as transformers reads it, its checkpoints' names, its layouts.

The greedy tokens and logits of OPT-125m's and OPT-350m's layouts are in test_hf_equality.py (opt,
opt_350m_layout); speculation with OPT targets and drafts in tests/spec_decode/test_spec_decode_e2e.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from conftest import GREEDY, assert_matches_transformers, edit_checkpoint, make_prompts, make_tiny_model, output_ids
from safetensors.torch import load_file, save_file

from vllm_spec import LLM, SamplingParams
from vllm_spec.model.arch_config import ArchConfig

KV = dict(kv_cache_memory_bytes=1 << 24)
BASE = {"architectures": ["OPTForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 100}


def test_config_defaults_as_transformers():
    """What an OPT config leaves out is transformers' OPTConfig default: a 3072-wide ReLU MLP, biases, pre-norms
    with a final norm, tied 2048-position embeddings as wide as the hidden size, bos/eos 2; every head is a KV
    head of hidden_size / heads dims."""
    cfg = ArchConfig.from_hf_dict(dict(BASE))
    theirs = tf.OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.tie_word_embeddings) == \
        (theirs.ffn_dim, theirs.max_position_embeddings, theirs.tie_word_embeddings)
    assert (cfg.hidden_act, cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias) == ("relu", True, True, True)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == (4, 16, None)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (theirs.bos_token_id, [theirs.eos_token_id])
    assert (cfg.opt.word_embed_proj_dim, cfg.opt.do_layer_norm_before, cfg.opt.final_layer_norm,
            cfg.opt.layer_norm_affine) == (theirs.word_embed_proj_dim, True, True, True)
    # a config without "architectures" names its model_type
    assert ArchConfig.from_hf_dict({**BASE, "architectures": None, "model_type": "opt"}).opt is not None
    post = ArchConfig.from_hf_dict({**BASE, "do_layer_norm_before": False, "word_embed_proj_dim": 32,
                                    "enable_bias": False, "activation_function": "gelu_new"})
    assert (post.opt.final_layer_norm, post.opt.word_embed_proj_dim, post.attention_bias, post.mlp_bias,
            post.hidden_act) == (False, 32, False, False, "gelu_tanh")
    assert not ArchConfig.from_hf_dict({**BASE, "_remove_final_layer_norm": True}).opt.final_layer_norm


@pytest.mark.parametrize("extra, match", [
    ({"hidden_size": 66}, r"hidden_size \(66\) must be divisible by num_attention_heads \(4\)"),
    ({"do_layer_norm_before": "yes"}, r"do_layer_norm_before must be true or false, got 'yes'"),
    ({"enable_bias": 1}, r"enable_bias must be true or false, got 1"),
    ({"layer_norm_elementwise_affine": "no"}, r"layer_norm_elementwise_affine must be true or false, got 'no'"),
    ({"word_embed_proj_dim": 0}, r"word_embed_proj_dim must be an integer >= 1 or None, got 0"),
    ({"activation_function": "tanh"}, r"Unsupported activation_function 'tanh' in the model config: supported: "),
    ({"num_attention_heads": 0}, r"num_attention_heads \(0\) must be a positive multiple"),
    ({"ffn_dim": 0}, r"ffn_dim must be an integer >= 1, got 0"),
    ({"hidden_size": None}, r"has no 'hidden_size'"),
])
def test_config_errors_name_the_key(extra, match):
    with pytest.raises(ValueError, match=match):   # (None: the key left out)
        ArchConfig.from_hf_dict({k: v for k, v in {**BASE, **extra}.items() if v is not None})


def test_rotary_settings_change_nothing():
    """OPT's positions are learned: rope_scaling / rope_parameters (which transformers' OPT ignores) neither rotate
    nor stretch max_model_len past the position table."""
    for extra in ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                  {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}}):
        cfg = ArchConfig.from_hf_dict({**BASE, "max_position_embeddings": 48, **extra})
        assert cfg.rope_scaling is None and cfg.max_position_embeddings == 48


def test_opt_model_checkpoints_load(tmp_path):
    """A checkpoint saved from OPTModel names its tensors decoder.* (facebook/opt-125m's do), without lm_head: it
    loads as the model.decoder.* one does; a missing tensor is named as transformers names it, a stray one too."""
    path = make_tiny_model(tmp_path / "opt", "opt", seed=30)
    expected = output_ids(LLM(str(path), **KV).generate(make_prompts(4), GREEDY, use_tqdm=False))
    edit_checkpoint(path, lambda w: w.update({k.removeprefix("model."): w.pop(k) for k in list(w)
                                              if k.startswith("model.")}))
    assert output_ids(LLM(str(path), **KV).generate(make_prompts(4), GREEDY, use_tqdm=False)) == expected
    edit_checkpoint(path, lambda w: w.pop("decoder.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing weights: \['model.decoder.layers.1.self_attn.k_proj.bias'\]"):
        LLM(str(path), **KV)
    edit_checkpoint(path, lambda w: w.update({"decoder.layers.1.self_attn.k_proj.bias": torch.zeros(64),
                                              "decoder.layers.0.mlp.gate_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(ValueError, match=r"Unexpected weight 'decoder.layers.0.mlp.gate_proj.weight'"):
        LLM(str(path), **KV)


def test_positions_past_the_table_are_refused(tmp_path):
    """Learned positions end at max_position_embeddings: a longer max_model_len is refused by name."""
    path = make_tiny_model(tmp_path / "opt", "opt", seed=31, max_position_embeddings=64)
    assert LLM(str(path), **KV).llm_engine.model_config.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len \(65\) must be <= the model's max_position_embeddings"):
        LLM(str(path), max_model_len=65, **KV)


def test_norms_without_weights_and_prompts_to_the_last_position(tmp_path):
    """layer_norm_elementwise_affine false (norms of no weight or bias) and prompts that reach the last position
    of the table: transformers' greedy tokens and prompt logprobs."""
    path = make_tiny_model(tmp_path / "opt", "opt", seed=32, max_position_embeddings=48,
                           layer_norm_elementwise_affine=False)
    assert not any("norm" in k for k in load_file(path / "model.safetensors"))
    prompts = [[3 + (13 * i + j) % 300 for i in range(n)] for j, n in enumerate((5, 23, 40))]
    assert_matches_transformers(LLM(str(path), **KV), path, prompts)


def test_bfloat16_checkpoint_runs_in_its_dtype(tmp_path):
    """A bfloat16 checkpoint (OPT's ship in half precision) runs in bfloat16: its prompt logprobs are the float32
    run's to bfloat16's precision."""
    path = make_tiny_model(tmp_path / "opt", "opt", seed=33)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompts = make_prompts(4, seed=5)
    runs = {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(str(path), device="cpu", dtype=dtype, **KV)
        runs[llm.llm_engine.model_config.dtype] = torch.tensor(
            [next(iter(d.values())).logprob for o in llm.generate(prompts, params, use_tqdm=False)
             for d in o.prompt_logprobs[1:]])
    assert set(runs) == {torch.bfloat16, torch.float32}
    torch.testing.assert_close(runs[torch.bfloat16], runs[torch.float32], atol=0.15, rtol=0.05)

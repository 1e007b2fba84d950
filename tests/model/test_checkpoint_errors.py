"""Checkpoints this engine cannot run as written are refused by name, never loaded partly or wrongly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from safetensors.torch import load_file, save_file

from vllm_spec import LLM, SamplingParams

KW = dict(kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ckpt_base"), "llama", seed=7)


def _variant(base: Path, dest: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of base with config.json keys replaced and its tensors edited by `tensors(dict)`."""
    dest.mkdir()
    cfg = json.loads((base / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dest / "config.json").write_text(json.dumps(cfg))
    weights = load_file(base / "model.safetensors")
    if tensors is not None:
        tensors(weights)
    save_file(weights, dest / "model.safetensors")
    return dest


def test_config_without_architectures_loads_by_model_type(base, tmp_path):
    ref = LLM(str(base), **KW)
    other = LLM(str(_variant(base, tmp_path / "m", {"architectures": None})), **KW)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    assert other.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        ref.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("config, match", [
    ({"hidden_act": "relu6"}, "hidden_act 'relu6'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config: 'fp8'"),
    ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a positive multiple of num_key_value_heads \(3\)"),
    ({"num_key_value_heads": 8}, r"num_attention_heads \(4\) .* num_key_value_heads \(8\)"),
    ({"final_logit_softcapping": 30.0},
     r"final_logit_softcapping \(30.0\) is not supported for LlamaForCausalLM: it must be null \(Gemma"),
    ({"architectures": ["Gemma3ForCausalLM"], "final_logit_softcapping": -1},
     r"final_logit_softcapping \(-1\) is not supported: it must be null or a finite positive number"),
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping \(50.0\) is not supported for LlamaForCausalLM"),
    ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": "50"},
     r"attn_logit_softcapping \('50'\) is not supported: it must be null or a finite positive number"),
    ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 0},
     r"attn_logit_softcapping \(0\) is not supported: it must be null or a finite positive number"),
    ({"architectures": ["Gemma2ForCausalLM"], "final_logit_softcapping": 1e39},
     r"final_logit_softcapping \(1e\+39\) is not supported: it must be null or a finite positive number"),
    ({"architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": -4},
     r"query_pre_attn_scalar must be a positive number \(or null: 256\), got -4"),
    ({"architectures": ["Gemma3ForCausalLM"], "query_pre_attn_scalar": "x"}, "query_pre_attn_scalar must be"),
    ({"architectures": ["GraniteForCausalLM"], "logits_scaling": 0},
     r"logits_scaling must be a finite positive number \(or null: 1\), got 0"),
    ({"architectures": ["GraniteForCausalLM"], "residual_multiplier": "0.5"}, "residual_multiplier must be a finite"),
    ({"head_dim": 0}, r"head_dim must be a positive integer \(or null: hidden_size / num_attention_heads\), got 0"),
    ({"head_dim": "16"}, "head_dim must be a positive integer"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0},
     r"sliding_window must be an integer >= 1 or None, got 0"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": "x"}, "sliding_window must be an integer >= 1 or None"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, r"rope_parameters\['sliding_attention'\]"),
])
def test_unsupported_config_is_named(base, tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(_variant(base, tmp_path / "m", config)), **KW)


def _grow(name: str, dim: int):
    def edit(w: dict) -> None:
        t = w[name]
        extra = list(t.shape)
        extra[dim] = 16
        w[name] = torch.cat([t, torch.zeros(extra, dtype=t.dtype)], dim=dim)
    return edit


@pytest.mark.parametrize("name, dim", [
    ("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.0.self_attn.k_proj.weight", 0),
    ("model.layers.1.mlp.gate_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1),
    ("model.layers.0.self_attn.o_proj.weight", 1), ("model.embed_tokens.weight", 0), ("lm_head.weight", 0),
])
def test_tensor_of_the_wrong_shape_is_named(base, tmp_path, name, dim):
    """A larger tensor than the parameter would load cut down (and a smaller one zero-padded)."""
    with pytest.raises(ValueError, match=f"{name}.*does not match the expected"):
        LLM(str(_variant(base, tmp_path / "m", tensors=_grow(name, dim))), **KW)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_missing_part_of_a_fused_weight_is_named(base, tmp_path, name):
    """q/k/v and gate/up load into one fused parameter each: one of them missing would leave garbage."""
    with pytest.raises(ValueError, match=rf"missing weights: \['{name}'\]"):
        LLM(str(_variant(base, tmp_path / "m", tensors=lambda w: w.pop(name))), **KW)


def _pop_all(*names: str):
    return lambda w: [w.pop(n) for n in names]


@pytest.mark.parametrize("config, tensors, match", [
    # Errors name the checkpoint's tensors, never the fused parameters they load into.
    ({}, lambda w: w.__setitem__("model.layers.9.self_attn.q_proj.weight", torch.zeros(4, 4)),
     r"Unexpected weight 'model\.layers\.9\.self_attn\.q_proj\.weight'"),
    ({}, lambda w: w.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(4)),
     r"Unexpected weight 'model\.layers\.0\.self_attn\.q_proj\.bias'"),
    ({}, _pop_all(*(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")),
     r"missing weights: \['model\.layers\.1\.self_attn\.q_proj\.weight', 'model\.layers\.1\.self_attn\.k_proj"
     r"\.weight', 'model\.layers\.1\.self_attn\.v_proj\.weight'\]"),
    ({"attention_bias": True}, None, r"missing weights: \['model\.layers\.0\.self_attn\.q_proj\.bias'"),
    ({}, _pop_all("model.norm.weight"), r"missing weights: \['model\.norm\.weight'\]"),
])
def test_load_errors_name_the_checkpoint_tensors(base, tmp_path, config, tensors, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(_variant(base, tmp_path / "m", config, tensors)), **KW)


def test_qwen2_windows_follow_transformers_defaults():
    from vllm_spec.model.arch_config import ArchConfig

    base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, sliding_window=8)
    windows = lambda cfg: [ArchConfig.from_hf_dict(cfg).sliding_window_for(i) for i in range(4)]  # noqa: E731
    assert windows(base) == [None] * 4                                     # use_sliding_window off
    assert windows({**base, "use_sliding_window": True}) == [None] * 4     # max_window_layers 28 by default
    assert windows({**base, "use_sliding_window": True, "max_window_layers": 2}) == [None, None, 8, 8]
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert windows({**base, "use_sliding_window": True, "layer_types": layer_types}) == [8, None, 8, None]


def test_windows_of_llama_and_mistral_follow_transformers():
    from vllm_spec.model.arch_config import ArchConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4)
    windows = lambda cfg: [ArchConfig.from_hf_dict(cfg).sliding_window_for(i) for i in range(2)]  # noqa: E731
    llama, mistral = dict(base, architectures=["LlamaForCausalLM"]), dict(base, architectures=["MistralForCausalLM"])
    assert windows({**llama, "sliding_window": 8}) == [None, None]           # Llama never windows
    assert windows({**mistral, "sliding_window": 8}) == [8, 8]
    assert windows(mistral) == [4096, 4096]                                   # MistralConfig's default
    assert windows({**mistral, "sliding_window": None}) == [None, None]
    layer_types = ["full_attention", "sliding_attention"]
    assert windows({**mistral, "sliding_window": 8, "layer_types": layer_types}) == [None, 8]   # Ministral


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"])
def test_a_config_without_a_required_field_names_it(key):
    from vllm_spec.model.arch_config import ArchConfig

    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4)
    del cfg[key]
    with pytest.raises(ValueError, match=f"config.json\\) has no '{key}'"):
        ArchConfig.from_hf_dict(cfg)


def test_attention_bias_field_is_read_as_transformers_does():
    """Qwen2 always has q/k/v biases and Mistral never: transformers ignores their configs' attention_bias."""
    from vllm_spec.model.arch_config import ArchConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4)
    bias = lambda arch, value: ArchConfig.from_hf_dict(  # noqa: E731
        {**base, "architectures": [arch], "attention_bias": value}).attention_bias
    assert bias("Qwen2ForCausalLM", False) and not bias("MistralForCausalLM", True)
    assert bias("LlamaForCausalLM", True) and not bias("LlamaForCausalLM", False)


def test_malformed_config_json_is_named(base, tmp_path):
    bad = _variant(base, tmp_path / "bad")
    (bad / "config.json").write_text('{"architectures": ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        LLM(str(bad), **KW)


def test_load_format_must_match_the_checkpoint(base):
    with pytest.raises(ValueError, match="load_format='gguf' does not match .* an HF folder"):
        LLM(str(base), load_format="gguf", **KW)
    llm = LLM(str(base), load_format="safetensors", **KW)
    assert len(llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)) == 1


@pytest.mark.parametrize("rope, limit", [
    (None, 512),
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"type": "linear", "factor": 4.0}, 2048),   # transformers' older key
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, 512),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),   # original x factor
])
def test_max_model_len_is_bounded_as_vllm_bounds_it(base, tmp_path, rope, limit):
    """max_position_embeddings (512 here), times the factor of linear rope scaling (llama3's configs count
    their scaling in max_position_embeddings already; yarn stretches its original context): the default, and
    the most that may be asked."""
    folder = _variant(base, tmp_path / "m", {"rope_scaling": rope, "max_position_embeddings": 512})
    assert LLM(str(folder), **KW).llm_engine.config.model.max_model_len == limit
    LLM(str(folder), max_model_len=limit, **KW)
    with pytest.raises(ValueError, match=rf"max_model_len \({limit + 1}\) must be <= the model's "
                                         rf"(original_)?max_position_emb.* \({limit}\)"):
        LLM(str(folder), max_model_len=limit + 1, **KW)


def test_a_tied_models_own_lm_head_is_ignored_with_a_warning(base, tmp_path, caplog):
    """tie_word_embeddings true: as in vLLM the embedding is the LM head; a checkpoint lm_head.weight that differs
    from it is named in a warning (transformers would keep it), one equal to it passes silently."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tied(folder: str, head):
        return _variant(base, tmp_path / folder, {"tie_word_embeddings": True},
                        lambda w: w.update({"lm_head.weight": head(w["model.embed_tokens.weight"])}))

    same = tied("same", lambda emb: emb.clone())
    other = tied("other", lambda emb: torch.randn(emb.shape))
    with caplog.at_level("WARNING", logger="vllm_spec.model.causal_lm"):
        ref = LLM(str(same), **KW).generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert "lm_head.weight" not in caplog.text
        out = LLM(str(other), **KW).generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert "tie_word_embeddings is true, so the LM head is the token embedding" in caplog.text
    assert out == ref

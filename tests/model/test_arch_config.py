"""ArchConfig.from_hf_dict against transformers' reading of the same config.json: the values of the keys a
config leaves out, per architecture."""

from __future__ import annotations

import pytest
import transformers as tf

from vllm_spec.model.arch_config import ArchConfig

CLASSES = {"LlamaForCausalLM": tf.LlamaConfig, "GraniteForCausalLM": tf.GraniteConfig, "MistralForCausalLM": tf.MistralConfig,
           "Qwen2ForCausalLM": tf.Qwen2Config, "Qwen3ForCausalLM": tf.Qwen3Config,
           "Gemma2ForCausalLM": tf.Gemma2Config, "Gemma3ForCausalLM": tf.Gemma3TextConfig,
           "Phi3ForCausalLM": tf.Phi3Config, "MixtralForCausalLM": tf.MixtralConfig,
           "Qwen3MoeForCausalLM": tf.Qwen3MoeConfig, "Qwen2MoeForCausalLM": tf.Qwen2MoeConfig,
           "GemmaForCausalLM": tf.GemmaConfig, "SmolLM3ForCausalLM": tf.SmolLM3Config}


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_keys_a_config_leaves_out_read_as_transformers(arch):
    """A hand-written config.json with only the shapes: heads of KV, head size, context, norms' epsilon, tied
    embeddings, Gemma's soft caps and query scale as transformers takes them."""
    given = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 32, "num_hidden_layers": 2,
             "vocab_size": 100, "intermediate_size": 96}
    ours = ArchConfig.from_hf_dict(dict(given))
    theirs = CLASSES[arch](**{k: v for k, v in given.items() if k != "architectures"})
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert (ours.num_key_value_heads, ours.head_dim, ours.max_position_embeddings, ours.rms_norm_eps,
            ours.tie_word_embeddings) == (theirs.num_key_value_heads, head_dim, theirs.max_position_embeddings,
                                          theirs.rms_norm_eps, theirs.tie_word_embeddings)
    assert ours.attn_logit_softcapping == getattr(theirs, "attn_logit_softcapping", None)
    assert ours.final_logit_softcapping == getattr(theirs, "final_logit_softcapping", None)
    if arch == "GraniteForCausalLM":
        assert (ours.attention_scale, ours.embedding_multiplier, ours.residual_multiplier, ours.logits_scaling) == \
            (theirs.attention_multiplier, theirs.embedding_multiplier, theirs.residual_multiplier, theirs.logits_scaling)
    if arch == "GemmaForCausalLM":
        assert ours.attention_scale is None and ours.hidden_act == "gelu_tanh"
        assert theirs.hidden_act == "gelu_pytorch_tanh"
        assert ours.embed_scale and ours.norm_unit_offset and not ours.sandwich_norms
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5
        assert ours.hidden_act == "gelu_tanh" and theirs.hidden_activation == "gelu_pytorch_tanh"
        windowed = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
        assert (ours.sliding_window, ours.windowed_layers) == (theirs.sliding_window, windowed)


def test_gemma_takes_hidden_activation_alone():
    """transformers' Gemma MLPs read hidden_activation; a hidden_act beside it (or without it) changes nothing."""
    base = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 96}
    assert ArchConfig.from_hf_dict({**base, "hidden_act": "silu"}).hidden_act == "gelu_tanh"
    with pytest.raises(ValueError, match="Unsupported hidden_activation 'relu6'"):
        ArchConfig.from_hf_dict({**base, "hidden_activation": "relu6"})


def test_the_others_take_hidden_act_alone():
    """transformers' Llama, Mistral and Qwen read hidden_act; a hidden_activation key changes nothing."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 100, "intermediate_size": 96, "hidden_activation": "gelu_pytorch_tanh"}
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert ArchConfig.from_hf_dict({**base, "architectures": [arch]}).hidden_act == "silu"


BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 96}


@pytest.mark.parametrize("key, value, message", [
    ("max_position_embeddings", None, r"max_position_embeddings must be an integer >= 1, got None"),
    ("max_position_embeddings", "100", "max_position_embeddings must be an integer >= 1"),
    ("max_position_embeddings", 100.5, "max_position_embeddings must be an integer >= 1"),
    ("max_position_embeddings", 0, "max_position_embeddings must be an integer >= 1"),
    ("max_position_embeddings", True, "max_position_embeddings must be an integer >= 1"),
    ("num_hidden_layers", "2", "num_hidden_layers must be an integer >= 1"),
    ("vocab_size", -3, "vocab_size must be an integer >= 1"),
    ("intermediate_size", None, "intermediate_size must be an integer >= 1"),
    ("num_attention_heads", "4", r"num_attention_heads \('4'\) must be a positive multiple"),
    ("rms_norm_eps", None, r"rms_norm_eps must be a finite number >= 0, got None"),
    ("rms_norm_eps", "x", "rms_norm_eps must be a finite number"),
    ("rms_norm_eps", float("inf"), "rms_norm_eps must be a finite number"),
    ("rope_scaling", "x", r"rope_scaling must be an object \(dict\) or null, got 'x'"),
    ("rope_parameters", [1], "rope_parameters must be an object"),
    ("eos_token_id", 1.5, r"eos_token_id \(1.5\) and bos_token_id \(None\) must be token ids"),
    ("eos_token_id", "x", "must be token ids"),
    ("eos_token_id", [1, -2], "must be token ids"),
    ("bos_token_id", "1", "must be token ids"),
    ("architectures", "LlamaForCausalLM", "architectures must be a list of architecture names"),
    ("tie_word_embeddings", "false", r"tie_word_embeddings must be true or false, got 'false'"),
    ("attention_bias", 1, "attention_bias must be true or false"),
])
def test_config_values_of_the_wrong_kind_are_named(key, value, message):
    """A config.json value (or an hf_overrides one) of the wrong type or range: a ValueError naming the key and
    what it takes, never a TypeError from deep inside the engine."""
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_dict({**BASE, key: value})


def test_a_gemma_3_window_pattern_of_the_wrong_kind_is_named():
    config = {**BASE, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": "x"}
    with pytest.raises(ValueError, match="sliding_window_pattern must be an integer >= 1, got 'x'"):
        ArchConfig.from_hf_dict(config)


def test_scales_float32_cannot_hold_are_refused():
    """Soft caps and Gemma's query scale below float32's normal range would round to 0 (inf once inverted)."""
    for key in ("final_logit_softcapping", "query_pre_attn_scalar"):
        with pytest.raises(ValueError, match=key):
            ArchConfig.from_hf_dict({**BASE, "architectures": ["Gemma2ForCausalLM"], key: 1e-320})


def test_smollm3_nope_layers_and_windows_as_transformers():
    """SmolLM3's layers without a rotary embedding (no_rope_layers, else every no_rope_layer_interval-th) and its
    windows (with use_sliding_window: the NoPE layers unless layer_types says otherwise)."""
    base = {**BASE, "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8}
    for extra in ({}, {"no_rope_layer_interval": 3}, {"no_rope_layers": [1, 0, 0, 1, 1, 1, 1, 0, 0]},
                  {"use_sliding_window": True, "sliding_window": 16}):
        ours = ArchConfig.from_hf_dict({**base, **extra})
        theirs = tf.SmolLM3Config(**{k: v for k, v in base.items() if k != "architectures"}, pad_token_id=0, **extra)
        assert ours.unrotated_layers == tuple(i for i, f in enumerate(theirs.no_rope_layers[:8]) if not f)
        windowed = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
        assert (ours.windowed_layers if ours.sliding_window else ()) == (windowed if theirs.use_sliding_window else ())
    # (layer_types given: transformers' masks window those layers, use_sliding_window or not)
    types = ["sliding_attention", "full_attention"] * 4
    ours = ArchConfig.from_hf_dict({**base, "sliding_window": 4, "layer_types": types})
    assert (ours.sliding_window, ours.windowed_layers) == (4, (0, 2, 4, 6))
    assert ArchConfig.from_hf_dict(base).rope_theta == 2000000.0 and ArchConfig.from_hf_dict(base).tie_word_embeddings
    with pytest.raises(ValueError, match=r"no_rope_layers must be a list of at least 8 flags \(one a layer; 1: the "
                                         r"layer rotates, 0: it does not\), got \[1, 0\]"):
        ArchConfig.from_hf_dict({**base, "no_rope_layers": [1, 0]})
    with pytest.raises(ValueError, match=r"no_rope_layer_interval must be an integer >= 1, got 0"):
        ArchConfig.from_hf_dict({**base, "no_rope_layer_interval": 0})


@pytest.mark.parametrize("extra, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}},
     r"original_max_position_embeddings must be an integer >= 1, got 0"),
    ({"rope_theta": "abc"}, r"rope_theta must be a positive number, got 'abc'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": [1]}}, r"rope_theta must be a positive number"),
    ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {"full_attention": {}, "sliding_attention": 5}},
     r"rope_parameters\['sliding_attention'\] must be an object \(dict\) or null, got 5"),
    ({"architectures": ["MistralForCausalLM"], "layer_types": ["sliding_attention"]},
     r"layer_types must be a list of 2 entries \(one a layer\), each 'sliding_attention' or 'full_attention'"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "layer_types": ["full_attention", "x"]},
     r"layer_types must be a list of 2 entries"),
])
def test_bad_rotary_and_layer_settings_are_named(extra, match):
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf_dict({**BASE, **extra})


def test_yarn_defaults_come_from_the_models_context():
    """A YaRN rope_scaling without its original context (or with null) takes max_position_embeddings (the absent
    default where the config has none), and factor from the two, as transformers does."""
    for given in ({}, {"original_max_position_embeddings": None}):
        cfg = ArchConfig.from_hf_dict({**BASE, "max_position_embeddings": 512,
                                       "rope_scaling": {"rope_type": "yarn", "factor": 2.0, **given}})
        assert cfg.rope_scaling["original_max_position_embeddings"] == 512
    cfg = ArchConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn",
                                                            "original_max_position_embeddings": 512}})
    assert cfg.rope_scaling["factor"] == 2048 / 512


def test_mixtral_takes_num_experts_before_num_local_experts():
    """transformers' MixtralConfig given both keys takes num_experts (Qwen3-MoE's num_local_experts)."""
    mixtral = {**BASE, "architectures": ["MixtralForCausalLM"], "num_experts": 4, "num_local_experts": 6}
    assert ArchConfig.from_hf_dict(mixtral).moe.num_experts == tf.MixtralConfig(num_experts=4, num_local_experts=6,
                                                                               ).num_local_experts == 4
    qwen = {**mixtral, "architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 2}
    assert ArchConfig.from_hf_dict(qwen).moe.num_experts == 6

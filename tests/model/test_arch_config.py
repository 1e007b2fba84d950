"""ArchConfig.from_hf_dict against transformers' reading of the same config.json: the values of the keys a
config leaves out, per architecture."""

from __future__ import annotations

import pytest
import transformers as tf

from vllm_spec.model.arch_config import ArchConfig

CLASSES = {"LlamaForCausalLM": tf.LlamaConfig, "MistralForCausalLM": tf.MistralConfig,
           "Qwen2ForCausalLM": tf.Qwen2Config, "Qwen3ForCausalLM": tf.Qwen3Config,
           "Gemma2ForCausalLM": tf.Gemma2Config, "Gemma3ForCausalLM": tf.Gemma3TextConfig}


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
    if arch.startswith("Gemma"):
        assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5
        assert ours.hidden_act == "gelu_tanh" and theirs.hidden_activation == "gelu_pytorch_tanh"
        windowed = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
        assert (ours.sliding_window, ours.windowed_layers) == (theirs.sliding_window, windowed)


def test_gemma_takes_hidden_activation_alone():
    """transformers' Gemma MLPs read hidden_activation; a hidden_act beside it (or without it) changes nothing."""
    base = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 96}
    assert ArchConfig.from_hf_dict({**base, "hidden_act": "silu"}).hidden_act == "gelu_tanh"
    with pytest.raises(ValueError, match="Unsupported hidden_activation 'relu'"):
        ArchConfig.from_hf_dict({**base, "hidden_activation": "relu"})

"""Phi-3 (Phi3ForCausalLM): fused checkpoint projections, partial rotation and LongRoPE, against transformers.

The greedy tokens and logits of the usual variants are in test_hf_equality.py (phi3, phi3_longrope); here the
long factors, the configuration rules and the errors.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from conftest import edit_checkpoint, finish_gguf, make_tiny_model
from test_hf_equality import longrope_scaling

from vllm_spec import LLM, SamplingParams
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.rotary import RotaryEmbedding, rope_type

KV = dict(kv_cache_memory_bytes=1 << 24)
BASE = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 100, "intermediate_size": 96}


def _hf(path) -> tf.PreTrainedModel:
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         use_cache=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_long_factors_past_the_original_context_match_transformers(tmp_path):
    """An engine context past the original one (16 here) rotates with the long factors at every position, as
    vLLM does; transformers takes them for a sequence longer than the original context: prompts of 20-40
    tokens give its greedy tokens and prompt logprobs (with partial rotation and GQA)."""
    path = make_tiny_model(tmp_path / "p", "phi3", seed=21, max_position_embeddings=256,
                           original_max_position_embeddings=16, partial_rotary_factor=0.5,
                           rope_scaling=longrope_scaling(4, seed=21))
    llm = LLM(str(path), **KV)
    assert llm.llm_engine.model_config.max_model_len == 256
    hf = _hf(path)
    prompts = [[3 + (11 * i + j) % 300 for i in range(n)] for j, n in enumerate((20, 31, 40))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids, 12)
        ours = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        ref = logits.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_model_len, long", [(32, False), (33, True), (4096, True)])
def test_the_engine_context_picks_the_factors(max_model_len, long):
    """The tables' frequencies and scale are transformers' for a sequence of max_model_len tokens: the short
    factors up to the original context (32), the long ones past it, the attention factor from the two
    contexts either way."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = longrope_scaling(8, seed=5)
    config = tf.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
                           original_max_position_embeddings=32, rope_scaling=dict(scaling), pad_token_id=0)
    inv, attention = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=max_model_len)
    arch = ArchConfig.from_hf_dict({**BASE, "max_position_embeddings": 4096, "original_max_position_embeddings": 32,
                                    "rope_scaling": scaling})
    rope = RotaryEmbedding(16, 4096, arch.rope_theta, arch.rope_scaling, max_model_len)
    positions = torch.arange(4096, dtype=torch.float32)
    freqs = torch.outer(positions, inv)
    torch.testing.assert_close(rope.cos, torch.cat([freqs, freqs], -1).cos() * attention)
    short = RotaryEmbedding(16, 4096, arch.rope_theta, arch.rope_scaling, 32)
    assert torch.equal(rope.cos, short.cos) != long
    assert attention == pytest.approx((1 + torch.log(torch.tensor(128.0)).item() / torch.log(torch.tensor(32.0)).item())
                                      ** 0.5)


def test_config_defaults_and_spellings_as_transformers():
    """What a Phi-3 config leaves out (epsilon 1e-5, a 4096-token context, an original context of 4096, no
    window) and LongRoPE's older names ("su", and "yarn", which transformers' Phi-3 reads as LongRoPE)."""
    cfg = ArchConfig.from_hf_dict(dict(BASE))
    theirs = tf.Phi3Config(hidden_size=64, num_attention_heads=4, pad_token_id=0)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.sliding_window, cfg.rotary_dim) == \
        (theirs.rms_norm_eps, theirs.max_position_embeddings, None, None)
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for kind in ("su", "yarn", "longrope"):
        cfg = ArchConfig.from_hf_dict({**BASE, "max_position_embeddings": 8192,
                                       "rope_scaling": {"type": kind, **factors}})
        assert rope_type(cfg.rope_scaling) == "longrope"
        assert (cfg.rope_scaling["original_max_position_embeddings"], cfg.rope_scaling["factor"]) == (4096, 2.0)
    # the top level's original context first (as transformers), then rope_scaling's
    cfg = ArchConfig.from_hf_dict({**BASE, "original_max_position_embeddings": 1024, "rope_scaling": {
        "type": "longrope", "original_max_position_embeddings": 2048, **factors}})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 1024
    assert ArchConfig.from_hf_dict({**BASE, "sliding_window": 7}).sliding_window == 7


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_factor_is_read_where_transformers_reads_it(where):
    extra = {"partial_rotary_factor": 0.75} if where == "top" else \
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}
    assert ArchConfig.from_hf_dict({**BASE, **extra}).rotary_dim == 12
    # (other families do not rotate partially in transformers: the key changes nothing there)
    assert ArchConfig.from_hf_dict({**BASE, **extra, "architectures": ["LlamaForCausalLM"]}).rotary_dim is None


@pytest.mark.parametrize("extra, match", [
    ({"partial_rotary_factor": 0}, r"partial_rotary_factor must be a number in \(0, 1\], got 0"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be a number in \(0, 1\]"),
    ({"partial_rotary_factor": "half"}, r"partial_rotary_factor must be a number in \(0, 1\], got 'half'"),
    ({"partial_rotary_factor": 0.4375}, r"partial_rotary_factor \(0.4375\) x head_dim \(16\) must give an even "
                                        r"number of rotated dimensions >= 2, got 7"),
    ({"partial_rotary_factor": 0.1}, r"must give an even number of rotated dimensions >= 2, got 1"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}},
     r"rope_scaling of type 'longrope' needs 'long_factor': a list of 8 positive numbers"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}},
     r"needs 'short_factor': a list of 8 positive numbers"),
    ({"partial_rotary_factor": 0.5, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                     "long_factor": [1.0] * 8}},
     r"needs 'short_factor': a list of 4 positive numbers \(one per rotated frequency\)"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [-2.0]}},
     r"needs 'long_factor'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                       "attention_factor": -1}}, r"attention_factor must be a positive number or null, got -1"),
    ({"original_max_position_embeddings": 0, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                              "long_factor": [1.0] * 8}},
     r"original_max_position_embeddings must be an integer >= 2"),
])
def test_bad_rotary_settings_are_named(extra, match):
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf_dict({**BASE, **extra})


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    path = make_tiny_model(tmp_path / "p", "phi3", seed=22)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    edit_checkpoint(path, lambda w: w.update({name: w[name][:-16].clone()}))
    with pytest.raises(ValueError, match=r"Checkpoint tensor 'model.layers.1.self_attn.qkv_proj.weight': shape "
                                         r"\(112, 64\): a fused projection of 128 rows \(64 \+ 32 \+ 32\)"):
        LLM(str(path), **KV)


def test_a_checkpoint_without_its_fused_projection_names_it(tmp_path):
    path = make_tiny_model(tmp_path / "p", "phi3", seed=22)
    edit_checkpoint(path, lambda w: w.pop("model.layers.0.mlp.gate_up_proj.weight"))
    with pytest.raises(ValueError, match=r"Checkpoint is missing weights: .*model.layers.0.mlp.gate_up_proj.weight"):
        LLM(str(path), **KV)


def test_model_type_alone_names_phi3(tmp_path):
    path = make_tiny_model(tmp_path / "p", "phi3", seed=23)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("architectures")
    (path / "config.json").write_text(json.dumps(cfg))
    assert LLM(str(path), **KV).llm_engine.model_config.arch.architecture == "Phi3ForCausalLM"


def _write_phi3_gguf(path, *, hidden=32, heads=4, kv_heads=2, inter=48, layers=2, vocab=64, rotated=4,
                     factors=None, window=0, drop=None, extra=None) -> dict:
    """A tiny GGUF as llama.cpp's converter writes a Phi-3: fused attn_qkv and ffn_up (gate then up) tensors,
    the rotated dims, the original context, the window (0: none) and LongRoPE's factors as tensors with their
    attention factor (less the tensor `drop`, plus the tensors `extra`); returns the HF tensors it encodes."""
    rng = np.random.default_rng(1)
    hd = hidden // heads
    hf = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
          "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        hf |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
               p + "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * hd, hidden),
               p + "self_attn.o_proj.weight": (hidden, heads * hd), p + "mlp.gate_up_proj.weight": (2 * inter, hidden),
               p + "mlp.down_proj.weight": (hidden, inter)}
    hf = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in hf.items()}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_rope_scaling_orig_ctx_len(16)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(rotated)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(window)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    for name, arr in hf.items():
        if name in top:
            w.add_tensor(top[name], arr)
        else:
            _, _, layer, rest = name.split(".", 3)
            w.add_tensor(f"blk.{layer}.{names[rest.rsplit('.', 1)[0]]}.weight", arr)
    if factors:
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(256 / 16) / np.log(16))))
        for kind in ("long", "short"):
            if f"rope_factors_{kind}.weight" != drop:
                w.add_tensor(f"rope_factors_{kind}.weight", np.array(factors[f"{kind}_factor"], dtype=np.float32))
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    finish_gguf(w)
    return hf


@pytest.mark.parametrize("longrope, window", [(False, 0), (True, 5)])
def test_a_phi3_gguf_generates_as_transformers(tmp_path, longrope, window):
    """llama.cpp's Phi-3 files: fused tensors kept fused, half of each head rotated (rope.dimension_count),
    a window where the file gives one, and LongRoPE's factors read from their tensors (the long ones: the
    engine's context, 256, passes the original 16, and so do the prompts for transformers)."""
    from vllm_spec.model.gguf_loader import read_gguf_config

    factors = {k: [round(float(v), 4) for v in vs] for k, vs in longrope_scaling(2, seed=3).items() if k != "rope_type"}
    path = tmp_path / "phi3.gguf"
    hf = _write_phi3_gguf(path, factors=factors if longrope else None, window=window)
    cfg = read_gguf_config(path)
    assert (cfg["partial_rotary_factor"], cfg["original_max_position_embeddings"]) == (0.5, 16)
    assert cfg.get("sliding_window") == (window or None)
    if longrope:
        assert {k: cfg["rope_scaling"][k] for k in factors} == factors
    model = tf.Phi3ForCausalLM(tf.Phi3Config(**{k: v for k, v in cfg.items() if k != "architectures"},
                                             pad_token_id=0)).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()})
    prompt = [(7 * i + 3) % 64 for i in range(20)]
    llm = LLM(str(path), skip_tokenizer_init=True, **KV)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf_greedy(model, prompt, 12)


def test_the_long_factors_are_announced(caplog):
    arch = ArchConfig.from_hf_dict({**BASE, "max_position_embeddings": 256, "original_max_position_embeddings": 32,
                                    "rope_scaling": longrope_scaling(8, seed=1)})
    with caplog.at_level("WARNING", logger="vllm_spec.model.rotary"):
        RotaryEmbedding(16, 256, arch.rope_theta, arch.rope_scaling, 32)
        assert not caplog.records
        RotaryEmbedding(16, 256, arch.rope_theta, arch.rope_scaling, 33)
    assert "max_model_len 33 passes the original context 32" in caplog.text
    assert "max_model_len <= 32 keeps the short ones" in caplog.text


def test_rope_scaling_in_the_legacy_place_counts_whole():
    """A (legacy) rope_scaling object stands for rope_parameters as transformers reads it: its rope_theta and
    partial_rotary_factor count; Phi-3's original context comes from the top level (4096 where absent), another
    family's LongRoPE from rope_scaling."""
    scaling = {"type": "longrope", "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5,
               "rope_theta": 500.0, **{k: v for k, v in longrope_scaling(4, seed=2).items() if k != "rope_type"}}
    ours = ArchConfig.from_hf_dict({**BASE, "max_position_embeddings": 8192, "rope_scaling": dict(scaling)})
    theirs = tf.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=8192, pad_token_id=0,
                           rope_scaling=dict(scaling)).rope_parameters
    assert (ours.rotary_dim, ours.rope_theta, ours.rope_scaling["original_max_position_embeddings"]) == \
        (int(16 * theirs["partial_rotary_factor"]), theirs["rope_theta"], theirs["original_max_position_embeddings"])
    assert (ours.rotary_dim, ours.rope_theta, ours.rope_scaling["original_max_position_embeddings"]) == (8, 500.0, 4096)
    llama = {**BASE, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192}
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 16, "rope_theta": 500.0,
               **{k: v for k, v in longrope_scaling(8, seed=2).items() if k != "rope_type"}}
    ours = ArchConfig.from_hf_dict({**llama, "rope_scaling": dict(scaling)})
    theirs = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=8192,
                            rope_scaling=dict(scaling)).rope_parameters
    assert (ours.rope_theta, ours.rope_scaling["original_max_position_embeddings"]) == \
        (theirs["rope_theta"], theirs["original_max_position_embeddings"]) == (500.0, 16)


def test_an_odd_head_size_is_named():
    with pytest.raises(ValueError, match=r"head_dim must be even \(the rotary embedding turns pairs of dimensions\), "
                                         r"got 15"):
        ArchConfig.from_hf_dict({**BASE, "hidden_size": 60})


def test_a_projection_both_fused_and_in_parts_is_named(tmp_path):
    path = make_tiny_model(tmp_path / "p", "phi3", seed=22)
    edit_checkpoint(path, lambda w: w.update(
        {"model.layers.0.mlp.up_proj.weight": w["model.layers.0.mlp.gate_up_proj.weight"][96:].clone()}))
    with pytest.raises(ValueError, match=r"Checkpoint tensor 'model.layers.0.mlp.(gate_)?up_proj.weight': it holds "
                                         r"weights another tensor of the checkpoint held already"):
        LLM(str(path), **KV)


def test_gguf_rotated_dims_are_read_back_exactly(tmp_path):
    """30 of 88 dims: 30 / 88 as the nearest float would read back as 29; a count past head_dim is named."""
    from vllm_spec.model.gguf_loader import read_gguf_config

    path = tmp_path / "a.gguf"
    _write_phi3_gguf(path, hidden=88, heads=1, kv_heads=1, rotated=30)
    assert ArchConfig.from_hf_dict(read_gguf_config(path)).rotary_dim == 30
    _write_phi3_gguf(path, rotated=16)
    with pytest.raises(ValueError, match=r"GGUF key phi3.rope.dimension_count \(16\) must be in \[2, head_dim \(8\)\]"):
        read_gguf_config(path)


def test_gguf_errors_name_the_tensor(tmp_path):
    """A LongRoPE factor tensor without its twin; an ffn_gate beside Phi-3's fused ffn_up (which holds the gate)."""
    from vllm_spec.model.gguf_loader import iter_gguf_weights, read_gguf_config

    factors = {"short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]}
    path = tmp_path / "a.gguf"
    _write_phi3_gguf(path, factors=factors, drop="rope_factors_short.weight")
    with pytest.raises(ValueError, match=r"GGUF has 'rope_factors_long.weight' without 'rope_factors_short.weight'"):
        read_gguf_config(path)
    _write_phi3_gguf(path, extra={"blk.0.ffn_gate.weight": np.zeros((48, 32), np.float32)})
    with pytest.raises(ValueError, match=r"Unexpected tensor 'blk.0.ffn_gate.weight' in GGUF file"):
        list(iter_gguf_weights(path))

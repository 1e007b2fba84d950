"""Our models against HF transformers: greedy tokens, prefill logits, decode logprobs.

Every architecture variant runs a batch of prompts of different lengths (several KV
blocks; one prompt longer than max_num_batched_tokens so it is prefilled in chunks)
and must reproduce HF's greedy continuation token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import edit_checkpoint, make_tiny_model
from transformers import AutoModelForCausalLM

from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.sampling_params import SamplingParams
from vllm_spec.worker.batch import SeqInput
from vllm_spec.worker.worker import Worker


NEW_TOKENS = 32
MAX_BATCHED = 24  # the longest prompt below (> 24 tokens) is prefilled in several chunks
PROMPTS = [
    "def",
    "import os\nimport sys",
    "The quick brown fox jumps over the lazy dog, then the dog",
    "Wrap a single paragraph of text, returning a list of wrapped lines. "
    "Reformat the single paragraph in 'text' so it fits in lines of no more than 'width' columns.",
    "x = 1",
]
ARCHS = ["llama", "qwen2", "mistral", "llama3_tied", "gqa", "llama_biases", "qwen2_window", "qwen2_yarn",
         "llama_window_key", "mistral_layer_types", "qwen3", "qwen3_window_biases",
         "gemma3", "gemma3_pattern", "gemma3_softcap", "gemma2", "gemma2_defaults", "granite", "phi3",
         "phi3_longrope", "mixtral", "qwen3_moe", "qwen3_moe_mixed", "qwen2_moe",
         "gemma", "gemma_legacy_gelu", "smollm3", "smollm3_window", "opt", "opt_350m_layout",
         "gpt_neox", "gpt_neox_sequential", "llama_gelu", "gpt2", "gpt2_options",
         "gpt_bigcode", "gpt_bigcode_mha", "phi", "phi_qk_norm"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def tiny_llama3_tied(tmp_path_factory) -> Path:
    # Llama-3 rope scaling (high, medium and low frequency bands all present for head_dim 16) + tied embeddings.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama3"), "llama", seed=3, tie_word_embeddings=True,
                           rope_scaling=dict(LLAMA3_ROPE))


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory) -> Path:
    # 8 query heads share 1 KV head; head_dim (16) is not hidden_size / heads, so q width (128) != hidden (64).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gqa"), "llama", seed=4, tie_word_embeddings=False,
                           num_attention_heads=8, num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def tiny_llama_biases(tmp_path_factory) -> Path:
    # Llama's attention_bias biases q, k, v AND o_proj; mlp_bias the three MLP projections.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_biases"), "llama", seed=5, attention_bias=True,
                           mlp_bias=True)


@pytest.fixture(scope="module")
def tiny_qwen2_window(tmp_path_factory) -> Path:
    # Qwen2 windows only the layers from max_window_layers on: layer 0 attends to everything, layer 1
    # to its last 8 tokens.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_window"), "qwen2", seed=6, use_sliding_window=True,
                           sliding_window=8, max_window_layers=1)


@pytest.fixture(scope="module")
def tiny_qwen2_yarn(tmp_path_factory) -> Path:
    # YaRN (Qwen2.5's long-context setting): frequencies ramped between original and interpolated over
    # the head's dimensions, and cos/sin scaled by the attention factor (1 + 0.1 ln 4).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_yarn"), "qwen2", seed=7, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})


@pytest.fixture(scope="module")
def tiny_llama_window_key(tmp_path_factory) -> Path:
    # A Llama config carrying sliding_window (Mistral weights converted to Llama often do): transformers'
    # Llama never windows.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_window_key"), "llama", seed=8, sliding_window=8)


@pytest.fixture(scope="module")
def tiny_mistral_layer_types(tmp_path_factory) -> Path:
    # Mistral with layer_types (Ministral): only the layers called sliding attend within the window.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mistral_layer_types"), "mistral", seed=9, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    # Qwen3: each query and key head RMS-normed (random weights) before the rotation; head_dim
    # (32) is not hidden_size / heads (16), as in the Qwen3 releases.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=10, head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_qwen3_window_biases(tmp_path_factory) -> Path:
    # Qwen3's attention_bias biases q, k, v and o_proj (Llama's reading, not Qwen2's); its sliding window
    # follows Qwen2's rule (use_sliding_window, from max_window_layers on).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_wb"), "qwen3", seed=11, attention_bias=True,
                           use_sliding_window=True, sliding_window=8, max_window_layers=1)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    # Gemma 3: GELU MLP, scaled embeddings, norms stored as offsets from 1 (random here) before and after the
    # attention and the MLP, per-head q/k norms, the attention scaled by query_pre_attn_scalar (not head_dim),
    # layer 0 windowed (8 tokens) and rotated with the local base, layer 1 global with the global base.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", seed=12, head_dim=32,
                           query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    return _random_norms(path, seed=12)


@pytest.fixture(scope="module")
def tiny_gemma3_softcap(tmp_path_factory) -> Path:
    # final_logit_softcapping (cap * tanh(logits / cap)), small enough to change every logprob.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gemma3_softcap"), "gemma3", seed=14, head_dim=32,
                           final_logit_softcapping=1.5)
    return _random_norms(path, seed=14)


@pytest.fixture(scope="module")
def tiny_gemma3_pattern(tmp_path_factory) -> Path:
    # A Gemma 3 config in the older layout (rope_theta, rope_local_base_freq, sliding_window_pattern; no
    # layer_types): every second layer global, linear rope scaling on the global layers only.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gemma3_pattern"), "gemma3", seed=13, num_hidden_layers=4, max_position_embeddings=256,
                           sliding_window=8, tie_word_embeddings=False)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        cfg.pop(key, None)
    cfg |= {"sliding_window_pattern": 2, "rope_theta": 500000.0, "rope_local_base_freq": 20000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    (path / "config.json").write_text(json.dumps(cfg))
    return _random_norms(path, seed=13)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> Path:
    # Gemma 2: Gemma 3's layers without the per-head q/k norms or the local rotary base, and both soft caps:
    # the attention scores' and the final logits', small enough here to change every score and logprob.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gemma2"), "gemma2", seed=15, head_dim=32,
                           query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           attn_logit_softcapping=1.0, final_logit_softcapping=2.0, attention_bias=True)
    return _random_norms(path, seed=15)


@pytest.fixture(scope="module")
def tiny_gemma2_defaults(tmp_path_factory) -> Path:
    # A Gemma 2 config.json without the keys transformers defaults: the soft caps (50, 30), layer_types (every
    # other layer windowed, from layer 0), head_dim (256, not hidden_size / heads), num_key_value_heads (4) and
    # hidden_activation (GELU: a hidden_act beside it is not read).
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gemma2_defaults"), "gemma2", seed=16, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=4, sliding_window=8, tie_word_embeddings=False)
    cfg = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping", "head_dim", "num_key_value_heads",
                "hidden_activation"):
        cfg.pop(key, None)
    cfg["hidden_act"] = "silu"
    (path / "config.json").write_text(json.dumps(cfg))
    return _random_norms(path, seed=16)


@pytest.fixture(scope="module")
def tiny_granite(tmp_path_factory) -> Path:
    # Granite: Llama with its four scalars (embeddings, each block's output before the residual add, the attention
    # scale, the logits), all far from 1 here, and Llama's biases.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_granite"), "granite", seed=17, embedding_multiplier=3.0,
                           residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5, attention_bias=True,
                           mlp_bias=True, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory) -> Path:
    # Phi-3: q/k/v and gate/up stored fused; half of each head rotated (partial_rotary_factor), the other half
    # passed as it is; every layer windowed (8 tokens).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), "phi3", seed=18, partial_rotary_factor=0.5,
                           sliding_window=8)


@pytest.fixture(scope="module")
def tiny_phi3_longrope(tmp_path_factory) -> Path:
    # LongRoPE (Phi-3.5's 128k setting) within the original context: its short factors divide the frequencies and
    # cos/sin scale by sqrt(1 + ln 4 / ln 128) (the engine's context, 128, stays within the original one: see
    # _ENGINE_OPTIONS).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_phi3_longrope"), "phi3", seed=19, max_position_embeddings=512,
                           original_max_position_embeddings=128, rope_scaling=longrope_scaling(8, seed=19))


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> Path:
    # Mixtral: each token's MLP is 2 of 4 experts mixed by the router's renormalized top-2 softmax.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", seed=20)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    # Qwen3-MoE as transformers defaults it: the top-2 weights not renormalized, every layer sparse.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=21)


@pytest.fixture(scope="module")
def tiny_qwen3_moe_mixed(tmp_path_factory) -> Path:
    # Renormalized (norm_topk_prob); every other layer sparse (decoder_sparse_step), the rest dense; every layer
    # windowed (8 tokens).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe_mixed"), "qwen3_moe", seed=22, norm_topk_prob=True,
                           decoder_sparse_step=2, head_dim=32, use_sliding_window=True, sliding_window=8)


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory) -> Path:
    # Qwen2-MoE: q/k/v biases, the shared expert (sigmoid-gated) beside the routed ones; layer 0 windowed (8
    # tokens: transformers' rule, the even layers below max_window_layers).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_moe"), "qwen2_moe", seed=23, use_sliding_window=True,
                           sliding_window=8, max_window_layers=1)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    # Gemma 1: embeddings times sqrt(hidden), norms as offsets from 1 (random here), GELU (tanh), tied, no window.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gemma"), "gemma", seed=24, head_dim=16, num_key_value_heads=1)
    return _random_norms(path, seed=24)


@pytest.fixture(scope="module")
def tiny_gemma_legacy_gelu(tmp_path_factory) -> Path:
    # The Gemma releases' hidden_act "gelu", meant (and read by transformers) as the tanh approximation; a
    # hidden_activation beside it changes nothing; biases on the attention.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gemma_gelu"), "gemma", seed=25, attention_bias=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu", "hidden_activation": "silu"}))
    return path


@pytest.fixture(scope="module")
def tiny_smollm3(tmp_path_factory) -> Path:
    # SmolLM3: every 2nd layer without a rotary embedding (NoPE; the interval rule), biases, tied.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_smollm3"), "smollm3", seed=26, num_hidden_layers=4,
                           no_rope_layer_interval=2, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def tiny_smollm3_window(tmp_path_factory) -> Path:
    # The NoPE layer given by no_rope_layers (layer 0) is the windowed one (8 tokens).
    return make_tiny_model(tmp_path_factory.mktemp("tiny_smollm3_window"), "smollm3", seed=27, no_rope_layers=[0, 1],
                           use_sliding_window=True, sliding_window=8, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_opt(tmp_path_factory) -> Path:
    # OPT: learned positions (table row = position + 2), LayerNorms with biases (random here), ReLU MLP, biases on
    # every projection, tied embeddings, 3 layers.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_opt"), "opt", seed=28, num_hidden_layers=3)
    return _random_layer_norms(path, seed=28)


@pytest.fixture(scope="module")
def tiny_opt_350m_layout(tmp_path_factory) -> Path:
    # OPT-350m's layout: norms after each block (no final norm), embeddings 32 wide projected in and out of the
    # hidden size, an untied head, no biases, exact GELU.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_opt_350m"), "opt", seed=29, do_layer_norm_before=False,
                           word_embed_proj_dim=32, tie_word_embeddings=False, enable_bias=False,
                           activation_function="gelu")
    return _random_layer_norms(path, seed=29)


@pytest.fixture(scope="module")
def tiny_gpt_neox(tmp_path_factory) -> Path:
    # GPT-NeoX as Pythia: q/k/v fused per head in the checkpoint, a quarter of each head rotated, the attention and
    # the MLP in parallel on the layer's input, LayerNorms with biases (random here), exact GELU, an untied head.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gpt_neox"), "gpt_neox", seed=30, num_hidden_layers=3)
    return _random_layer_norms(path, seed=30)


@pytest.fixture(scope="module")
def tiny_gpt_neox_sequential(tmp_path_factory) -> Path:
    # The sequential residual, whole heads rotated (rope_parameters' spelling, base 500), tanh GELU, no attention
    # biases, tied embeddings.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gpt_neox_seq"), "gpt_neox", seed=31,
                           use_parallel_residual=False, hidden_act="gelu_new", attention_bias=False,
                           tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0})
    return _random_layer_norms(path, seed=31)


@pytest.fixture(scope="module")
def tiny_llama_gelu(tmp_path_factory) -> Path:
    # Llama's MLP with hidden_act "gelu" (exact): transformers' ACT2FN in the gated MLP.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_gelu"), "llama", seed=32, hidden_act="gelu")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    # GPT-2: Conv1D weights (transposed), c_attn's q | k | v columns, positions from row 0, tanh GELU, tied.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gpt2"), "gpt2", seed=40)
    return _random_layer_norms(path, seed=40)


@pytest.fixture(scope="module")
def tiny_gpt2_options(tmp_path_factory) -> Path:
    # scale_attn_by_inverse_layer_idx (scores / (layer + 1) more), n_inner 96, ReLU, an untied head, 3 layers.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gpt2_options"), "gpt2", seed=41, n_layer=3, n_inner=96,
                           scale_attn_by_inverse_layer_idx=True, activation_function="relu", tie_word_embeddings=False)
    return _random_layer_norms(path, seed=41)


@pytest.fixture(scope="module")
def tiny_gpt_bigcode(tmp_path_factory) -> Path:
    # GPT-BigCode (StarCoder's): GPT-2's names with linear weights, multi-query (one KV head), tanh GELU, tied.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gpt_bigcode"), "gpt_bigcode", seed=50)
    return _random_layer_norms(path, seed=50)


@pytest.fixture(scope="module")
def tiny_gpt_bigcode_mha(tmp_path_factory) -> Path:
    # multi_query false: every head a KV head, c_attn's rows each head's q, k, v together; exact GELU, untied.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_gpt_bigcode_mha"), "gpt_bigcode", seed=51, multi_query=False,
                           activation_function="gelu", tie_word_embeddings=False)
    return _random_layer_norms(path, seed=51)


@pytest.fixture(scope="module")
def tiny_phi(tmp_path_factory) -> Path:
    # Phi (phi-2's layout): one LayerNorm feeding the attention and the MLP in parallel, half of each head rotated,
    # GQA, biases everywhere (the LM head's too), tanh GELU.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_phi"), "phi", seed=60)
    return _random_layer_norms(path, seed=60)


@pytest.fixture(scope="module")
def tiny_phi_qk_norm(tmp_path_factory) -> Path:
    # qk_layernorm (a LayerNorm over each head's q and k), whole heads rotated, exact GELU, tied embeddings.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_phi_qk"), "phi", seed=61, qk_layernorm=True,
                           partial_rotary_factor=1.0, num_key_value_heads=4, hidden_act="gelu",
                           tie_word_embeddings=True)
    return _random_layer_norms(path, seed=61)


def _random_layer_norms(path: Path, seed: int) -> Path:
    """The checkpoint's LayerNorm weights drawn around 1 and their biases around 0 (make_tiny_model sets 1 and 0)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(name: str, w: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(w.shape, generator=gen)
        return 0.03 * noise if name.endswith(".bias") else 1.0 + 0.3 * noise

    edit_checkpoint(path, lambda weights: weights.update(
        {name: draw(name, w) for name, w in sorted(weights.items()) if "norm" in name}))
    return path


def longrope_scaling(n: int, seed: int) -> dict:
    """LongRoPE settings for n frequencies: short factors near 1, long ones up to ~8, drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    return {"rope_type": "longrope", "short_factor": (1 + 0.5 * torch.rand(n, generator=gen)).tolist(),
            "long_factor": (1 + 7 * torch.rand(n, generator=gen)).tolist()}


def _random_norms(path: Path, seed: int) -> Path:
    """The checkpoint's norm weights drawn at random (make_tiny_model sets them to 1)."""
    gen = torch.Generator().manual_seed(seed)
    edit_checkpoint(path, lambda weights: weights.update(
        {name: 0.5 * torch.randn(w.shape, generator=gen) for name, w in sorted(weights.items()) if "norm" in name}))
    return path


_FIXTURES = {"llama": "tiny_llama", "qwen2": "tiny_qwen2", "mistral": "tiny_mistral",
             "llama3_tied": "tiny_llama3_tied", "gqa": "tiny_gqa", "llama_biases": "tiny_llama_biases",
             "qwen2_window": "tiny_qwen2_window", "qwen2_yarn": "tiny_qwen2_yarn",
             "llama_window_key": "tiny_llama_window_key", "mistral_layer_types": "tiny_mistral_layer_types",
             "qwen3": "tiny_qwen3", "qwen3_window_biases": "tiny_qwen3_window_biases",
             "gemma3": "tiny_gemma3", "gemma3_pattern": "tiny_gemma3_pattern", "gemma3_softcap": "tiny_gemma3_softcap",
             "gemma2": "tiny_gemma2", "gemma2_defaults": "tiny_gemma2_defaults", "granite": "tiny_granite",
             "phi3": "tiny_phi3", "phi3_longrope": "tiny_phi3_longrope", "mixtral": "tiny_mixtral",
             "qwen3_moe": "tiny_qwen3_moe", "qwen3_moe_mixed": "tiny_qwen3_moe_mixed",
             "qwen2_moe": "tiny_qwen2_moe", "gemma": "tiny_gemma", "gemma_legacy_gelu": "tiny_gemma_legacy_gelu",
             "smollm3": "tiny_smollm3", "smollm3_window": "tiny_smollm3_window", "opt": "tiny_opt",
             "opt_350m_layout": "tiny_opt_350m_layout", "gpt_neox": "tiny_gpt_neox",
             "gpt_neox_sequential": "tiny_gpt_neox_sequential", "llama_gelu": "tiny_llama_gelu", "gpt2": "tiny_gpt2",
             "gpt2_options": "tiny_gpt2_options", "gpt_bigcode": "tiny_gpt_bigcode",
             "gpt_bigcode_mha": "tiny_gpt_bigcode_mha", "phi": "tiny_phi", "phi_qk_norm": "tiny_phi_qk_norm"}
# Engine options of a variant (all of its runs: the LLM's and the Worker's).
_ENGINE_OPTIONS = {"phi3_longrope": dict(max_model_len=128)}


class Case:
    """One architecture: our LLM's greedy run (with logprobs) and the HF model."""

    def __init__(self, path: Path, options: dict | None = None):
        self.path, self.options = path, options or {}
        # Eager attention: the reference for sliding windows in every transformers version.
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        self.llm = LLM(str(path), kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=MAX_BATCHED, **self.options)
        tok = self.llm.get_tokenizer()
        self.prompt_ids = [tok(p).input_ids for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)
        self.outputs = self.llm.generate(PROMPTS, params, use_tqdm=False)

    @torch.no_grad()
    def hf_greedy(self, ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        # Without a cache: transformers 5 builds a sliding-window cache from any config with sliding_window,
        # a Llama's too, whose forward never windows (the logits tests compare with that forward).
        out = self.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                               use_cache=False,
                               eos_token_id=None, min_new_tokens=NEW_TOKENS, pad_token_id=0)
        return out[0, len(ids):].tolist()

    @torch.no_grad()
    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=ARCHS)
def case(request) -> Case:
    return Case(request.getfixturevalue(_FIXTURES[request.param]), _ENGINE_OPTIONS.get(request.param))


def test_prompts_cover_blocks_and_chunking(case):
    lens = [len(ids) for ids in case.prompt_ids]
    assert len(lens) >= 4 and len(set(lens)) >= 4
    assert sum(n > 16 for n in lens) >= 2           # span several 16-token KV blocks
    assert max(lens) > MAX_BATCHED                   # chunked prefill
    assert [o.prompt_token_ids for o in case.outputs] == case.prompt_ids


def test_greedy_tokens_match_hf(case):
    for ids, out in zip(case.prompt_ids, case.outputs):
        ours = out.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        assert ours == case.hf_greedy(ids), f"prompt of {len(ids)} tokens diverges from HF"


def test_decode_logprobs_match_hf(case):
    """The logprobs of every generated step (raw model distribution) equal HF's log_softmax."""
    for ids, out in zip(case.prompt_ids, case.outputs):
        gen = out.outputs[0].token_ids
        ref = case.hf_logits(ids + gen[:-1])[len(ids) - 1:].log_softmax(-1)  # [NEW_TOKENS, V]
        for step, (tok, entry) in enumerate(zip(gen, out.outputs[0].logprobs)):
            assert len(entry) == 20 and tok in entry
            assert entry[tok].rank == 1  # greedy picks the top token
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[step, tid].item(), abs=1e-4)
            top = ref[step].topk(20).indices.tolist()
            assert set(entry) == set(top)


def _worker(case: Case, block_size: int, num_blocks: int) -> Worker:
    cfg = EngineArgs(model=str(case.path), block_size=block_size, **case.options).create_engine_config()
    worker = Worker(cfg)
    worker.init_kv_cache(num_blocks)
    return worker


def _forward_all(worker: Worker, seqs: list[SeqInput]) -> torch.Tensor:
    """float32 logits of every token of the batch."""
    return worker.runner.run(worker.runner.prepare(seqs)).float()


def test_prefill_logits_match_hf(case):
    """One batched prefill of all prompts through Worker/ModelRunner: every position's logits match HF."""
    bs = 16
    worker = _worker(case, bs, 64)
    next_block, seqs = 1, []
    for i, ids in enumerate(case.prompt_ids):
        nb = -(-len(ids) // bs)
        # Reverse order: physical blocks need not be contiguous nor ascending.
        table = list(range(next_block, next_block + nb))[::-1]
        next_block += nb
        seqs.append(SeqInput(seq_id=i, token_ids=ids, start_pos=0, block_table=table, sample=False))
    logits = _forward_all(worker, seqs)
    start = 0
    for ids in case.prompt_ids:
        ref = case.hf_logits(ids)
        torch.testing.assert_close(logits[start:start + len(ids)], ref, atol=1e-4, rtol=1e-4)
        start += len(ids)
    assert start == logits.shape[0]


def test_chunked_prefill_logits_match_hf(case):
    """The longest prompt fed 7 tokens per forward against the paged cache gives HF's logits."""
    bs = 8
    ids = max(case.prompt_ids, key=len)
    worker = _worker(case, bs, 32)
    table = [5, 2, 9, 1, 7, 3, 11, 4, 6, 10][: -(-len(ids) // bs)]
    chunks = []
    for start in range(0, len(ids), 7):
        seq = SeqInput(seq_id=0, token_ids=ids[start:start + 7], start_pos=start, block_table=table, sample=False)
        chunks.append(_forward_all(worker, [seq]))
    torch.testing.assert_close(torch.cat(chunks), case.hf_logits(ids), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def llama_reference(tiny_llama) -> list[list[int]]:
    """Greedy tokens at the default block size (16) straight from HF generate."""
    case = Case(tiny_llama)
    return [case.hf_greedy(ids) for ids in case.prompt_ids]


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_size_does_not_change_output(tiny_llama, llama_reference, block_size):
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, block_size=block_size, max_model_len=128,
              max_num_batched_tokens=MAX_BATCHED)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert llm.llm_engine.block_manager.block_size == block_size
    assert ours == llama_reference


def test_dynamic_ntk_rope_matches_transformers_at_the_longest_context(tmp_path):
    """rope_scaling type "dynamic": as vLLM, the NTK-scaled base of the longest context (max_position_embeddings x
    factor) at every position, which is the base transformers' dynamic version uses for a sequence that long:
    the prompt logprobs of such a prompt match; max_model_len is max_position_embeddings x factor, as vLLM's."""
    path = make_tiny_model(tmp_path / "dyn", "llama", seed=8, max_position_embeddings=64,
                           rope_scaling={"type": "dynamic", "factor": 2.0})
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.config.model.max_model_len == 128
    ids = [3 + (7 * i) % 300 for i in range(128)]
    out = llm.generate([{"prompt_token_ids": ids[:127]}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :126].log_softmax(-1)   # one pass of 128: the longest context
    ref = logits.gather(1, torch.tensor(ids[1:127]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(ours, ref, atol=2e-4), (ours - ref).abs().max()


def test_gemma3_config_as_shipped(tmp_path):
    """As Gemma-3 checkpoints ship: linear rope scaling on the global layers and a max_position_embeddings that
    already counts it (the context limit, as vLLM's), and no tie_word_embeddings key (transformers' default for
    Gemma 3: tied)."""
    import json

    path = make_tiny_model(tmp_path / "g3", "gemma3", seed=14, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=8, max_position_embeddings=64,
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1000000.0}})
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("tie_word_embeddings", True)
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.config.model.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len \(128\) must be <= the model's max_position_embeddings"):
        LLM(str(path), kv_cache_memory_bytes=1 << 24, max_model_len=128)
    ids = [3 + (7 * i) % 300 for i in range(20)]
    ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          use_cache=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref


@pytest.mark.parametrize("scaling", [{"type": "dynamic", "alpha": 2.0}, {"rope_type": "linear"},
                                     {"type": "dynamic", "factor": "2"}, {"type": "llama3", "factor": -1}])
def test_rope_scaling_without_a_usable_factor_is_a_clear_error(tmp_path, scaling):
    import json

    path = make_tiny_model(tmp_path / "bad_rope", "llama", seed=8, max_position_embeddings=64)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": scaling}))
    with pytest.raises(ValueError, match="rope_scaling of type .* needs a positive number 'factor'"):
        LLM(str(path), kv_cache_memory_bytes=1 << 24)

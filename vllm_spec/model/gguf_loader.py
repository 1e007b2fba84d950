"""Read llama.cpp GGUF checkpoints (``llama``, ``granite``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``gemma3``,
``phi3``) as HF-style configs and weights.

GGUF stores hyper-parameters under ``{arch}.*`` keys and tensors under llama.cpp names
(``blk.N.attn_q.weight``). This module maps both back to the Hugging Face layout so the
rest of the engine never has to know the checkpoint came from a GGUF file.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

# GGUF architecture -> HF architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "granite": "GraniteForCausalLM",
                                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                      "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM"}
_GEMMA = ("gemma2", "gemma3")
# Gemma 1 too: llama.cpp stores every norm weight of the family as 1 + the checkpoint's.
_GEMMA_FAMILY = ("gemma", *_GEMMA)
# GGUF files carry no query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B models (known by their
# layer count) and head_dim for the others, as their HF configs say.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Architectures whose q/k rows llama.cpp's converter permutes (its Llama rotation layout).
_PERMUTED = ("llama", "granite")
# Granite's scalars: GGUF key -> config.json key.
_GRANITE_KEYS = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                 "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's norms (ffn_norm is the one before the MLP; after the attention and the MLP come two more);
# llama.cpp stores every norm weight of the family as 1 + the checkpoint's.
_GEMMA_PER_LAYER = {**_PER_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's projections stay fused as its checkpoints hold them (ffn_up is gate and up: llama.cpp's Phi-3 has no
# ffn_gate; q, k and v may come apart).
_PHI3_PER_LAYER = {**{k: v for k, v in _PER_LAYER.items() if k != "ffn_gate"}, "attn_qkv": "self_attn.qkv_proj",
                   "ffn_up": "mlp.gate_up_proj"}
# Tensors that carry configuration, not parameters: rope_freqs and Phi-3's LongRoPE factors become
# config["rope_scaling"].
_LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
_NOT_PARAMETERS = {"rope_freqs.weight", *_LONGROPE_FACTORS.values()}


def _open(path: str | Path) -> tuple[GGUFReader, str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = path.stat()
    try:
        reader = _reader(str(path.resolve()), st.st_mtime_ns, st.st_size)
    except (ValueError, OSError, IndexError) as e:   # gguf's own errors name neither the file nor the cause
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
    arch = _value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {path}; "
            f"supported GGUF architectures: {sorted(GGUF_ARCHITECTURES)}."
        )
    return reader, arch


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    # Parsing the metadata (~100k tokenizer strings) takes seconds; the engine reads the
    # config and then the weights of the same file, so keep the last readers. They are
    # memory maps: no tensor data is held. mtime/size in the key catch a replaced file.
    return GGUFReader(path)


def _value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores floats as float32 (1e-5 reads back as 9.999999747e-06); the shortest
    # float32 repr gives back the value the original HF config.json held.
    return float(str(np.float32(x)))


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """Return an HF-style config dict (for ``ArchConfig.from_hf_dict``) read from a GGUF file.

    Raises ``FileNotFoundError`` if the file is missing and ``ValueError`` for a GGUF
    architecture other than those of GGUF_ARCHITECTURES.
    """
    reader, arch = _open(path)
    return _config(reader, arch)


def _config(reader: GGUFReader, arch: str) -> dict[str, Any]:
    def kv(key: str, default: Any = None) -> Any:
        return _value(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    if kv("expert_count"):
        raise ValueError(f"Mixture-of-experts GGUF files ({arch}.expert_count {kv('expert_count')}) are not supported; "
                         "give the model's HF checkpoint (Mixtral's is).")
    heads = kv("attention.head_count")
    hidden = kv("embedding_length")
    # This equals len(tokenizer.ggml.tokens) (llama.cpp pads the token list to the embedding,
    # e.g. Qwen2.5's 151,936 rows); the embedding is what the weights must fit. GGUF shapes are [in, out].
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": "gemma3_text" if arch == "gemma3" else arch,   # (transformers' text-only Gemma 3)
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": kv("feed_forward_length"),
        "num_hidden_layers": kv("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv("attention.head_count_kv", heads),
        "rms_norm_eps": _f32(kv("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(kv("rope.freq_base", 10000.0)),
        "max_position_embeddings": kv("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        # The file says which biases it has: o_proj's need not follow q/k/v's.
        "vllm_spec_o_proj_bias": "blk.0.attn_output.bias" in tensors,
    }
    cfg |= {"hidden_activation": "gelu_pytorch_tanh"} if arch in _GEMMA else \
        {"hidden_act": "gelu_pytorch_tanh" if arch == "gemma" else "silu"}
    # key_length is head_dim when it is not hidden/heads; llama's rotary dims always equal head_dim. (Left out,
    # transformers' Qwen3 and Gemma would take 128 / 256.)
    head_dim = kv("attention.key_length") or (kv("rope.dimension_count") if arch in _PERMUTED else None)
    if head_dim or (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        cfg["head_dim"] = head_dim or hidden // heads
    if arch in _GEMMA:   # (Gemma 3's local rotary base and window pattern: transformers' defaults)
        cfg["sliding_window"] = kv("attention.sliding_window", 4096)
        cfg["query_pre_attn_scalar"] = hidden // heads if cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch] \
            else cfg.get("head_dim")
    if arch == "granite":   # (absent or 0, llama.cpp scales the attention by head_dim ** -0.5, the rest by 1)
        cfg |= {hf: _f32(value) for key, hf in _GRANITE_KEYS.items() if (value := kv(key))}
        if "attention_multiplier" not in cfg and cfg.get("head_dim"):
            cfg["attention_multiplier"] = cfg["head_dim"] ** -0.5
    if arch == "phi3":   # (rope.dimension_count: the rotated dims; a window of 0: none)
        cfg["original_max_position_embeddings"] = kv("rope.scaling.original_context_length",
                                                     cfg["max_position_embeddings"])
        rotated, head_dim = kv("rope.dimension_count"), cfg.get("head_dim")
        if rotated and head_dim and rotated != head_dim:
            if not 2 <= rotated <= head_dim:
                raise ValueError(f"GGUF key phi3.rope.dimension_count ({rotated}) must be in [2, head_dim "
                                 f"({head_dim})]: the rotated dimensions of a head.")
            cfg["partial_rotary_factor"] = _factor_of(rotated, head_dim)
        cfg["sliding_window"] = kv("attention.sliding_window") or None
    if arch == "gemma2":   # (absent: llama.cpp's and transformers' 50 and 30)
        cfg |= {key: _f32(value) for key in ("attn_logit_softcapping", "final_logit_softcapping")
                if (value := kv(key)) is not None}
    bos = _value(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = bos
    # Chat models end a turn with EOT (e.g. Llama-3's <|eot_id|>), so it stops generation too.
    eos = [_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(e for e in eos if e is not None))
    if eos:
        cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    rope_scaling = _rope_scaling(reader, arch, tensors, cfg)
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    return cfg


def _rope_scaling(reader: GGUFReader, arch: str, tensors: dict, cfg: dict) -> dict | None:
    kind = _value(reader, f"{arch}.rope.scaling.type")
    factor = _value(reader, f"{arch}.rope.scaling.factor") or _value(reader, f"{arch}.rope.scale_linear")
    if kind == "linear" or (kind is None and factor):
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        orig = _value(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": _f32(factor), "original_max_position_embeddings": orig}
    if kind not in (None, "none"):
        raise ValueError(f"Unsupported GGUF rope scaling type {kind!r}")
    present = [name for name in _LONGROPE_FACTORS.values() if name in tensors]
    if len(present) == 1:
        raise ValueError(f"GGUF has {present[0]!r} without "
                         f"{next(n for n in _LONGROPE_FACTORS.values() if n not in present)!r}: LongRoPE needs both.")
    if present:
        out = {"rope_type": "longrope"} | {key: [_f32(f) for f in _dequantized(tensors[name])]
                                           for key, name in _LONGROPE_FACTORS.items()}
        attention = _value(reader, f"{arch}.rope.scaling.attn_factor")
        return out if attention is None else out | {"attention_factor": _f32(attention)}
    if "rope_freqs.weight" in tensors:
        dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return _llama3_from_rope_freqs(_dequantized(tensors["rope_freqs.weight"]).astype(np.float64),
                                       cfg["rope_theta"], dim)
    return None


def _factor_of(part: int, whole: int) -> float:
    """part / whole as a float f that gives int(whole * f) == part back (as transformers reads it): the nearest
    float to the quotient can land a hair below (30 / 88 gives 29)."""
    f = part / whole
    return f if int(whole * f) == part else math.nextafter(f, 1.0)


def _dequantized(tensor) -> np.ndarray:
    """A small configuration tensor's values, flat."""
    return np.array(dequantize(tensor.data, tensor.tensor_type)).reshape(-1)


def _llama3_from_rope_freqs(f: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """Recover HF's llama3 rope parameters from llama.cpp's per-frequency divisors.

    llama.cpp writes no llama3 keys, only ``rope_freqs`` = 1 (short wavelengths), ``factor``
    (long ones) and 1/((1-s)/factor + s) in between, with s = L/wavelen/(hi-lo) - lo/(hi-lo).
    Only a = L/(hi-lo) and b = lo/(hi-lo) are determined, and any (L, lo, hi) with those
    ratios yields the same frequencies, so we fix low_freq_factor = 1 (Meta's value).
    """
    factor = float(f.max())
    inv_wavelen = theta ** (-np.arange(0, dim, 2) / dim) / (2 * math.pi)
    mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if mid.sum() < 2:
        raise ValueError("Cannot recover llama3 rope scaling from rope_freqs: too few transition frequencies")
    smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    a, minus_b = np.polyfit(inv_wavelen[mid], smooth, 1)
    b = -minus_b
    out = {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(1 + 1 / b, 4),
        "original_max_position_embeddings": int(round(a / b)),
    }
    s = np.clip(a * inv_wavelen - b, 0.0, 1.0)
    if not np.allclose(1 / ((1 - s) / factor + s), f, rtol=1e-3):
        raise ValueError("rope_freqs in GGUF do not follow the llama3 rope scaling formula")
    return out


def _hf_name(gguf_name: str, arch: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{kind}"
    per_layer = _GEMMA_PER_LAYER if arch in _GEMMA else _PHI3_PER_LAYER if arch == "phi3" else _PER_LAYER
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in per_layer:
        return f"model.layers.{m.group(1)}.{per_layer[m.group(2)]}.{kind}"
    raise ValueError(f"Unexpected tensor {gguf_name!r} in GGUF file")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py reorders each head's rows from HF's rotate-half layout
    # (first half | second half) to llama.cpp's interleaved pairs via
    # reshape(n_head, 2, d/2, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every parameter of a GGUF checkpoint.

    Tensors are dequantized one at a time (the file is memory-mapped), returned in HF
    layout (``[out, in]``), with llama.cpp's rotary permutation of Q/K undone for ``llama``.
    ``lm_head.weight`` is only yielded when the file has an untied ``output.weight``.
    The file is opened and checked here, so a bad path fails at the call, not at first use.
    """
    reader, arch = _open(path)
    cfg = _config(reader, arch)
    return _iter_weights(reader, arch, cfg["num_attention_heads"], cfg["num_key_value_heads"])


def _iter_weights(reader: GGUFReader, arch: str, n_head: int, n_kv_head: int) -> Iterator[tuple[str, torch.Tensor]]:
    for t in reader.tensors:
        if t.name in _NOT_PARAMETERS:
            continue
        name = _hf_name(t.name, arch)
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (ValueError, TypeError) as e:
            raise ValueError(f"GGUF tensor {t.name!r} could not be read (truncated or corrupt file?): {e}") from e
        if np.may_share_memory(w, t.data):  # F32 tensors come back as views of the read-only map
            w = w.copy()
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if arch in _PERMUTED and (".attn_q." in t.name or ".attn_k." in t.name):
            w = _unpermute(w, n_head if ".attn_q." in t.name else n_kv_head)
        if arch in _GEMMA_FAMILY and name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        yield name, torch.from_numpy(np.ascontiguousarray(w))


def load_gguf_tokenizer(path: str | Path):
    """Build a transformers fast tokenizer (with the chat template) from a local GGUF file."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"no tokenizer could be built from {path} ({e}); pass tokenizer=PATH, or "
                         "skip_tokenizer_init=True and give prompts as token ids.") from e

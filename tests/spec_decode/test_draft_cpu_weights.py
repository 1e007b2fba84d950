"""A draft whose config asks for Q8_0 weights on the CPU ("vllm_spec_cpu_weights"): its layers and LM head
multiply by the nearest Q8_0 values with llama.cpp's Q8_0 arithmetic (int8 tiles where the rows fill them,
block_quant.int8_tiles), the target stays as loaded, and speculation stays lossless (the draft's numerics
only set its acceptance), seeded sampling included."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import copy_with_config

from vllm_spec import LLM, SamplingParams
from vllm_spec.entrypoints.cli import default_draft_path
from vllm_spec.model import block_quant, cpu_linear
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.block_quant import BlockWeight
from vllm_spec.model.layers import LinearBase

KV = dict(kv_cache_memory_bytes=1 << 25)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [3 + i, 40 + 2 * i, 7, 99 - i][: 1 + i % 4]} for i in range(8)]


@pytest.mark.skipif(not cpu_linear.available(), reason="the CPU kernel is not built here")
def test_the_draft_layers_multiply_by_q8_0_blocks_and_speculation_stays_lossless(spec_pair, tmp_path):
    draft = copy_with_config(spec_pair[1], tmp_path / "draft", vllm_spec_cpu_weights="q8_0")
    ref_llm = LLM(spec_pair[0], dtype="float32", device="cpu", **KV)
    ref = ref_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(spec_pair[0], dtype="float32", device="cpu", speculative_model=draft, num_speculative_tokens=3,
              speculative_policy="fixed", **KV)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0

    worker = llm.llm_engine.executor.worker
    draft_model, target = worker.draft_runner.model, worker.target.runner.model
    plain = LLM(spec_pair[1], dtype="float32", device="cpu", **KV).llm_engine.executor.worker.runner.model
    def expected(module: LinearBase) -> BlockWeight:
        dense = module.weight if module.packed is None else module.packed
        blocks = block_quant.quantize_q8_0(dense.dequantize() if isinstance(dense, BlockWeight) else dense.float())
        return block_quant.int8_tiles(blocks) or blocks

    pairs = [(layer.get_submodule(name), original.get_submodule(name))
             for layer, original in zip(draft_model.layers, plain.layers)
             for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    for module, original in [*pairs, (draft_model.lm_head, plain.lm_head)]:
        want = expected(original)
        assert isinstance(module.packed, BlockWeight) and module.packed.format == want.format
        assert torch.equal(module.packed.blocks, want.blocks)
    assert {m.packed.format for m, _ in pairs} == {"q8_0_i8"}
    ref_target = ref_llm.llm_engine.executor.worker.runner.model
    assert [type(m.packed) for m in target.modules() if isinstance(m, LinearBase)] == \
        [type(m.packed) for m in ref_target.modules() if isinstance(m, LinearBase)]   # the target as loaded


@pytest.mark.skipif(not cpu_linear.available(), reason="the CPU kernel is not built here")
def test_seeded_sampling_with_an_int8_draft_is_the_same_alone_or_in_a_batch(spec_pair, tmp_path):
    """The int8 draft's rows are rounded per row: its proposals and probabilities for a request do not
    depend on the rows beside it, so a seeded request samples the same tokens alone or in a batch."""
    draft = copy_with_config(spec_pair[1], tmp_path / "draft", vllm_spec_cpu_weights="q8_0")
    llm = LLM(spec_pair[0], dtype="float32", device="cpu", speculative_model=draft, num_speculative_tokens=3,
              speculative_policy="fixed", **KV)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS[:6], [seeded] + [others] * 5, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batch and len(alone) == 20


@pytest.mark.parametrize("value", ["q4_1", "Q8_0", 8, True])
def test_an_unknown_cpu_weight_format_is_a_clear_error(value):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=32, intermediate_size=64,
               num_hidden_layers=1, num_attention_heads=2, vllm_spec_cpu_weights=value)
    with pytest.raises(ValueError, match=r"vllm_spec_cpu_weights must be one of \('q8_0',\) or null"):
        ArchConfig.from_hf_dict(cfg)


def test_the_default_draft_asks_for_q8_0_on_the_cpu():
    cfg = json.loads((default_draft_path() / "config.json").read_text())
    assert ArchConfig.from_hf_dict(cfg).cpu_weights == "q8_0"

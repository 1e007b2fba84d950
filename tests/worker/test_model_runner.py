"""ModelRunner: host-to-device packing (several int64 arrays sent as one buffer) and the LM head's warm-up."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.arch_config import ArchConfig
from vllm_spec.model.llama import LlamaForCausalLM
from vllm_spec.worker.model_runner import _ALIGN, ModelRunner, ragged_grid, to_device_aligned


@pytest.mark.parametrize("seed", range(4))
def test_to_device_aligned_gives_each_part_as_an_aligned_view_of_one_buffer(seed):
    rng = random.Random(seed)
    for _ in range(50):
        parts = [np.array([rng.randrange(-9, 1000) for _ in range(rng.choice([0, 1, 7, 8, 9, 33]))], dtype=np.int64)
                 for _ in range(rng.randint(1, 7))]
        views = to_device_aligned(parts, torch.device("cpu"))
        assert [v.tolist() for v in views] == [p.tolist() for p in parts]
        assert all(v.dtype == torch.int64 and v.storage_offset() % _ALIGN == 0 for v in views)
        if any(len(p) for p in parts):   # one buffer behind them all
            assert len({v.untyped_storage().data_ptr() for v in views}) == 1


def test_to_device_aligned_with_every_part_empty():
    views = to_device_aligned([np.zeros(0, dtype=np.int64)] * 3, torch.device("cpu"))
    assert [v.numel() for v in views] == [0, 0, 0]


def test_ragged_grid():
    rows, offsets = ragged_grid(np.array([2, 0, 3]))
    assert rows.tolist() == [0, 0, 2, 2, 2] and offsets.tolist() == [0, 1, 0, 1, 2]


def _tiny_runner(device: torch.device, vocab: int = 64) -> ModelRunner:
    arch = ArchConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=32,
                                        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=64))
    model = LlamaForCausalLM(arch, GroupCoordinator(), torch.float32, max_positions=64).to(device)
    return ModelRunner(model, device, block_size=16, max_model_len=64)


def _logit_row_counts(runner: ModelRunner, monkeypatch) -> list[int]:
    seen: list[int] = []
    head = runner.model.compute_logits
    def spy(hidden):
        seen.append(hidden.shape[0])
        return head(hidden)
    monkeypatch.setattr(runner.model, "compute_logits", spy)
    return seen


@pytest.mark.gpu
def test_warm_logits_runs_the_lm_head_once_for_every_row_count(monkeypatch):
    runner = _tiny_runner(torch.device("cuda"))
    seen = _logit_row_counts(runner, monkeypatch)
    runner.warm_logits(13)
    assert seen == list(range(1, 14))


def test_warm_logits_does_nothing_on_the_cpu(monkeypatch):
    runner = _tiny_runner(torch.device("cpu"))
    seen = _logit_row_counts(runner, monkeypatch)
    runner.warm_logits(13)
    assert seen == []


@pytest.mark.parametrize("speculative, max_tokens", [(False, 2048), (True, 2048), (True, 20)])
def test_workers_warm_every_row_count_a_step_may_ask_logits_for(spec_pair, monkeypatch, speculative, max_tokens):
    """Plain: the rows a prefill samples (decode's logits are in its graphs); speculative: every
    verification's rows (k+1 per sequence, within the token budget) and the draft's catch-up rows."""
    from vllm_spec import LLM
    calls: list[tuple[ModelRunner, int]] = []
    monkeypatch.setattr(ModelRunner, "warm_logits", lambda self, rows: calls.append((self, rows)))
    spec = dict(speculative_model=spec_pair[1], num_speculative_tokens=3) if speculative else {}
    llm = LLM(spec_pair[0], max_num_seqs=6, max_num_batched_tokens=max_tokens, kv_cache_memory_bytes=1 << 24, **spec)
    worker = llm.llm_engine.executor.worker
    if not speculative:
        assert calls == [(worker.runner, 6)]
    else:
        assert calls == [(worker.target.runner, min(6 * 4, max_tokens)), (worker.draft_runner, 6)]

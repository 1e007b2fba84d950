"""A draft that proposes from a subset of the vocabulary ("vllm_spec_draft_vocab"): cheaper draft
steps, still lossless (greedy ids unchanged; sampled outputs keep the target's distribution, the
draft's q being zero outside its subset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import copy_with_config
from scipy import stats

from vllm_spec import LLM, SamplingParams
from vllm_spec.model.arch_config import ArchConfig

KV = dict(kv_cache_memory_bytes=1 << 25)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [3 + i, 40 + 2 * i, 7, 99 - i][: 1 + i % 4]} for i in range(12)]


@pytest.fixture(scope="module")
def target_vocab(spec_pair) -> int:
    return json.loads((Path(spec_pair[0]) / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equality_and_proposals_inside_the_subset(spec_pair, tmp_path, target_vocab, k):
    subset = list(range(0, target_vocab, 2))                 # every other token id
    draft = copy_with_config(spec_pair[1], tmp_path / "draft", vllm_spec_draft_vocab=subset)
    ref = LLM(spec_pair[0], **KV).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(spec_pair[0], speculative_model=draft, num_speculative_tokens=k, speculative_policy="fixed", **KV)
    model = llm.llm_engine.executor.worker.draft_runner.model
    proposed = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda h: proposed.append(model.token_ids_of(compute_logits(h).argmax(-1))) or \
        compute_logits(h)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert model.output_ids.tolist() == subset
    drafted = torch.cat(proposed)
    assert drafted.numel() > 0 and bool((drafted % 2 == 0).all())
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


def test_sampled_distribution_with_a_subset_draft(spec_pair, tmp_path, target_vocab):
    """The 3rd token over 1500 runs at temperature 1: chi-square p > 1e-3 against plain sampling.
    The draft sees only a quarter of the vocabulary, so q is zero where p is not."""
    draft = copy_with_config(spec_pair[1], tmp_path / "draft", vllm_spec_draft_vocab=target_vocab // 4)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 17, 42, 99, 5]}

    def histogram(llm):
        outs = llm.generate([prompt] * 1500, params, use_tqdm=False)
        return torch.bincount(torch.tensor([o.outputs[0].token_ids[2] for o in outs]), minlength=target_vocab)

    ref = histogram(LLM(spec_pair[0], **KV))
    llm = LLM(spec_pair[0], speculative_model=draft, num_speculative_tokens=2, speculative_policy="fixed",
              seed=7, **KV)
    got = histogram(llm)
    assert {x.name: getattr(x, "value", None) for x in llm.get_metrics()}["vllm:spec_decode_num_accepted_tokens"] > 0
    keep = (ref + got) >= 10
    table = torch.stack([torch.cat([ref[keep], ref[~keep].sum().view(1)]),
                         torch.cat([got[keep], got[~keep].sum().view(1)])]).numpy()
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("value, match", [("many", "integer or a list"), ([], "at least one"),
                                          ([5, 10**6], r"in \[0, 100\)"), (-3, "at least one")])
def test_bad_draft_vocab_is_a_clear_error(value, match):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=8, intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, vllm_spec_draft_vocab=value)
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf_dict(cfg)

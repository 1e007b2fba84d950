"""The whole engine on a GPU: CUDA graphs, the Triton backend and speculation against the eager paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import BurstsPolicy, KPerSequencePolicy, copy_with_config, make_tiny_model

from vllm_spec import LLM, SamplingParams
from vllm_spec.worker import staging

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 * (i + 1)))} for i in range(8)]
KV = dict(kv_cache_memory_bytes=1 << 26, dtype="float32")


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def eager_reference(spec_pair):
    return _ids(LLM(spec_pair[0], enforce_eager=True, **KV).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("tables", ["whole rows", "compact"])
def test_cuda_graphs_match_eager(spec_pair, eager_reference, tables, monkeypatch):
    if tables == "compact":   # block tables sent as a compact block, as long contexts do
        monkeypatch.setattr(staging, "_FULL_ROWS_MAX", 0)
    llm = LLM(spec_pair[0], **KV)
    assert llm.llm_engine.executor.worker.runner.cuda_graphs
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == eager_reference
    assert llm.llm_engine.executor.worker.runner._graphs, "no CUDA graph was used"


@pytest.mark.parametrize("tables", ["whole rows", "compact"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculation_on_gpu_matches_plain(spec_pair, eager_reference, k, tables, monkeypatch):
    if tables == "compact":
        monkeypatch.setattr(staging, "_FULL_ROWS_MAX", 0)
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=k,
              speculative_policy="fixed", **KV)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == eager_reference
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("k", [0, 3])
def test_prefix_caching_in_graphs_matches_eager(spec_pair, k):
    """Prompts sharing a 40-token prefix, served after the first one: the Triton prefill over cached
    blocks, graphs and (k > 0) speculation give the eager outputs computed without the cache."""
    prompts = [{"prompt_token_ids": list(range(3, 43)) + list(range(50 + i, 53 + 2 * i))} for i in range(6)]
    reference = _ids(LLM(spec_pair[0], enforce_eager=True, **KV).generate(prompts, GREEDY, use_tqdm=False))
    spec = dict(speculative_model=spec_pair[1], num_speculative_tokens=k, speculative_policy="fixed") if k else {}
    llm = LLM(spec_pair[0], enable_prefix_caching=True, **spec, **KV)
    outs = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert _ids(outs) == reference
    assert [o.num_cached_tokens for o in outs] == [0] + [32] * 5


def test_torch_backend_matches_triton_on_gpu(spec_pair, eager_reference):
    from vllm_spec.attention import torch_backend

    llm = LLM(spec_pair[0], enforce_eager=True, **KV)
    for layer in llm.llm_engine.executor.worker.runner.model.attention_layers():
        layer.backend = torch_backend
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == eager_reference


@pytest.mark.parametrize("arch, options", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),   # layer 1 windowed only
    ("llama", dict(attention_bias=True, mlp_bias=True)),                                # o_proj biased too
    ("qwen3", dict(head_dim=32, attention_bias=True)),                                  # per-head q/k norms
    ("gemma3", dict(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("gemma2", dict(head_dim=32, sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5)),
    ("phi3", dict(head_dim=32, partial_rotary_factor=0.5)),   # the rotary kernel on the leading half of each head
    ("mixtral", {}),                                          # every expert in the graph, mixed by the router
    ("qwen3_moe", dict(mlp_only_layers=[0])),                 # a dense layer, then a sparse one
    ("qwen2_moe", {}),                                        # and the shared expert
    ("gemma", dict(head_dim=32)),                             # Gemma 1: GELU (tanh), norms offset from 1
    ("smollm3", dict(no_rope_layer_interval=2)),              # layer 1 without a rotary embedding
    ("opt", {}),                                              # learned positions, LayerNorm, ReLU
    ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32)),   # post-norms, projections in and out
    ("gpt_neox", {}),                                         # parallel residual, a quarter of each head rotated
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True)),     # a scale per layer
    ("gpt_bigcode", {}),                                      # multi-query: one KV head for 4 query heads
    ("phi", dict(qk_layernorm=True)),                         # per-head LayerNorms, a biased LM head
])
def test_model_variants_in_graphs_match_torch_backend(tmp_path, arch, options):
    from vllm_spec.attention import torch_backend

    path = str(make_tiny_model(tmp_path / arch, arch, seed=9, **options))
    reference = LLM(path, enforce_eager=True, **KV)
    for layer in reference.llm_engine.executor.worker.runner.model.attention_layers():
        layer.backend = torch_backend
    expected = _ids(reference.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(path, **KV)
    windows = {a.sliding_window for a in llm.llm_engine.executor.worker.runner.model.attention_layers()}
    assert windows == ({None, 8} if arch in ("qwen2", "gemma3", "gemma2") else {None})
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("head_dim, heads", [(24, 4), (80, 2), (8, 8)])
def test_head_sizes_that_are_no_power_of_two_run_in_graphs(tmp_path, head_dim, heads):
    """Head sizes like 80 or 96 (or a tiny 8): the Triton kernels pad them; graphs and speculation
    give the torch reference's tokens."""
    from vllm_spec.attention import torch_backend

    shape = dict(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                 head_dim=head_dim)
    path = str(make_tiny_model(tmp_path / "t", "llama", seed=3, **shape))
    draft = str(make_tiny_model(tmp_path / "d", "llama", seed=4, **shape))
    reference = LLM(path, enforce_eager=True, **KV)
    for layer in reference.llm_engine.executor.worker.runner.model.attention_layers():
        layer.backend = torch_backend
    expected = _ids(reference.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(path, **KV)
    assert llm.llm_engine.executor.worker.runner.cuda_graphs
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    spec = LLM(path, speculative_model=draft, num_speculative_tokens=3, speculative_policy="fixed", **KV)
    assert _ids(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_bf16_default_runs(spec_pair):
    llm = LLM(spec_pair[0], kv_cache_memory_bytes=1 << 26, speculative_model=spec_pair[1],
              num_speculative_tokens=3)
    assert llm.llm_engine.config.model.dtype == torch.bfloat16
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)


@pytest.mark.parametrize("k", [1, 4])
def test_whole_proposal_graph(spec_pair, eager_reference, k):
    # Draft == target: the graphed proposal must reproduce the target's own greedy choices
    # (fp32; the graph's attention split plan may round differently, hence not exactly 1.0).
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=k,
              speculative_policy="fixed", **KV)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == eager_reference
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    assert m["vllm:spec_decode_acceptance_rate"] >= 0.99
    loop = llm.llm_engine.executor.worker.draft_proposer.loop
    assert loop.use_graphs and len(loop.graphs) >= k, "the whole-proposal graphs were not captured"


def test_greedy_drafts_of_sampled_requests_run_in_the_whole_proposal_graph(spec_pair):
    """draft_sample_method "greedy": sampled requests draft argmaxes, so their proposal is the graphed
    loop too; seeded requests stay reproducible. The draft's own enforce_eager turns its graphs off alone."""
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True) for i in range(8)]
    llm = LLM(spec_pair[0], speculative_config={"model": spec_pair[1], "num_speculative_tokens": 3,
                                                 "draft_sample_method": "greedy", "policy": "fixed"}, **KV)
    config = llm.llm_engine.vllm_config
    assert config.scheduler_config.async_scheduling is True   # (resolved: CUDA, one process)
    first = _ids(llm.generate(PROMPTS, sampled, use_tqdm=False))
    assert _ids(llm.generate(PROMPTS, sampled, use_tqdm=False)) == first
    assert all(len(t) == 24 for t in first)
    assert llm.llm_engine.executor.worker.draft_proposer.loop.graphs, "the whole-proposal graph was not used"
    eager = LLM(spec_pair[0], speculative_config={"model": spec_pair[1], "num_speculative_tokens": 3,
                                                   "enforce_eager": True}, **KV)
    worker = eager.llm_engine.executor.worker
    assert worker.target.runner.cuda_graphs and not worker.draft_runner.cuda_graphs


def test_draft_vocab_subset_in_graphs(spec_pair, eager_reference, tmp_path):
    # The whole-proposal graph maps the subset head's argmax back to token ids on the device.
    import json

    vocab = json.loads((Path(spec_pair[1]) / "config.json").read_text())["vocab_size"]
    draft = copy_with_config(spec_pair[1], tmp_path / "draft", vllm_spec_draft_vocab=list(range(0, vocab, 2)))
    llm = LLM(spec_pair[0], speculative_model=draft, num_speculative_tokens=3, speculative_policy="fixed", **KV)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == eager_reference
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert llm.llm_engine.executor.worker.draft_proposer.loop.graphs


@pytest.mark.parametrize("period", [4, 9])
def test_catch_up_graphs(spec_pair, eager_reference, period):
    # Draft == target: after plain steps the draft catches up in a replayed graph (every row padded
    # to one query length with tokens it already holds); its proposals must stay the target's.
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3, **KV)
    worker = llm.llm_engine.executor.worker
    worker.policy = BurstsPolicy(period)
    proposer = worker.draft_proposer
    assert proposer.uniform_catch_up
    lengths = []
    pick = proposer._uniform_catch_up_length
    proposer._uniform_catch_up_length = lambda behind, starts: lengths.append(pick(behind, starts)) or lengths[-1]
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == eager_reference
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    assert m["vllm:spec_decode_acceptance_rate"] >= 0.99
    assert any(q is not None for q in lengths), lengths


def test_one_row_gemv_in_graphs_matches_eager(spec_pair, monkeypatch):
    # bf16 at batch 1: every linear of a decode step is a Triton GEMV (fused with the norms and
    # SiLU·mul on these small weights), replayed in graphs; the kernels are deterministic, so the
    # graphed engine must give the eager engine's tokens.
    from vllm_spec.model import gemv

    modes = set()
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **k: (modes.add(a[0]), launch(*a, **k))[1])
    bf16 = dict(kv_cache_memory_bytes=1 << 26, dtype="bfloat16")
    prompt = PROMPTS[3:4]
    eager = _ids(LLM(spec_pair[0], enforce_eager=True, **bf16).generate(prompt, GREEDY, use_tqdm=False))
    assert modes == {0, 1, 2}
    graphed = LLM(spec_pair[0], **bf16)
    assert _ids(graphed.generate(prompt, GREEDY, use_tqdm=False)) == eager
    assert graphed.llm_engine.executor.worker.runner._graphs


def test_several_rows_gemv_in_graphs_matches_eager(spec_pair, monkeypatch):
    # bf16 at batch 1 with k = 4: verification multiplies 5 rows by every weight in the several-rows
    # Triton kernel, replayed in graphs; deterministic, so graphs give the eager engine's tokens.
    from vllm_spec.model import gemv

    rows = set()
    linear = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda x, *a: (rows.add(x.shape[0]), linear(x, *a))[1])
    spec = dict(kv_cache_memory_bytes=1 << 26, dtype="bfloat16", speculative_model=spec_pair[1],
                num_speculative_tokens=4, speculative_policy="fixed")
    prompt = PROMPTS[3:4]
    eager = _ids(LLM(spec_pair[0], enforce_eager=True, **spec).generate(prompt, GREEDY, use_tqdm=False))
    assert 5 in rows
    graphed = LLM(spec_pair[0], **spec)
    assert _ids(graphed.generate(prompt, GREEDY, use_tqdm=False)) == eager
    assert graphed.llm_engine.executor.worker.target.runner._graphs



def test_ragged_verification_in_graphs_matches_eager(spec_pair, monkeypatch):
    """24 sequences drafting 0-3 tokens each: verification replays ragged graphs (padding every
    sequence to 3 drafts would run more tokens) and gives the eager engine's tokens."""
    from vllm_spec.worker.ragged_graph import RaggedGraphedForward

    prompts = [{"prompt_token_ids": list(range(3 + i, 10 + i + i % 5))} for i in range(24)]
    reference = _ids(LLM(spec_pair[0], enforce_eager=True, **KV).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3, **KV)
    worker = llm.llm_engine.executor.worker
    worker.policy = KPerSequencePolicy()
    replays = []
    replay = RaggedGraphedForward.replay
    monkeypatch.setattr(RaggedGraphedForward, "replay", lambda self, b, s: replays.append(b) or replay(self, b, s))
    assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert replays and max(replays) == 24, replays

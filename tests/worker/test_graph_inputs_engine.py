"""The whole engine through the CUDA-graph input path, on the CPU: graphs stood in by eager replays
(conftest.EagerGraph), so batches are staged into the graphs' static buffers (the model's and the
greedy draft loop's), padded to their bucket and replayed exactly as on a GPU. Outputs must equal the
eager engine's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FIXED, SPEC_KV, KPerSequencePolicy, eager_capture, make_prompts, metric_values, output_ids

from vllm_spec import LLM, SamplingParams
from vllm_spec.spec_decode import draft_loop
from vllm_spec.worker import cuda_graph, staging
from vllm_spec.worker.model_runner import ModelRunner

# Lengths differ so that batches shrink step by step (padding rows come back into use).
GREEDY = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(12)]
SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=6 + 2 * i, ignore_eos=True)
          for i in range(12)]


def _runners(llm: LLM) -> list[ModelRunner]:
    worker = llm.llm_engine.executor.worker
    if hasattr(worker, "runner"):
        return [worker.runner]
    return [worker.target.runner] + ([worker.draft_runner] if hasattr(worker, "draft_runner") else [])


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Returns a function turning an engine's runners to the graph path; counts staged batches."""
    monkeypatch.setattr(cuda_graph, "capture_graph", eager_capture)
    monkeypatch.setattr(draft_loop, "capture_graph", eager_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    staged = []
    stage = cuda_graph.GraphedForward.stage

    def counting_stage(self, *args):
        staged.append(self.q_len)
        return stage(self, *args)

    monkeypatch.setattr(cuda_graph.GraphedForward, "stage", counting_stage)

    def turn_on(llm: LLM) -> list[int]:
        for runner in _runners(llm):
            runner.cuda_graphs = True
        proposer = getattr(llm.llm_engine.executor.worker, "draft_proposer", None)
        if proposer is not None:   # the greedy draft loop's graphs too, and uniform catch-ups
            proposer.uniform_catch_up = proposer.loop.use_graphs = True
            proposer.loop.capture(llm.llm_engine.config.speculative.num_speculative_tokens, 16)
        return staged
    return turn_on


@pytest.mark.parametrize("tables", ["whole rows", "compact"])
@pytest.mark.parametrize("params", ["greedy", "seeded"])
@pytest.mark.parametrize("engine", [dict(async_scheduling=False), dict(async_scheduling=True),
                                    dict(num_speculative_tokens=3, **FIXED), dict(num_speculative_tokens=4)])
def test_staged_graph_inputs_match_eager(spec_pair, graphs_on_cpu, engine, params, tables, monkeypatch):
    if tables == "compact":   # block tables sent as a compact block, as long contexts do
        monkeypatch.setattr(staging, "_FULL_ROWS_MAX", 0)
    target, draft = spec_pair
    kw = dict(SPEC_KV, dtype="float32", **engine)
    if "num_speculative_tokens" in engine:
        kw["speculative_model"] = draft
    prompts = make_prompts(12, seed=3)
    sp = GREEDY if params == "greedy" else SEEDED
    eager = LLM(target, enforce_eager=True, **kw)
    reference = output_ids(eager.generate(prompts, sp, use_tqdm=False))
    llm = LLM(target, **kw)
    staged = graphs_on_cpu(llm)
    assert output_ids(llm.generate(prompts, sp, use_tqdm=False)) == reference
    k = engine.get("num_speculative_tokens")
    if k is None:
        assert set(staged) == {1}, "decode batches did not go through a graph's staged inputs"
        graph = _runners(llm)[0]._graphs[1]
        assert graph.logits and any(g.replays for g, _ in graph.graphs.values()), "no decode step's logits in a graph"
    elif engine.get("speculative_policy") == "fixed":
        assert k + 1 in staged, "no verification batch was staged"
        loop = llm.llm_engine.executor.worker.draft_proposer.loop
        assert (params == "greedy") == any(g.replays for g, _ in loop.graphs.values())
        # The same drafts as the eager draft's (output equality alone cannot see a draft gone wrong).
        drafted = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
        assert [metric_values(llm)[m] for m in drafted] == [metric_values(eager)[m] for m in drafted]
    else:
        assert staged



def test_ragged_verification_graph_inputs_match_eager(spec_pair, graphs_on_cpu, monkeypatch):
    """Sequences drafting 0-3 tokens each: verification is staged into the ragged graphs' buffers (fewer
    tokens than padding every sequence to 3 drafts) and replayed; outputs equal the eager engine's.
    (Greedy: seeded requests draft the full k whatever the policy says.)"""
    from vllm_spec.worker import ragged_graph

    target, draft = spec_pair
    kw = dict(SPEC_KV, dtype="float32", speculative_model=draft, num_speculative_tokens=3)
    prompts = make_prompts(12, seed=5)
    eager = LLM(target, enforce_eager=True, **kw)
    eager.llm_engine.executor.worker.policy = KPerSequencePolicy()
    reference = output_ids(eager.generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(target, **kw)
    graphs_on_cpu(llm)
    worker = llm.llm_engine.executor.worker
    worker.target.runner.capture_ragged(4, 16)
    worker.policy = KPerSequencePolicy()
    staged = []
    stage = ragged_graph.RaggedGraphedForward.stage
    monkeypatch.setattr(ragged_graph.RaggedGraphedForward, "stage",
                        lambda self, *a: staged.append(len(a[3])) or stage(self, *a))
    assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert staged and max(staged) == 12, staged


def test_uniform_verification_at_a_slow_token_count_runs_ragged(spec_pair, graphs_on_cpu, monkeypatch):
    """Where the matmuls run a uniform verification's graph (its batch-size bucket's tokens) slowly against
    the ragged graph's tokens for the batch (token_counts), the batch is staged into the ragged graphs
    instead; outputs equal the eager engine's."""
    from vllm_spec.worker import ragged_graph
    from vllm_spec.worker import token_counts
    from vllm_spec.worker.token_counts import GRID, TokenPadding

    target, draft = spec_pair
    kw = dict(SPEC_KV, dtype="float32", speculative_model=draft, num_speculative_tokens=3, speculative_policy="fixed")
    prompts = make_prompts(12, seed=6)
    reference = output_ids(LLM(target, enforce_eager=True, **kw).generate(prompts, GREEDY, use_tqdm=False))
    counts = np.arange(GRID, 64 + GRID, GRID)
    # The uniform graph of 9-16 sequences runs its bucket's 16 rows of 3 drafts + 1: 64 tokens, here
    # slower than the ragged graph's 48 for 12 sequences by more than a ragged pass's extra cost.
    slow = TokenPadding(counts, np.where(counts == 64, 2.0, 1.0) * counts)
    monkeypatch.setattr(token_counts, "MIN_ROWS", 0)   # (tiny batches: every count profiled)
    monkeypatch.setattr(ModelRunner, "_token_padding", lambda self, max_q, max_batch: slow)
    llm = LLM(target, **kw)
    graphs_on_cpu(llm)
    worker = llm.llm_engine.executor.worker
    worker.target.runner.capture_ragged(4, 16)
    staged = []
    stage = ragged_graph.RaggedGraphedForward.stage
    monkeypatch.setattr(ragged_graph.RaggedGraphedForward, "stage",
                        lambda self, *a: staged.append((len(a[3]), len(a[0]))) or stage(self, *a))
    assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert (12, 48) in staged, staged
    assert all(n * 4 == tokens for n, tokens in staged), staged   # uniform batches only (fixed k)

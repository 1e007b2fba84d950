"""The whole engine through the CUDA-graph input path, on the CPU: graphs stood in by eager replays
(conftest.EagerGraph), so batches are staged into the graphs' static buffers, padded to their bucket
and replayed exactly as on a GPU. Outputs must equal the eager engine's."""

from __future__ import annotations

import pytest
import torch
from conftest import FIXED, SPEC_KV, eager_capture, make_prompts, output_ids

from vllm_spec import LLM, SamplingParams
from vllm_spec.worker import cuda_graph
from vllm_spec.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(12)]


def _runners(llm: LLM) -> list[ModelRunner]:
    worker = llm.llm_engine.executor.worker
    if hasattr(worker, "runner"):
        return [worker.runner]
    return [worker.target.runner] + ([worker.draft_runner] if hasattr(worker, "draft_runner") else [])


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Returns a function turning an engine's runners to the graph path; counts staged batches."""
    monkeypatch.setattr(cuda_graph, "capture_graph", eager_capture)
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
        return staged
    return turn_on


@pytest.mark.parametrize("params", ["greedy", "seeded"])
@pytest.mark.parametrize("engine", [dict(async_scheduling=False), dict(async_scheduling=True),
                                    dict(num_speculative_tokens=3, **FIXED), dict(num_speculative_tokens=4)])
def test_staged_graph_inputs_match_eager(spec_pair, graphs_on_cpu, engine, params):
    target, draft = spec_pair
    kw = dict(SPEC_KV, dtype="float32", **engine)
    if "num_speculative_tokens" in engine:
        kw["speculative_model"] = draft
    prompts = make_prompts(12, seed=3)
    sp = GREEDY if params == "greedy" else SEEDED
    reference = output_ids(LLM(target, enforce_eager=True, **kw).generate(prompts, sp, use_tqdm=False))
    llm = LLM(target, **kw)
    staged = graphs_on_cpu(llm)
    assert output_ids(llm.generate(prompts, sp, use_tqdm=False)) == reference
    k = engine.get("num_speculative_tokens")
    if k is None:
        assert set(staged) == {1}, "decode batches did not go through a graph's staged inputs"
    elif engine.get("speculative_policy") == "fixed":
        assert k + 1 in staged, "no verification batch was staged"
    else:
        assert staged

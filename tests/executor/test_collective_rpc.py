"""vLLM's LLM.collective_rpc and LLM.apply_model: a call on every rank's worker, results by rank; what a call
raises reaches the caller and the engine serves on; bad arguments are named."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import output_ids

from vllm_spec import LLM, SamplingParams

OPTS = dict(kv_cache_memory_bytes=1 << 24, max_model_len=128, device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33]}, {"prompt_token_ids": [40, 2, 7]}]


def _boom(worker):
    raise KeyError("boom")


@pytest.fixture(scope="module")
def llm(spec_pair):
    return LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2, **OPTS)


def test_calls_on_the_worker_and_the_model(llm):
    assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
    assert llm.collective_rpc("get_model") == [llm.llm_engine.executor.worker.get_model()]
    got = llm.collective_rpc(lambda worker, a, b=0: (type(worker).__name__, a, b), args=(1,), kwargs={"b": 2})
    assert got == [("SpecDecodeWorker", 1, 2)]


@pytest.mark.parametrize("call, message", [
    (dict(method=3), "method must be a worker method's name or a callable"),
    (dict(method="no_such_method"), r"the worker \(SpecDecodeWorker\) has no method 'no_such_method'"),
    (dict(method="_stop"), "has no method '_stop'"),
    (dict(method="get_model", args="ab"), "args must be a tuple or a list, got str"),
    (dict(method="get_model", kwargs={1: 2}), "kwargs must be a dict of keyword names or None"),
    (dict(method="get_model", timeout=-1), "timeout must be a positive number of seconds or None, got -1"),
])
def test_bad_arguments_are_named(llm, call, message):
    with pytest.raises(ValueError, match=message):
        llm.collective_rpc(**call)
    with pytest.raises(ValueError, match="apply_model: func must be a callable taking the model"):
        llm.apply_model("model")


def test_what_a_call_raises_reaches_the_caller_and_the_engine_serves_on(llm):
    before = output_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with pytest.raises(KeyError, match="boom"):
        llm.collective_rpc(_boom)
    assert output_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_every_rank_answers_with_tensor_parallelism(spec_pair, backend, request):
    """tp=2 (a process or a Ray actor per rank): results by rank (each rank's shard, copies of its tensors), a
    lambda travels both ways (cloudpickle), a rank's error (SystemExit too), an answer that cannot travel back
    and a timeout are raised here while the ranks serve on, and arguments that cannot reach the ranks are
    refused before anything is sent."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")

    def rank_one_fails(worker):   # (nested: cloudpickle sends it by value, as Ray's actors cannot import tests)
        if worker.tp.rank == 1:
            raise ZeroDivisionError("rank 1's bug")
        return worker.tp.rank

    def exits(worker):
        raise SystemExit(3)

    llm = LLM(spec_pair[0], tensor_parallel_size=2, distributed_executor_backend=backend, **OPTS)
    try:
        before = output_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        rows = llm.apply_model(lambda model: model.layers[0].self_attn.qkv_proj.weight.shape[0])
        assert len(rows) == 2 and rows[0] == rows[1]
        for weight in llm.apply_model(lambda model: model.layers[0].mlp.down_proj.weight.detach()):
            weight.zero_()   # (a copy: the ranks' weights stay)
        assert llm.collective_rpc(lambda worker, x: (worker.tp.rank, x), args=(7,)) == [(0, 7), (1, 7)]
        assert [f() for f in llm.collective_rpc(lambda worker: lambda: 5)] == [5, 5]
        with pytest.raises(RuntimeError, match="failed on tensor-parallel rank 1: ZeroDivisionError: rank 1's bug"):
            llm.collective_rpc(rank_one_fails)
        with pytest.raises(RuntimeError, match="failed on tensor-parallel rank 0: SystemExit: 3"):
            llm.collective_rpc(exits)
        with pytest.raises(RuntimeError, match="failed on tensor-parallel rank 0"):
            llm.collective_rpc(lambda worker: threading.Lock())
        with pytest.raises(ValueError, match="must pickle"):
            llm.collective_rpc("get_model", args=(threading.Lock(),))
        with pytest.raises(TimeoutError, match="did not finish collective_rpc within 0.5 s"):
            llm.collective_rpc(lambda worker: time.sleep(2), timeout=0.5)
        assert llm.collective_rpc(lambda worker: worker.tp.rank, timeout=float("inf")) == [0, 1]
        assert output_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before
    finally:
        llm.llm_engine.executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.collective_rpc("get_model")

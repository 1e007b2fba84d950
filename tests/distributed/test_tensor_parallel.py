"""Tensor parallelism on CPU: 2 ranks over gloo, through the multiprocessing and the Ray executors.

The target shards over tp=2 ranks; the draft runs on a sub-group of the same processes
(draft_tp=1: rank 0 only, the other rank receives its proposals; draft_tp=2: both ranks).
Greedy output must equal tp=1 token for token, and with k fixed the draft counts too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import threading
import time

import pytest
import torch
from conftest import make_noisy_draft, make_tiny_model, metric_values, output_ids

from vllm_spec import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from vllm_spec.config import ParallelConfig
from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.executor.base import WorkerError

# On the CPU on any machine (a GPU machine may hold fewer CUDA devices than the ranks).
OPTS = dict(kv_cache_memory_bytes=1 << 24, max_model_len=128, device="cpu")
SPEC = dict(num_speculative_tokens=3, speculative_policy="fixed")
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True)
          for i in range(4)]


def _prompts(n: int = 6, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]} for _ in range(n)]


def _spec_counts(llm: LLM) -> tuple:
    m = metric_values(llm)
    return (m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"],
            m["vllm:spec_decode_num_accepted_tokens"])


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.executor.shutdown()


@pytest.fixture(scope="module")
def reference(spec_pair):
    """tp=1: greedy ids of the target alone, and of speculation with fixed k (ids + draft counts)."""
    target, draft = spec_pair
    plain = LLM(target, **OPTS)
    greedy = output_ids(plain.generate(_prompts(), GREEDY, use_tqdm=False))
    spec = LLM(target, speculative_model=draft, **SPEC, **OPTS)
    assert output_ids(spec.generate(_prompts(), GREEDY, use_tqdm=False)) == greedy
    counts = _spec_counts(spec)
    sampled = output_ids(spec.generate(_prompts(4, seed=1), SEEDED, use_tqdm=False))
    return greedy, counts, sampled


def _check(llm: LLM, reference, speculative: bool) -> None:
    greedy, counts, sampled = reference
    assert output_ids(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == greedy
    if speculative:
        assert counts[1] > 0 and counts[2] > 0
        assert _spec_counts(llm) == counts
        # Sampled + seeded: the draft's probabilities cross ranks (draft_tp < tp) and rank 0 decides.
        out = output_ids(llm.generate(_prompts(4, seed=1), SEEDED, use_tqdm=False))
        assert [len(t) for t in out] == [16] * 4
        assert out == sampled
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


CASES = [pytest.param({}, id="plain"),
         pytest.param({"speculative_draft_tensor_parallel_size": 1}, id="spec-draft_tp1"),
         pytest.param({"speculative_draft_tensor_parallel_size": 2}, id="spec-draft_tp2")]


@pytest.mark.parametrize("case", CASES)
def test_tp2_multiproc_matches_tp1(spec_pair, reference, case):
    spec = {"speculative_model": spec_pair[1], **SPEC, **case} if case else {}
    llm = LLM(spec_pair[0], tensor_parallel_size=2, **spec, **OPTS)
    try:
        assert type(llm.llm_engine.executor).__name__ == "MultiprocExecutor"   # the default for tp > 1
        _check(llm, reference, bool(case))
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("arch, options", [("qwen3", {}), ("gemma3", {}),
                                           ("gemma2", dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
                                           ("granite", dict(residual_multiplier=0.4, logits_scaling=2.5)),
                                           ("phi3", dict(partial_rotary_factor=0.5)), ("mixtral", {}),
                                           ("qwen3_moe", dict(mlp_only_layers=[1])), ("qwen2_moe", {}),
                                           ("opt", dict(word_embed_proj_dim=32)), ("gpt_neox", dict(rotary_pct=0.5)),
                                           ("gpt2", {}), ("gpt_bigcode", {}), ("phi", {})])
def test_tp2_head_norms_match_tp1(tmp_path, arch, options):
    """Per-head query/key norms (Qwen3, Gemma 3) on sharded heads: each rank norms its own heads with the
    whole (replicated) norm weights; Gemma 2's soft caps on each rank's heads and on the gathered logits;
    Granite's scalars on each rank's partial sums; Phi-3's fused checkpoint tensors split into each rank's q, k, v,
    gate and up rows; Mixtral's experts' slices of the intermediate dimension, the router whole on each rank; OPT's
    biases, learned positions and projections in and out whole on each rank; GPT-NeoX's per-head fused q/k/v split
    into each rank's heads; GPT-2's transposed Conv1D weights sharded; GPT-BigCode's one KV head on every rank;
    Phi's LM head bias sharded with its rows; the draft on rank 0 alone."""
    target = make_tiny_model(tmp_path / "target", arch, seed=13, head_dim=32, num_key_value_heads=2, **options)
    draft = make_noisy_draft(target, tmp_path / "draft", 0.04)
    expected = output_ids(LLM(str(target), **OPTS).generate(_prompts(), GREEDY, use_tqdm=False))
    llm = LLM(str(target), tensor_parallel_size=2, speculative_model=str(draft),
              speculative_draft_tensor_parallel_size=1, **SPEC, **OPTS)
    try:
        assert output_ids(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == expected
        assert _spec_counts(llm)[2] > 0
    finally:
        _shutdown(llm)


def test_tp2_prefix_caching_with_a_draft_on_one_rank(spec_pair):
    """The prefix cache is the driver's; every rank reads its K/V through the block tables (the draft on
    rank 0 starts from the cached prefix too): outputs as without the cache."""
    prompts = [{"prompt_token_ids": list(range(3, 40)) + p["prompt_token_ids"]} for p in _prompts()]
    ref = output_ids(LLM(spec_pair[0], **OPTS).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(spec_pair[0], tensor_parallel_size=2, speculative_model=spec_pair[1], enable_prefix_caching=True,
              speculative_draft_tensor_parallel_size=1, **SPEC, **OPTS)
    try:
        outs = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        assert output_ids(outs) == ref
        assert [o.num_cached_tokens for o in outs] == [0] + [32] * 5
    finally:
        _shutdown(llm)


def test_tp2_logit_bias_allowed_token_ids_bad_words_and_grammars(spec_pair):
    """The constraints travel with the requests to every rank (each rank's worker follows the grammars):
    tp=2 with speculation equals tp=1 without."""
    one = LLM(spec_pair[0], **OPTS)
    plain = output_ids(one.generate(_prompts(4), GREEDY, use_tqdm=False))
    words = [one.get_tokenizer().decode(plain[0][3:5])]
    biased = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={11: 3.0},
                            allowed_token_ids=list(range(0, 384, 2)), bad_words=words)
    params = [biased, biased, SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[a-z]{2,9}"}),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["one", "two", "three"]})]
    want = output_ids(one.generate(_prompts(4), params, use_tqdm=False))
    assert want[:2] != plain[:2]
    llm = LLM(spec_pair[0], tensor_parallel_size=2, speculative_model=spec_pair[1], **SPEC, **OPTS)
    try:
        assert output_ids(llm.generate(_prompts(4), params, use_tqdm=False)) == want
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("case", CASES)
def test_tp2_ray_matches_tp1(spec_pair, reference, ray_cluster, case):
    spec = {"speculative_model": spec_pair[1], **SPEC, **case} if case else {}
    llm = LLM(spec_pair[0], tensor_parallel_size=2, distributed_executor_backend="ray", **spec, **OPTS)
    try:
        assert type(llm.llm_engine.executor).__name__ == "RayExecutor"
        _check(llm, reference, bool(case))
    finally:
        _shutdown(llm)


# Invalid combinations: clear errors at construction, before any process starts ----------------------

@pytest.mark.parametrize("tp, draft_tp", [(2, 3), (4, 3), (2, 0), (1, 2)])
def test_invalid_draft_tp(spec_pair, tp, draft_tp):
    args = EngineArgs(model=spec_pair[0], tensor_parallel_size=tp, speculative_model=spec_pair[1],
                      num_speculative_tokens=2, speculative_draft_tensor_parallel_size=draft_tp, **OPTS)
    with pytest.raises(ValueError, match=r"speculative_draft_tensor_parallel_size.*must divide "
                                         rf"tensor_parallel_size \({tp}\)"):
        args.create_engine_config()


def test_invalid_draft_tp_in_speculative_config(spec_pair):
    args = EngineArgs(model=spec_pair[0], tensor_parallel_size=2, **OPTS,
                      speculative_config={"model": spec_pair[1], "num_speculative_tokens": 2,
                                          "draft_tensor_parallel_size": 4})
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size.*one of \[1, 2\], got 4"):
        args.create_engine_config()


def test_invalid_parallel_settings(tiny_llama):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"):
        EngineArgs(model=str(tiny_llama), tensor_parallel_size=3, **OPTS).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineArgs(model=str(tiny_llama), tensor_parallel_size=0, **OPTS).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineArgs(model=str(tiny_llama), distributed_executor_backend="mpi", **OPTS).create_engine_config()


def test_tp_larger_than_cuda_devices(tiny_llama, monkeypatch):
    config = EngineArgs(model=str(tiny_llama), **OPTS).create_engine_config()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    on_gpu = dataclasses.replace(config.model, device=torch.device("cuda"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) is larger than the number of CUDA devices"):
        dataclasses.replace(config, model=on_gpu, parallel=ParallelConfig(2))


# A dead worker: an error, never a hang -------------------------------------------------------------

def _bounded(fn, timeout: float = 60.0):
    """fn() in a thread; the test fails (instead of hanging) if it does not return within timeout."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"no answer within {timeout} s: the engine hangs on a dead worker"
    return result


def _kill_mid_request(llm: LLM, kill) -> None:
    engine = llm.llm_engine
    engine.add_request("a", _prompts(1)[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", _prompts(2)[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()                          # prefill: both requests are in flight now
    kill()
    start = time.monotonic()
    result = _bounded(lambda: llm.generate(_prompts(1, seed=5), GREEDY, use_tqdm=False))
    assert isinstance(result.get("error"), WorkerError), result
    assert "rank 1" in str(result["error"]) and "died" in str(result["error"])
    assert time.monotonic() - start < 60
    # The executor stays failed: later steps fail at once, they do not wait on the dead rank.
    result = _bounded(lambda: llm.generate(_prompts(1, seed=6), GREEDY, use_tqdm=False), timeout=10)
    assert isinstance(result.get("error"), WorkerError), result


def test_a_step_the_driver_stopped_waiting_for_is_answered_and_dropped(spec_pair, reference):
    """Ctrl-C while the driver waits for a step (generate interrupted): the ranks still run it and rank 0
    answers it; that late reply must not be read as the next step's (outputs one step behind for good,
    and a scheduler that never settles: the engine spun forever)."""
    llm = LLM(spec_pair[0], tensor_parallel_size=2, speculative_model=spec_pair[1], **SPEC, **OPTS)
    executor = llm.llm_engine.executor
    collect, steps = executor._collect, []

    def interrupted(waiting, method, timeout):
        steps.append(method)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return collect(waiting, method, timeout)

    executor._collect = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(_prompts(2, seed=3), GREEDY, use_tqdm=False)
        result = _bounded(lambda: llm.generate(_prompts(), GREEDY, use_tqdm=False))
        assert output_ids(result["value"]) == reference[0]
        engine = llm.llm_engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    finally:
        _shutdown(llm)


def test_unpicklable_extra_args_fail_their_request_alone(spec_pair, reference):
    llm = LLM(spec_pair[0], tensor_parallel_size=2, **OPTS)
    try:
        bad = SamplingParams(max_tokens=4, extra_args={"callback": lambda x: x})
        with pytest.raises(ValueError, match="extra_args must be picklable with tensor_parallel_size > 1"):
            llm.llm_engine.add_request("bad", {"prompt_token_ids": [5, 6]}, bad)
        assert not llm.llm_engine.has_unfinished_requests()
        fine = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, extra_args={"tag": [1, 2]})
        assert output_ids(llm.generate(_prompts(), fine, use_tqdm=False)) == reference[0]
    finally:
        _shutdown(llm)


def test_async_engine_shutdown_stops_the_ranks(spec_pair):
    """AsyncLLMEngine.shutdown() frees what the engine holds, its ranks' processes (and their memory) too."""
    async def serve_and_stop():
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
            model=spec_pair[0], tensor_parallel_size=2, speculative_model=spec_pair[1], **SPEC, **OPTS))
        async for _ in engine.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=4), "a"):
            pass
        procs = engine.engine.executor.procs
        await engine.shutdown()
        return [p.is_alive() for p in procs]   # the engine object still alive: its own doing, not its drop

    assert asyncio.run(serve_and_stop()) == [False, False]


def test_killed_worker_fails_requests_multiproc(spec_pair):
    llm = LLM(spec_pair[0], tensor_parallel_size=2, speculative_model=spec_pair[1], **SPEC, **OPTS)
    executor = llm.llm_engine.executor
    try:
        _kill_mid_request(llm, lambda: os.kill(executor.procs[1].pid, signal.SIGKILL))
        assert not any(p.is_alive() for p in executor.procs)   # the survivor was stopped too
    finally:
        _shutdown(llm)


def test_killed_worker_fails_requests_ray(spec_pair, ray_cluster):
    llm = LLM(spec_pair[0], tensor_parallel_size=2, distributed_executor_backend="ray", **OPTS)
    executor = llm.llm_engine.executor
    pid = ray_cluster.get(executor.actors[1].ping.remote())
    try:
        _kill_mid_request(llm, lambda: os.kill(pid, signal.SIGKILL))
    finally:
        _shutdown(llm)

"""The scheduler's "priority" policy (vLLM's scheduling_policy): admission in (priority, arrival)
order, preemption of the last in that order; and the engine, LLM and server taking priorities."""

from __future__ import annotations

import pytest

from vllm_spec.config import SchedulerConfig
from vllm_spec.core.block_manager import BlockManager
from vllm_spec.core.scheduler import Scheduler
from vllm_spec.core.sequence import Sequence
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.sampling_params import SamplingParams


def _seq(rid: str, priority: int, arrival: float, prompt_len: int = 4) -> Sequence:
    seq = Sequence(rid, 0, list(range(1, prompt_len + 1)), SamplingParams(), max_tokens=64)
    seq.priority, seq.arrival_time = priority, arrival
    return seq


def _scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_model_len=256, policy=policy)
    return Scheduler(cfg, BlockManager(num_blocks, 4))


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = _scheduler("priority", max_num_seqs=2)
    for rid, prio, t in (("a", 5, 1.0), ("b", 0, 2.0), ("c", 5, 0.5), ("d", -1, 3.0), ("e", 0, 1.5)):
        sched.add(_seq(rid, prio, t))
    assert [s.request_id for s in sched.waiting] == ["d", "e", "b", "c", "a"]
    assert [item.seq.request_id for item in sched.schedule().scheduled] == ["d", "e"]
    fcfs = _scheduler("fcfs")
    for rid, prio, t in (("a", 0, 1.0), ("b", 0, 2.0)):
        fcfs.add(_seq(rid, prio, t))
    assert [s.request_id for s in fcfs.waiting] == ["a", "b"]


def test_preemption_takes_the_lowest_priority_running_sequence():
    # 4 usable blocks of 4 slots: three 4-token prompts fill three; growing needs more.
    sched = _scheduler("priority", num_blocks=5)
    low, high, mid = _seq("low", 9, 1.0), _seq("high", 0, 2.0), _seq("mid", 3, 3.0)
    for s in (low, high, mid):
        sched.add(s)
    assert len(sched.schedule().scheduled) == 3
    for s in (low, high, mid):   # all prefilled: each sampled a token, every block is full
        s.output_token_ids.append(7)
        s.num_computed_tokens = s.num_tokens - 1
    out = sched.schedule()
    # Two sequences need a new block each, one is free: the lowest priority (newest in FCFS would be "mid") goes.
    assert [s.request_id for s in out.preempted] == ["low"]
    assert sched.waiting[0] is low
    fcfs = _scheduler("fcfs", num_blocks=5)
    seqs = [_seq(r, 0, t) for r, t in (("low", 1.0), ("high", 2.0), ("mid", 3.0))]
    for s in seqs:
        fcfs.add(s)
    fcfs.schedule()
    for s in seqs:
        s.output_token_ids.append(7)
        s.num_computed_tokens = s.num_tokens - 1
    assert [s.request_id for s in fcfs.schedule().preempted] == ["mid"]


def test_a_preempted_sequence_goes_back_in_priority_order():
    sched = _scheduler("priority")
    waiting_high, waiting_low = _seq("wh", 0, 5.0), _seq("wl", 9, 0.1)
    sched.add(waiting_high)
    sched.add(waiting_low)
    preempted = _seq("p", 5, 1.0)
    sched._enqueue(preempted, front=True)
    assert [s.request_id for s in sched.waiting] == ["wh", "p", "wl"]


def test_scheduling_policy_is_checked(tiny_llama):
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(str(tiny_llama), scheduling_policy="lifo", kv_cache_memory_bytes=1 << 24)


def test_llm_serves_priorities_first(tiny_llama):
    """One sequence at a time: the outputs come back in prompt order, but the engine ran them by
    priority (their first-token times say so); the same priority keeps arrival order."""
    llm = LLM(str(tiny_llama), scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=1 << 24)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, -2, 3, 0])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 3, 0, 2]
    plain = LLM(str(tiny_llama), max_num_seqs=1, kv_cache_memory_bytes=1 << 24)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in
                                                      plain.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(prompts[:1], params, use_tqdm=False, priority=[1.5])
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        plain.generate(prompts[:1], params, use_tqdm=False, priority=[1])


def test_priorities_under_preemption_keep_every_output(spec_pair):
    """A KV cache too small for the batch, speculation on, priorities mixed: preemptions follow priority and
    every output is the one computed alone (greedy)."""
    prompts = [{"prompt_token_ids": [3 + (5 * i + j) % 250 for j in range(20 + 3 * i)]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(spec_pair[0], kv_cache_memory_bytes=1 << 25).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, speculative_policy="fixed",
              scheduling_policy="priority", num_gpu_blocks_override=16, max_model_len=96, block_size=16)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[i % 3 for i in range(8)])
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_a_higher_priority_sequence_takes_the_block_of_one_scheduled_before_it():
    """As vLLM V1: the victim is the last in priority order even when it was already scheduled this step (it is
    taken out of the step); the higher-priority sequence does not preempt itself (a reviewer's repro)."""
    sched = _scheduler("priority", num_blocks=4)   # 3 usable blocks of 4
    low, high = _seq("low", 9, 1.0), _seq("high", 0, 2.0)
    sched.add(low)
    sched.schedule()
    sched.add(high)
    sched.schedule()
    for s in (low, high):   # both prompts (4 tokens) computed, a token sampled: each needs a 2nd block, one is free
        s.output_token_ids.append(7)
        s.num_computed_tokens = s.num_tokens - 1
    out = sched.schedule()
    assert [item.seq.request_id for item in out.scheduled] == ["high"]
    assert [s.request_id for s in out.preempted] == ["low"]
    assert out.num_prefill_tokens == 0 and not out.prefilling


def test_prompt_chunks_take_the_budget_in_priority_order():
    """Running prompts (low admitted before high) share a small token budget: by priority, high's chunk goes
    first; first come, first served, low's."""
    from vllm_spec.core.sequence import SequenceStatus

    def running_prompts(policy: str) -> list[tuple[str, int]]:
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=256, policy=policy)
        sched = Scheduler(cfg, BlockManager(64, 4))
        for rid, prio, t in (("low", 5, 1.0), ("high", 1, 2.0)):
            seq = _seq(rid, prio, t, prompt_len=20)
            sched.block_manager.allocate(seq, 4)
            seq.num_computed_tokens, seq.status = 4, SequenceStatus.RUNNING
            sched.running.append(seq)
        return [(i.seq.request_id, i.num_new_tokens) for i in sched.schedule().scheduled]

    assert running_prompts("priority") == [("high", 6)]
    assert running_prompts("fcfs") == [("low", 6)]

"""Scheduler: decode-first continuous batching, chunked prefill, max_num_seqs, preemption by recompute."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_spec.config import SchedulerConfig
from vllm_spec.core.block_manager import BlockManager
from vllm_spec.core.scheduler import Scheduler, SchedulerOutput
from vllm_spec.core.sequence import Sequence, SequenceStatus
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.sampling_params import SamplingParams


def make_seq(prompt_len: int, max_tokens: int = 4, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(range(1, prompt_len + 1)), SamplingParams(), max_tokens=max_tokens)


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int = 64, budget: int = 2048,
                   lookahead: int = 0, max_model_len: int = 4096, chunked_prefill: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          chunked_prefill=chunked_prefill)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), lookahead)


def step(sched: Scheduler) -> SchedulerOutput:
    """What the engine does after the model ran: advance computed tokens, append a sampled token."""
    out = sched.schedule()
    samples = [item.samples for item in out.scheduled]
    for item, sampled in zip(out.scheduled, samples):
        seq = item.seq
        if sampled:
            seq.output_token_ids.append(7)
            seq.num_computed_tokens = seq.num_tokens - 1
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        else:
            seq.num_computed_tokens += item.num_new_tokens
    out.sampled = samples  # ScheduledSeq.samples is only meaningful before this update
    return out


def test_long_prompt_is_chunked_under_the_token_budget():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=10)
    seq = make_seq(27, max_tokens=2)
    sched.add(seq)
    chunks = []
    while not seq.output_token_ids:
        out = step(sched)
        assert len(out.scheduled) == 1
        chunks.append((out.scheduled[0].num_new_tokens, out.sampled[0]))
    assert chunks == [(10, False), (10, False), (7, True)]
    # The table covers exactly the computed prompt at every point (ceil(27 / 4) = 7 blocks).
    assert len(seq.block_table) == 7


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=12, max_model_len=12, chunked_prefill=False)
    first, second, third = make_seq(8, max_tokens=3, rid="a"), make_seq(11, max_tokens=2, rid="b"), make_seq(2, rid="c")
    for seq in (first, second, third):
        sched.add(seq)
    # 8 tokens fit; b's 11 do not fit the 4 left, and c waits behind it (arrival order).
    assert [(i.seq.request_id, i.num_new_tokens) for i in step(sched).scheduled] == [("a", 8)]
    # a's decode takes 1 of 12: b's 11 fit whole, c's 2 do not fit the 0 left.
    assert [(i.seq.request_id, i.num_new_tokens) for i in step(sched).scheduled] == [("a", 1), ("b", 11)]
    assert [(i.seq.request_id, i.num_new_tokens) for i in step(sched).scheduled] == [("a", 1), ("b", 1), ("c", 2)]


def test_without_chunked_prefill_the_budget_must_hold_the_longest_prompt():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_model_len \(12\)"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=12, chunked_prefill=False)


def test_decodes_are_scheduled_before_prefills():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=10)
    bm = sched.block_manager
    prefill, decode = make_seq(30, max_tokens=8), make_seq(3, max_tokens=8)
    # `prefill` is older (first in running) and half-way through its prompt; `decode` is generating.
    bm.allocate(prefill, 8)
    prefill.num_computed_tokens = 8
    bm.allocate(decode, 3)
    decode.output_token_ids.append(5)
    decode.num_computed_tokens = 3
    for s in (prefill, decode):
        s.status = SequenceStatus.RUNNING
    sched.running = [prefill, decode]
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(decode, 1), (prefill, 9)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples


def test_decodes_keep_running_while_a_new_long_prompt_is_chunked():
    sched = make_scheduler(num_blocks=128, block_size=4, budget=8)
    short = [make_seq(2, max_tokens=20) for _ in range(3)]
    for s in short:
        sched.add(s)
    step(sched)  # all three prefill (6 tokens) and sample
    long = make_seq(40, max_tokens=2)
    sched.add(long)
    for _ in range(4):
        out = step(sched)
        tokens = sum(i.num_new_tokens for i in out.scheduled)
        assert tokens <= 8
        # Every decode is served each step, first; the prompt takes what is left.
        assert [i.seq for i in out.scheduled[:3]] == short
        assert all(i.num_new_tokens == 1 for i in out.scheduled[:3])
        assert out.scheduled[3].seq is long and out.scheduled[3].num_new_tokens == 5
    assert long.num_computed_tokens == 20


def test_max_num_seqs_respected():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=3)
    seqs = [make_seq(5, max_tokens=3) for _ in range(10)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        out = step(sched)
        steps += 1
        assert len(out.scheduled) <= 3
        assert len(sched.running) <= 3
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)
    assert steps >= 10  # 10 requests of 3 tokens, at most 3 at a time
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_preemption_frees_blocks_and_requeues_at_front():
    sched = make_scheduler(num_blocks=7, block_size=4)  # 6 usable blocks = 24 slots
    bm = sched.block_manager
    old, new = make_seq(8, max_tokens=100), make_seq(8, max_tokens=100)
    sched.add(old)
    sched.add(new)
    step(sched)  # both prefilled: 2 blocks each
    waiting = make_seq(20, max_tokens=1)  # cannot be admitted while both run (needs 5 blocks)
    sched.add(waiting)
    preempted = None
    for _ in range(20):
        free_before = bm.num_free_blocks
        held_by_new = len(new.block_table)
        out = step(sched)
        if out.preempted:
            preempted = out
            break
    assert preempted is not None, "the cache never ran out"
    assert preempted.preempted == [new]  # the newest running sequence is the victim
    assert new.status is SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [new, waiting]  # back at the front of the queue
    assert sched.running == [old]
    assert [i.seq for i in preempted.scheduled] == [old]
    # The victim's blocks all went back: only the survivor holds any.
    assert held_by_new >= 3 and free_before == 0
    assert len(old.block_table) + bm.num_free_blocks == bm.num_usable_blocks
    # The victim keeps its generated tokens and is recomputed from all of them.
    n_out = new.num_output_tokens
    assert n_out > 0
    sched.finish(old, SequenceStatus.FINISHED_ABORTED)
    out = step(sched)
    assert out.scheduled[0].seq is new and out.scheduled[0].num_new_tokens == 8 + n_out
    assert new.num_output_tokens == n_out + 1


def test_lookahead_slots_reserved_for_decodes_only():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=6, lookahead=3)
    seq = make_seq(10, max_tokens=10)
    sched.add(seq)
    out = step(sched)                       # chunk of 6, no lookahead: 2 blocks
    assert out.scheduled[0].num_new_tokens == 6 and len(seq.block_table) == 2
    out = step(sched)                       # last 4 prompt tokens + 3 lookahead = 13 slots: 4 blocks
    assert out.sampled == [True] and len(seq.block_table) == 4
    out = step(sched)                       # decode: 10 computed + 1 + 3 = 14 slots: 4 blocks
    assert len(seq.block_table) == 4
    step(sched)                             # 11 + 1 + 3 = 15
    step(sched)                             # 12 + 1 + 3 = 16
    step(sched)                             # 13 + 1 + 3 = 17 -> 5 blocks
    assert len(seq.block_table) == 5


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    num_blocks=st.integers(9, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    lookahead=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_random_workloads_finish_without_leaks(prompt_lens, max_tokens, num_blocks, block_size, budget,
                                               max_num_seqs, lookahead, seed):
    """Requests arriving over time under tight memory all finish; every step obeys the limits."""
    max_len_slots = (30 + 12 + lookahead)
    if (num_blocks - 1) * block_size < max_len_slots:
        num_blocks = -(-max_len_slots // block_size) + 1  # one full-length sequence always fits
    sched = make_scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs, budget=budget, lookahead=lookahead)
    bm = sched.block_manager
    rng = random.Random(seed)
    pending = [make_seq(p, max_tokens=m) for p, m in zip(prompt_lens, max_tokens)]
    all_seqs = list(pending)
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        before = {id(s): s.num_output_tokens for s in all_seqs}
        decoding = {id(s) for s in sched.running if s.num_uncomputed_tokens == 1}
        out = step(sched)
        assert sum(i.num_new_tokens for i in out.scheduled) <= budget
        assert len(out.scheduled) <= max_num_seqs and len(sched.running) <= max_num_seqs
        ids = [id(i.seq) for i in out.scheduled]
        assert len(ids) == len(set(ids))
        # Running decodes come before every prefill chunk.
        is_prefill = [id(i.seq) not in decoding for i in out.scheduled]
        assert is_prefill == sorted(is_prefill)
        for s in all_seqs:
            assert s.num_output_tokens - before[id(s)] in (0, 1)
        held = [b for s in sched.running for b in s.block_table]
        assert len(held) == len(set(held))
        assert len(held) + bm.num_free_blocks == bm.num_usable_blocks
        assert all(not s.block_table for s in sched.waiting)
    else:
        pytest.fail("scheduler did not drain the workload (livelock?)")
    assert all(s.status is SequenceStatus.FINISHED_LENGTH and s.num_output_tokens == s.max_tokens for s in all_seqs)
    assert bm.num_free_blocks == bm.num_usable_blocks


# End to end: a KV cache so small that requests are preempted gives the same outputs. ------------------

E2E_PROMPTS = [
    "def wrap(text, width=70, **kwargs):",
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "import re\n\n__all__ = ['TextWrapper', 'wrap', 'fill', 'dedent', 'indent', 'shorten']",
    "x = 1",
    "class TextWrapper:",
]
E2E_MAX_TOKENS = 40


def _num_preemptions(llm: LLM) -> int:
    return next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


@pytest.fixture(scope="module")
def roomy_llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=128)


@pytest.fixture(scope="module")
def cramped_llm(tiny_llama):
    # max_model_len 128 / block_size 16 = 8 blocks per sequence; 9 blocks (8 usable) hold just one
    # full-length sequence, while 6 requests of up to 60 tokens need ~20 blocks together.
    return LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks_override=9, max_num_batched_tokens=32)


def _compare(roomy, cramped, params):
    before = _num_preemptions(cramped)
    a = roomy.generate(E2E_PROMPTS, params, use_tqdm=False)
    b = cramped.generate(E2E_PROMPTS, params, use_tqdm=False)
    assert _num_preemptions(cramped) > before
    assert _num_preemptions(roomy) == 0
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            assert cx.text == cy.text
            assert cx.finish_reason == cy.finish_reason
    return a


def test_preemption_preserves_greedy_outputs(roomy_llm, cramped_llm):
    outs = _compare(roomy_llm, cramped_llm, SamplingParams(temperature=0, max_tokens=E2E_MAX_TOKENS, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == E2E_MAX_TOKENS for o in outs)
    # Nothing held once everything is done.
    bm = cramped_llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_preemption_preserves_seeded_sampling(roomy_llm, cramped_llm):
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=100 + i, max_tokens=E2E_MAX_TOKENS,
                             ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.2,
                             n=2 if i == 0 else 1)
              for i in range(len(E2E_PROMPTS))]
    outs = _compare(roomy_llm, cramped_llm, params)
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids  # really sampled

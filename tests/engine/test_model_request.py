"""The engine's step request: each scheduled sequence's chunk of tokens, as the scheduler set it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from vllm_spec.core.scheduler import ScheduledSeq, SchedulerOutput
from vllm_spec.core.sequence import Sequence
from vllm_spec.engine.llm_engine import LLMEngine
from vllm_spec.sampling_params import SamplingParams
from vllm_spec.worker.batch import PLACEHOLDER_TOKEN


def _random_chunk(rng: random.Random) -> ScheduledSeq:
    """A sequence in any state the scheduler meets (prefill, chunked prefill, recompute after
    preemption, decode with or without a token in flight) and the chunk it feeds next."""
    seq = Sequence("r", 0, [rng.randrange(100) for _ in range(rng.randint(1, 6))], SamplingParams(), 64)
    seq.output_token_ids = [rng.randrange(100) for _ in range(rng.choice([0, 0, 1, 2, 5]))]
    seq.num_in_flight = rng.choice([0, 0, 1, 2])
    total = seq.num_tokens + seq.num_in_flight
    seq.num_computed_tokens = rng.choice([0, total - 1, rng.randrange(total)])
    n = rng.randint(1, total - seq.num_computed_tokens)
    return ScheduledSeq(seq, n, seq.num_computed_tokens + n == total)


@pytest.mark.parametrize("seed", range(5))
def test_chunk_tokens_are_the_sequences_own(seed):
    """Fed tokens are tokens[computed : computed + n] of prompt + output, placeholders for those in
    flight (Sequence.token_slice has a shortcut for tokens all in flight)."""
    rng = random.Random(seed)
    chunks = [_random_chunk(rng) for _ in range(300)]
    engine = SimpleNamespace(_released=[], _idle_time=0.0)
    req = LLMEngine._model_request(engine, SchedulerOutput(chunks))
    assert len(req.seqs) == len(chunks)
    for item, s in zip(chunks, req.seqs):
        start = item.seq.num_computed_tokens
        assert s.start_pos == start
        seq = item.seq
        every = seq.prompt_token_ids + seq.output_token_ids + [PLACEHOLDER_TOKEN] * seq.num_in_flight
        assert s.token_ids == every[start: start + item.num_new_tokens]
        assert s.sample == item.samples and (s.sampling_params is not None) == item.samples


@pytest.mark.parametrize("seed", range(3))
def test_columns_are_the_sequences_fields(seed):
    """ExecuteModelRequest.columns: what the worker reads per sequence, as arrays in the batch's order."""
    rng = random.Random(seed)
    chunks = [_random_chunk(rng) for _ in range(200)]
    engine = SimpleNamespace(_released=[], _idle_time=0.0)
    req = LLMEngine._model_request(engine, SchedulerOutput(chunks))
    cols = req.columns
    assert cols is req.columns   # computed once
    assert cols.seq_ids == [s.seq_id for s in req.seqs]
    assert cols.num_new.tolist() == [len(s.token_ids) for s in req.seqs]
    assert cols.start_pos.tolist() == [s.start_pos for s in req.seqs]
    assert cols.seq_len.tolist() == [s.seq_len for s in req.seqs]
    assert cols.sample.tolist() == [s.sample for s in req.seqs]
    rows = sorted(rng.sample(range(len(chunks)), 50))
    assert cols.ids_of(rows) == [req.seqs[i].seq_id for i in rows]
    assert cols.ids_of(list(range(len(chunks)))) is cols.seq_ids
    assert [s.seq_id for s in req.seqs_of(rows)] == cols.ids_of(rows)
    assert req.seqs_of(list(range(len(chunks)))) is req.seqs

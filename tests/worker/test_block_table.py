"""The block-table array kept across steps is, at every step, the array built from scratch.

It is kept keyed by each sequence's table list (the block manager only appends to a list; any
other change gives a new one): these tests change tables in every way the engine does (growth,
preemption and re-admission at the same length with other blocks, finish, abort, new arrivals,
reordering) and, end to end, check every array the engine's runners use.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import FIXED, GREEDY, make_prompts, output_ids

from vllm_spec import LLM, SamplingParams
from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.core.block_manager import BlockManager
from vllm_spec.core.sequence import Sequence
from vllm_spec.worker.batch import SeqInput
from vllm_spec.worker.block_table import BlockTableArray


def reference(seqs: list[SeqInput]) -> np.ndarray:
    width = max(len(s.block_table) for s in seqs)
    return np.array([s.block_table + [NULL_BLOCK] * (width - len(s.block_table)) for s in seqs], dtype=np.int64)


def inputs(seqs: list[Sequence]) -> list[SeqInput]:
    """A step's inputs, built anew each step as the engine does (sharing the sequences' lists)."""
    return [SeqInput(s.seq_id, [1], s.num_computed_tokens, s.block_table, True) for s in seqs]


def check(array: BlockTableArray, seqs: list[Sequence]) -> None:
    batch = inputs(seqs)
    np.testing.assert_array_equal(array(batch), reference(batch))


def three_checked_sequences() -> tuple[BlockManager, list[Sequence], BlockTableArray]:
    """Three sequences of two blocks each, and an array that has seen them once."""
    bm = BlockManager(num_blocks=16, block_size=4)
    seqs = [Sequence("r", i, [5] * 6, SamplingParams(), max_tokens=8) for i in range(3)]
    for s in seqs:
        bm.allocate(s, 6)
    array = BlockTableArray()
    check(array, seqs)
    return bm, seqs, array


def test_preempted_table_back_at_the_same_length_with_other_blocks():
    bm, seqs, array = three_checked_sequences()
    before = list(seqs[1].block_table)
    bm.free(seqs[1])            # preempted, then re-admitted: the same length, other blocks
    bm.allocate(seqs[1], 6)
    assert len(seqs[1].block_table) == len(before) and seqs[1].block_table != before
    check(array, seqs)


def test_finished_sequence_replaced_by_one_with_an_equally_long_table():
    bm, seqs, array = three_checked_sequences()
    bm.free(seqs[0])
    seqs[0] = Sequence("r", 3, [5] * 6, SamplingParams(), max_tokens=8)   # in the same row
    bm.allocate(seqs[0], 6)
    check(array, seqs)


@pytest.mark.parametrize("seed", range(20))
def test_random_steps_match_the_array_built_from_scratch(seed):
    """Decode steps with growth (lookahead slots too), preemption and re-admission, finish and abort,
    arrivals and reordering, in a block pool small enough that freed blocks are soon handed out again."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.choice([12, 40]), block_size=rng.choice([1, 2, 4]))
    running: list[Sequence] = []
    waiting: list[Sequence] = []
    array, updated = BlockTableArray(), 0
    for step in range(300):
        if rng.random() < 0.3 or not running:
            waiting.append(Sequence("r", step, [5] * rng.randint(1, 6), SamplingParams(), max_tokens=64))
        # Admit the waiting (new or preempted): allocate from scratch.
        for s in list(waiting):
            if bm.can_allocate(s, s.num_uncomputed_tokens):
                bm.allocate(s, s.num_uncomputed_tokens)
                s.num_computed_tokens = s.num_tokens
                waiting.remove(s)
                running.append(s)
        for s in list(running):
            r = rng.random()
            if r < 0.05:   # finished or aborted
                bm.free(s)
                running.remove(s)
            elif r < 0.12 or not bm.try_append_slots(s, 1, rng.choice([0, 0, 3])):   # preempted
                bm.free(s)
                s.num_computed_tokens = 0
                running.remove(s)
                waiting.insert(0, s)
            else:
                s.output_token_ids.append(7)
                s.num_computed_tokens += 1
        if rng.random() < 0.1:
            rng.shuffle(running)
        if running:
            kept = array._array
            check(array, running)
            updated += array._array is kept   # written in place (appended ids only), not rebuilt
    assert updated > 0


@pytest.mark.parametrize("engine", ["plain", "async", "draft-model", "ngram"])
def test_every_array_the_engine_uses_is_the_one_built_from_scratch(monkeypatch, spec_pair, engine):
    """Preemption by recompute (a small KV cache), chunked prefill, n > 1, aborts mid-flight and
    requests added again, in each engine: every array any runner or the draft loop uses is compared
    with the one built from scratch."""
    calls = []
    cached = BlockTableArray.__call__

    def checked(self, seqs):
        array = cached(self, seqs)
        np.testing.assert_array_equal(array, reference(seqs))
        calls.append(len(seqs))
        return array

    monkeypatch.setattr(BlockTableArray, "__call__", checked)
    spec = {"draft-model": dict(speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED),
            "ngram": dict(speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=2)}
    llm = LLM(spec_pair[0], block_size=4, num_gpu_blocks_override=41, max_model_len=128, max_num_batched_tokens=48,
              async_scheduling=engine == "async", **spec.get(engine, {}))
    eng = llm.llm_engine
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True, n=2)] * 8
    prompts = make_prompts(16)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", prompt, p)
    for step in range(200):
        if step == 12:   # abort a few mid-flight, and send them again
            eng.abort_request([f"r{i}" for i in range(0, 16, 3)])
            for i in range(0, 16, 3):
                eng.add_request(f"again{i}", prompts[i], params[i])
        if not eng.has_unfinished_requests() and not eng.has_step_in_flight:
            break
        eng.step()
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.num_preemptions > 0 and len(calls) > 20


def test_draft_loop_rows_of_the_shared_array(monkeypatch, spec_pair):
    """The draft's loop reads the verifying runner's array (one update per step serves both): where
    only some rows draft (here the rows past the draft's max_model_len), it gets exactly their
    tables, and the verification that follows finds the array up to date (no rebuild, no write)."""
    from vllm_spec.spec_decode.draft_model_proposer import DraftModelProposer

    seen = []
    inner = DraftModelProposer._propose_in_loop

    def checked(self, req, spec, num_drafts, lens, k):
        loop = self.loop

        def capture(tokens, first_pos, limits, tables, k, max_seq_len):
            expected = reference([req.seqs[i] for i in spec])
            np.testing.assert_array_equal(tables[:, : expected.shape[1]], expected)
            assert (tables[:, expected.shape[1]:] == NULL_BLOCK).all()
            seen.append((len(spec), len(req.seqs)))
            return loop(tokens, first_pos, limits, tables, k, max_seq_len)

        monkeypatch.setattr(self, "loop", capture)
        shared = self._block_tables
        out = inner(self, req, spec, num_drafts, lens, k)
        kept = shared._array
        shared(req.seqs)   # what the verification asks next
        assert shared._array is kept and np.array_equal(shared(req.seqs), reference(req.seqs))
        monkeypatch.setattr(self, "loop", loop)
        return out

    monkeypatch.setattr(DraftModelProposer, "_propose_in_loop", checked)
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, speculative_max_model_len=40,
              block_size=4, max_model_len=128, **FIXED)
    worker = llm.llm_engine.executor.worker
    assert worker.draft_proposer._block_tables is worker.target.runner.block_tables
    # Prompts of 4 to 33 tokens and 24 new ones: the longer rows stop drafting first.
    prompts = [{"prompt_token_ids": [3 + (7 * n + j) % 190 for j in range(n)]} for n in (4, 9, 14, 20, 26, 33)]
    plain = LLM(spec_pair[0], block_size=4, max_model_len=128).generate(prompts, GREEDY)
    assert output_ids(llm.generate(prompts, GREEDY)) == output_ids(plain)
    assert any(n < b for n, b in seen) and any(n == b for n, b in seen)

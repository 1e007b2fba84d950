"""BlockManager invariants under random allocate / append_slots / free / preempt sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.core.block_manager import BlockManager
from vllm_spec.core.sequence import Sequence
from vllm_spec.sampling_params import SamplingParams


def make_seq(prompt_len: int) -> Sequence:
    return Sequence("r", 0, list(range(prompt_len)), SamplingParams(), max_tokens=16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManagerMachine(RuleBasedStateMachine):
    """The model: each live sequence's table must cover the largest slot count ever asked for it."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm: BlockManager
        self.live: dict[int, Sequence] = {}
        self.covered: dict[int, int] = {}   # seq_id -> slots its table must cover
        self.freed_tables: list[list[int]] = []

    @initialize(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def init(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)

    @rule(target=seqs, prompt_len=st.integers(1, 40))
    def new_seq(self, prompt_len):
        seq = make_seq(prompt_len)
        self.live[seq.seq_id] = seq
        self.covered[seq.seq_id] = 0
        return seq

    def _grow(self, seq: Sequence, n: int, lookahead: int, first: bool) -> None:
        bm = self.bm
        n = max(1, min(n, seq.num_uncomputed_tokens))
        before_free, before_table = list(bm.free_blocks), list(seq.block_table)
        need = cdiv(seq.num_computed_tokens + n + lookahead, bm.block_size) - len(seq.block_table)
        can = bm.can_allocate(seq, n, lookahead) if first else bm.can_append_slots(seq, n, lookahead)
        assert can == (max(0, need) <= bm.num_free_blocks)
        try:
            if first:
                bm.allocate(seq, n, lookahead)
            else:
                bm.append_slots(seq, n, lookahead)
        except RuntimeError:
            # can_allocate said no, and a failed allocation changes nothing.
            assert not can
            assert list(bm.free_blocks) == before_free and seq.block_table == before_table
            return
        assert can, "allocation succeeded although can_allocate said it would not"
        self.covered[seq.seq_id] = max(self.covered[seq.seq_id], seq.num_computed_tokens + n + lookahead)
        assert seq.block_table[: len(before_table)] == before_table  # tables only grow at the end
        # The engine's step: the scheduled tokens now have K/V; a sampled token is appended.
        seq.num_computed_tokens += n
        if seq.num_uncomputed_tokens == 0:
            seq.output_token_ids.append(7)

    @rule(seq=seqs, n=st.integers(1, 40), lookahead=st.integers(0, 5))
    def allocate(self, seq, n, lookahead):
        if seq.seq_id not in self.live:
            return
        if seq.block_table:
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq, n, lookahead)
            return
        self._grow(seq, n, lookahead, first=True)

    @rule(seq=seqs, n=st.integers(1, 8), lookahead=st.integers(0, 5))
    def append_slots(self, seq, n, lookahead):
        if seq.seq_id not in self.live or not seq.block_table:
            return
        self._grow(seq, n, lookahead, first=False)

    @rule(seq=seqs)
    def preempt(self, seq):
        """Preemption by recompute: blocks go back, the sequence restarts from token 0."""
        if seq.seq_id not in self.live:
            return
        self.freed_tables.append(list(seq.block_table))
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.covered[seq.seq_id] = 0
        assert seq.block_table == []

    @rule(seq=consumes(seqs))
    def finish(self, seq):
        if seq.seq_id not in self.live:
            return
        self.freed_tables.append(list(seq.block_table))
        self.bm.free(seq)
        del self.live[seq.seq_id], self.covered[seq.seq_id]

    @rule(data=st.data())
    def double_free_raises(self, data):
        """Freeing a table whose blocks were already returned raises and changes nothing."""
        stale = [t for t in self.freed_tables if t]
        if not stale:
            return
        table = data.draw(st.sampled_from(stale))
        if any(self.bm.ref_counts[b] > 0 for b in table):
            return  # some blocks were handed out again since; not a double free of all of them
        before = (list(self.bm.free_blocks), list(self.bm.ref_counts))
        ghost = make_seq(1)
        ghost.block_table = list(table)
        with pytest.raises(RuntimeError, match="double free"):
            self.bm.free(ghost)
        assert (list(self.bm.free_blocks), list(self.bm.ref_counts)) == before

    @invariant()
    def consistent(self):
        bm = self.bm
        held = [b for s in self.live.values() for b in s.block_table]
        free = list(bm.free_blocks)
        # No block in two tables, none both held and free, none freed twice.
        assert len(held) == len(set(held))
        assert len(free) == len(set(free))
        assert not set(held) & set(free)
        # No leak: every usable block is either free or held.
        assert len(free) + len(held) == bm.num_usable_blocks == bm.num_blocks - 1
        assert bm.num_free_blocks == len(free)
        # The null block is never handed out nor on the free list.
        assert NULL_BLOCK not in held and NULL_BLOCK not in free
        assert all(0 < b < bm.num_blocks for b in held + free)
        # Ref counts: 1 for held blocks (no sharing here), 0 for free ones.
        assert all(bm.ref_counts[b] == 1 for b in held)
        assert all(bm.ref_counts[b] == 0 for b in free)
        assert bm.ref_counts[NULL_BLOCK] == 0
        # Tables are exactly as long as the slots they were asked to cover.
        for sid, seq in self.live.items():
            assert len(seq.block_table) == cdiv(self.covered[sid], bm.block_size)
        assert bm.usage == pytest.approx(len(held) / bm.num_usable_blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase


def test_null_block_reserved_and_all_others_usable():
    bm = BlockManager(5, 4)
    seq = make_seq(16)
    assert bm.can_allocate(seq, 16)
    bm.allocate(seq, 16)
    assert sorted(seq.block_table) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    other = make_seq(1)
    assert not bm.can_allocate(other, 1)
    with pytest.raises(RuntimeError):
        bm.allocate(other, 1)
    bm.free(seq)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0


def test_lookahead_slots_reserve_blocks():
    bm = BlockManager(10, 4)
    seq = make_seq(4)
    bm.allocate(seq, 4, num_lookahead=0)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    seq.output_token_ids.append(1)
    # 4 computed + 1 new + 4 lookahead = 9 slots = 3 blocks.
    assert bm.blocks_needed(seq, 1, 4) == 2
    bm.append_slots(seq, 1, num_lookahead=4)
    assert len(seq.block_table) == 3


def test_double_free_detected():
    bm = BlockManager(4, 2)
    seq = make_seq(4)
    bm.allocate(seq, 4)
    table = list(seq.block_table)
    bm.free(seq)
    ghost = make_seq(1)
    ghost.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(ghost)
    assert bm.num_free_blocks == 3


def test_too_few_blocks_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, 16)

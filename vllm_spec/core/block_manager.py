"""Paged KV-cache block allocation: a free list, ref counts, block tables per sequence.

Slots are reserved ahead of the tokens that fill them ("lookahead" slots for
draft tokens): a sequence's table always covers num_computed_tokens + the
tokens scheduled this step + the lookahead. Rejected draft positions simply
stay inside the table and are overwritten by the next step.
"""

from __future__ import annotations

from collections import deque

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.core.sequence import Sequence


class BlockManager:
    """Owns physical block ids 1..num_blocks-1 (block 0 is the shared null block)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> int:
        slots = seq.num_computed_tokens + num_new_tokens + num_lookahead
        return max(0, -(-slots // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens, num_lookahead) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> None:
        """Give a sequence without blocks enough of them for its first scheduled chunk."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        self.append_slots(seq, num_new_tokens, num_lookahead)

    can_append_slots = can_allocate

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1, num_lookahead: int = 0) -> None:
        """Grow the table to cover the scheduled tokens plus `num_lookahead` draft slots."""
        if not self.try_append_slots(seq, num_new_tokens, num_lookahead):
            need = self.blocks_needed(seq, num_new_tokens, num_lookahead)
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")

    def try_append_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """append_slots when the free blocks suffice (True), else change nothing (False): the
        scheduler's check and growth in one computation, for every sequence at every step."""
        if seq.num_computed_tokens + num_new_tokens + num_lookahead <= len(seq.block_table) * self.block_size:
            return True   # the table covers them already: most decode steps
        need = self.blocks_needed(seq, num_new_tokens, num_lookahead)
        if need > len(self.free_blocks):
            return False
        # Tables only ever grow by append here (worker/block_table.py keeps arrays on that).
        for _ in range(need):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of a sequence (finished, aborted or preempted)."""
        for block in reversed(seq.block_table):
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"double free of block {block} by sequence {seq.seq_id}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []   # a new list, never the old one cleared (worker/block_table.py)

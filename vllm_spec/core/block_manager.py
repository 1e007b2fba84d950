"""Paged KV-cache block allocation: a free list, ref counts, block tables per sequence.

Slots are reserved ahead of the tokens that fill them ("lookahead" slots for
draft tokens): a sequence's table always covers num_computed_tokens + the
tokens scheduled this step + the lookahead. Rejected draft positions simply
stay inside the table and are overwritten by the next step.

With prefix caching (vLLM's enable_prefix_caching) a full block of tokens (prompt or
output) is registered under a hash of its tokens and of every token before it once the
step computing it is launched (a later step, which is all that can read it, runs after it
on the device): prompt blocks when their step is launched, output blocks when a step is
read, up to num_computed_tokens (which already counts the steps launched since). A new
sequence starts from the longest run of registered blocks matching its prompt: it shares
them (ref counts) and computes only the rest. A freed block keeps
its contents and registration until the free list hands it out again (least recently
freed first; a sequence's tail blocks before its head).

A draft model's K/V shares the blocks: the draft is fed every prompt chunk in the step that
computes it, so a registered prompt block holds the draft's K/V as well; an output block may
not (the draft skips steps that do not speculate), and a sequence starting from one
recomputes the draft's K/V from the first such block on.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.core.sequence import Sequence
from vllm_spec.utils import concat_slice


class BlockManager:
    """Owns physical block ids 1..num_blocks-1 (block 0 is the shared null block)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # In the order they are handed out: an ordered set, as a cached block leaves it from anywhere.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(b for b in range(num_blocks)
                                                                        if b != NULL_BLOCK)
        self.ref_counts = [0] * num_blocks
        self.enable_caching = enable_caching
        self.cached: dict[bytes, int] = {}   # prefix hash -> the block holding that prefix's last block
        self.block_hash: dict[int, bytes] = {}
        self.draft_valid: set[int] = set()   # registered blocks that hold a draft model's K/V too
        # Prompt tokens looked up and found (vLLM's prefix_cache_queries / _hits counters).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

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

    def can_append_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens, num_lookahead) <= self.num_free_blocks

    # Admission ------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks holding the longest prefix of a waiting sequence's prompt ([]
        without caching). At least its last prompt token is left to compute (its logits give the
        first token); prompt logprobs need every prompt position computed, and a preempted
        sequence recomputes its own (a draft model's cache is rebuilt with it)."""
        if not self.enable_caching or seq.prompt_logprobs is not None or seq.num_preemptions:
            return []
        hits = []
        for key in self._prefix_hashes(seq, (seq.num_prompt_tokens - 1) // self.block_size):
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0,
                     cached: list[int] = ()) -> bool:
        """Whether a waiting sequence starting from `cached` blocks gets slots for its first chunk
        (cached blocks nobody holds come off the free list too)."""
        slots = len(cached) * self.block_size + num_new_tokens + num_lookahead
        reused = sum(1 for b in cached if self.ref_counts[b] == 0)
        return -(-slots // self.block_size) - len(cached) + reused <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0, cached: list[int] = ()) -> None:
        """Give a sequence without blocks its cached prefix (its tokens count as computed) and
        enough blocks for its first scheduled chunk."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if self.enable_caching and not seq.num_preemptions:
            self.num_queried_tokens += seq.num_prompt_tokens
            self.num_hit_tokens += len(cached) * self.block_size
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        if not seq.num_preemptions:   # as vLLM: what its first scheduling found (a recomputation finds none)
            seq.num_cached_tokens = seq.num_computed_tokens
        num_draft = next((i for i, b in enumerate(cached) if b not in self.draft_valid), len(cached))
        seq.num_draft_cached_tokens = num_draft * self.block_size
        self.append_slots(seq, num_new_tokens, num_lookahead)

    def register_computed(self, seq: Sequence) -> None:
        """Register the sequence's full blocks (prompt and output tokens) whose K/V the steps
        launched so far write: a later prompt that repeats them (a conversation's next turn) reads them."""
        if not self.enable_caching:
            return
        # (A sequence preempted while its last token was in flight finishes holding no blocks.)
        num_full = min(seq.num_computed_tokens // self.block_size, seq.num_tokens // self.block_size,
                       len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._prefix_hashes(seq, num_full)
        num_prompt_blocks = seq.num_prompt_tokens // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block, key = seq.block_table[i], hashes[i]
            if block not in self.block_hash and key not in self.cached:
                self.cached[key] = block
                self.block_hash[block] = key
                if i < num_prompt_blocks:
                    self.draft_valid.add(block)
        seq.num_registered_blocks = num_full

    def _prefix_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the sequence's first num_blocks blocks, each over its tokens and every one before
        (a strong hash: a collision would hand out another prompt's K/V)."""
        hashes = seq.block_hashes
        size, prompt, output = self.block_size, seq.prompt_token_ids, seq.output_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            h = hashlib.sha256(hashes[-1] if hashes else b"")
            h.update(array("q", concat_slice(prompt, output, i * size, (i + 1) * size)).tobytes())
            hashes.append(h.digest())
        return hashes[:num_blocks]

    def reset_prefix_cache(self) -> None:
        """Forget every registration (blocks in use keep their contents; new prompts start cold)."""
        self.cached.clear()
        self.block_hash.clear()
        self.draft_valid.clear()

    # Growth and release ------------------------------------------------------------------

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
            block = self.free_blocks.popitem(last=False)[0]
            if self.block_hash:   # a registered block handed out for new contents leaves the cache
                key = self.block_hash.pop(block, None)
                if key is not None and self.cached.get(key) == block:
                    del self.cached[key]
                self.draft_valid.discard(block)
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
                self.free_blocks[block] = None
        seq.block_table = []   # a new list, never the old one cleared (worker/block_table.py)
        seq.num_registered_blocks = 0

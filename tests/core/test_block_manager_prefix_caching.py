"""Prefix caching in the block manager: registration, lookup, sharing, eviction."""

from __future__ import annotations

import random

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.core.block_manager import BlockManager
from vllm_spec.core.sequence import Sequence
from vllm_spec.sampling_params import SamplingParams

BS = 4


def _seq(prompt: list[int]) -> Sequence:
    return Sequence("r", 0, list(prompt), SamplingParams(), 8)


def _admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit a waiting sequence as the scheduler does: its whole prompt in one chunk, then launched."""
    cached = bm.cached_prefix(seq)
    n = seq.num_prompt_tokens - len(cached) * BS
    assert bm.can_allocate(seq, n, 0, cached)
    bm.allocate(seq, n, 0, cached)
    seq.num_computed_tokens += n
    bm.register_computed(seq)
    return cached


def _check_free_list(bm: BlockManager) -> None:
    held = {b for b in range(bm.num_blocks) if bm.ref_counts[b] > 0}
    assert set(bm.free_blocks) | held == set(range(1, bm.num_blocks)) and not (set(bm.free_blocks) & held)
    assert NULL_BLOCK not in bm.free_blocks
    for key, block in bm.cached.items():
        assert bm.block_hash[block] == key


def test_a_shared_prefix_is_computed_once():
    bm = BlockManager(32, BS, enable_caching=True)
    system = list(range(10, 22))                     # 3 full blocks
    a, b = _seq(system + [1, 2, 3]), _seq(system + [7, 8])
    assert _admit(bm, a) == []
    assert len(bm.cached) == 3                        # full prompt blocks only: [1, 2, 3] fills none
    hits = _admit(bm, b)
    assert hits == a.block_table[:3]
    assert b.num_computed_tokens == b.num_prompt_tokens and b.num_cached_tokens == 12
    assert all(bm.ref_counts[x] == 2 for x in hits)
    assert b.block_table[3] != a.block_table[3]       # the rest is its own
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (15 + 14, 12)
    _check_free_list(bm)


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(32, BS, enable_caching=True)
    _admit(bm, _seq(list(range(8))))                  # exactly 2 blocks
    same = _seq(list(range(8)))
    assert _admit(bm, same) == [bm.cached[k] for k in same.block_hashes[:1]]
    assert same.num_cached_tokens == 4                # not 8: its last token's logits give its first token


def test_freed_blocks_stay_cached_until_handed_out_again():
    bm = BlockManager(6, BS, enable_caching=True)   # 5 usable blocks
    a = _seq(list(range(12)) + [99])
    _admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 5 and len(bm.cached) == 3
    b = _seq(list(range(12)) + [98])
    hits = _admit(bm, b)
    assert len(hits) == 3 and bm.num_free_blocks == 1
    bm.free(b)
    # A different prompt takes every block: the registered ones leave the cache as they are reused.
    c = _seq([50 + i for i in range(19)])
    assert _admit(bm, c) == []
    assert len(c.block_table) == 5 and bm.cached.keys() <= set(c.block_hashes)
    assert bm.cached_prefix(_seq(list(range(12)) + [97])) == []
    _check_free_list(bm)


def test_different_tokens_before_a_block_miss():
    bm = BlockManager(32, BS, enable_caching=True)
    _admit(bm, _seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first one: the hash covers every token before it.
    assert _admit(bm, _seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_prompt_logprobs_and_preempted_sequences_do_not_use_the_cache():
    bm = BlockManager(32, BS, enable_caching=True)
    _admit(bm, _seq(list(range(9))))
    wants_logprobs = _seq(list(range(9)))
    wants_logprobs.prompt_logprobs = [None] * 9
    assert bm.cached_prefix(wants_logprobs) == []
    preempted = _seq(list(range(9)))
    preempted.num_preemptions = 1
    assert bm.cached_prefix(preempted) == []


def test_caching_off_and_reset():
    off = BlockManager(32, BS)
    _admit(off, _seq(list(range(9))))
    assert _admit(off, _seq(list(range(9)))) == [] and not off.cached
    on = BlockManager(32, BS, enable_caching=True)
    _admit(on, _seq(list(range(9))))
    on.reset_prefix_cache()
    assert _admit(on, _seq(list(range(9)))) == []


def test_can_allocate_counts_cached_blocks_nobody_holds():
    bm = BlockManager(5, BS, enable_caching=True)    # 4 usable blocks
    a = _seq(list(range(8)) + [1])
    _admit(bm, a)                                     # 3 blocks, 2 registered
    bm.free(a)
    b = _seq(list(range(8)) + [2, 3, 4, 5, 6, 7, 8, 9])   # hits 2 (free, so they come off the list), needs 2 more
    cached = bm.cached_prefix(b)
    assert len(cached) == 2
    assert bm.can_allocate(b, 8, 0, cached)
    assert not bm.can_allocate(b, 8, 5, cached)      # 2 + 4 blocks > 4


def test_random_admissions_and_frees_keep_the_books():
    rng = random.Random(0)
    bm = BlockManager(40, BS, enable_caching=True)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    live: list[Sequence] = []
    for _ in range(400):
        if live and (rng.random() < 0.45 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            seq = _seq(rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 9))])
            cached = bm.cached_prefix(seq)
            n = seq.num_prompt_tokens - len(cached) * BS
            if bm.can_allocate(seq, n, 0, cached):
                bm.allocate(seq, n, 0, cached)
                seq.num_computed_tokens += n
                bm.register_computed(seq)
                live.append(seq)
        _check_free_list(bm)
        counts = [0] * bm.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        assert counts == bm.ref_counts
    assert bm.num_hit_tokens > 0

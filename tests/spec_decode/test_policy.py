"""The static speculation policies (fixed k, a batch-size table) and when verification is padded."""

from __future__ import annotations

import pytest

from vllm_spec.spec_decode.policy import BatchSizeTablePolicy, FixedPolicy, StepShape, pads_verification


def test_fixed_policy_respects_caps():
    assert FixedPolicy(4).choose(StepShape([1, 2, 3], [4, 2, 0], 0)) == [4, 2, 0]


@pytest.mark.parametrize("seqs, k, real, padded", [(16, 8, 16, True), (17, 4, 17 * 5, True),
                                                  (64, 4, 64 * 2 + 64, True), (64, 4, 64 + 64, False)])
def test_pads_verification(seqs, k, real, padded):
    assert pads_verification(seqs, k, real, graphs=True) is padded
    assert pads_verification(seqs, k, real, graphs=False) is False   # ragged where no graph replays


@pytest.mark.parametrize("seqs, k, ragged_tokens, padded", [(8, 4, 32, False), (8, 4, 40, True), (64, 4, 320, True),
                                                           (64, 4, 256, False), (16, 8, 48, False), (100, 4, 512, False),
                                                           (100, 4, 640, True)])
def test_a_ragged_graph_pads_only_what_it_would_run_anyway(seqs, k, ragged_tokens, padded):
    # Padded where its graph (the batch-size bucket's rows) runs no more tokens than the ragged graph
    # (small batches included).
    assert pads_verification(seqs, k, seqs + 1, graphs=True, ragged_tokens=ragged_tokens) is padded


TABLE = [(4, 4), (16, 3), (64, 2), (128, 1)]


@pytest.mark.parametrize("batch, k", [(1, 4), (4, 4), (5, 3), (16, 3), (17, 2), (64, 2), (65, 1), (128, 1),
                                      (129, 0), (256, 0)])
def test_batch_size_table_picks_the_smallest_bound(batch, k):
    policy = BatchSizeTablePolicy(list(reversed(TABLE)))  # order of the pairs does not matter
    assert policy.choose(StepShape(list(range(batch)), [8] * batch, 0)) == [k] * batch


def test_batch_size_table_respects_caps_and_empty_steps():
    policy = BatchSizeTablePolicy(TABLE)
    assert policy.choose(StepShape([1, 2, 3], [4, 2, 0], 5)) == [4, 2, 0]
    assert policy.choose(StepShape([], [], 7)) == []


@pytest.mark.parametrize("table", [[], [(0, 2)], [(4, -1)], [(4, 2), (4, 1)]])
def test_batch_size_table_rejects_bad_tables(table):
    with pytest.raises(ValueError, match="table"):
        BatchSizeTablePolicy(table)


@pytest.mark.parametrize("batch, k", [(1, 3), (2, 3), (3, 3), (4, 3), (5, 2), (8, 2), (9, 0), (16, 0), (17, 0),
                                      (500, 0)])
def test_vllm_batch_size_schedule(batch, k):
    """vLLM's num_speculative_tokens_per_batch_size: [first, last, k] ranges; a size between two ranges
    takes the earlier range's k, one past the last range the last's; k capped at num_speculative_tokens."""
    policy = BatchSizeTablePolicy.from_schedule([(1, 2, 5), (5, 8, 2), (9, 16, 0)], max_k=3)
    assert policy.choose(StepShape(list(range(batch)), [8] * batch, 0)) == [k] * batch
    last = BatchSizeTablePolicy.from_schedule([(1, 4, 2)], max_k=4)
    assert last.choose(StepShape(list(range(300)), [8] * 300, 0)) == [2] * 300


def test_a_schedule_up_to_any_batch_size():
    policy = BatchSizeTablePolicy.from_schedule([(1, 1 << 31, 2)], max_k=4)
    assert policy.k_for_batch(1) == policy.k_for_batch(1 << 31) == policy.k_for_batch((1 << 31) + 5) == 2

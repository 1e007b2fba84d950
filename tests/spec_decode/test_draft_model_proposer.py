"""The draft-model proposer's pieces that need no model: how a long feed is cut into forwards."""

from __future__ import annotations

import pytest

from vllm_spec.spec_decode.draft_model_proposer import _pieces
from vllm_spec.worker.batch import SeqInput


@pytest.mark.parametrize("max_tokens", [1, 3, 7, 64])
def test_pieces_cut_a_feed_in_order_within_the_budget(max_tokens):
    feed = [SeqInput(sid, list(range(100 * sid + start, 100 * sid + start + n)), start, [sid], sample=False)
            for sid, start, n in [(1, 0, 10), (2, 5, 3), (3, 40, 1), (4, 7, 12)]]
    pieces = list(_pieces(feed, max_tokens))
    assert all(0 < sum(len(s.token_ids) for s in piece) <= max_tokens for piece in pieces)
    for s in feed:   # each sequence's parts, in order, are its feed: token i sits at position start + i
        parts = [p for piece in pieces for p in piece if p.seq_id == s.seq_id]
        assert [t for p in parts for t in p.token_ids] == s.token_ids
        assert [p.start_pos for p in parts] == [s.start_pos + sum(len(q.token_ids) for q in parts[:i])
                                                for i in range(len(parts))]
        assert all(p.block_table == s.block_table and not p.sample for p in parts)
    assert list(_pieces([], max_tokens)) == []

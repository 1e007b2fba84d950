"""The torch attention backend (CPU path, and the GPU kernels' oracle) against a per-sequence loop,
on both of its branches: short queries (decode, verification) and long ones (prefill)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from vllm_spec.attention import torch_backend
from vllm_spec.attention.metadata import AttentionMetadata, compute_slot_mapping


def _case(q_lens, seq_lens, H, KVH, D, block_size, dtype, seed):
    """Random caches on shuffled block tables; q [T, H, D]; the metadata."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    ids = list(range(1, 1 + sum(need) + 3))
    rng.shuffle(ids)
    width = max(need) + 1
    tables = []
    for n in need:
        tables.append(ids[:n] + [0] * (width - n))
        ids = ids[n:]
    num_blocks = 1 + sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, KVH, D).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, KVH, D).to(dtype)
    q = torch.randn(sum(q_lens), H, D).to(dtype)
    B = len(q_lens)
    q_lens_t = torch.tensor(q_lens)
    qsl = torch.zeros(B + 1, dtype=torch.long)
    qsl[1:] = torch.cumsum(q_lens_t, 0)
    bt = torch.tensor(tables)
    positions = torch.tensor([p for b in range(B) for p in range(seq_lens[b] - q_lens[b], seq_lens[b])])
    req = torch.repeat_interleave(torch.arange(B), q_lens_t)
    md = AttentionMetadata(qsl, torch.tensor(seq_lens), bt, compute_slot_mapping(bt, req, positions, block_size),
                           max(q_lens), max(seq_lens), block_size)
    return q, k_cache, v_cache, tables, md


def _loop(q, k_cache, v_cache, tables, q_lens, seq_lens, scale, softcap=None):
    """Float64, one sequence and one head at a time (scores soft-capped where softcap is given)."""
    out, start = [], 0
    group = q.shape[1] // k_cache.shape[2]
    bs = k_cache.shape[1]
    for table, ql, sl in zip(tables, q_lens, seq_lens):
        slots = [table[p // bs] * bs + p % bs for p in range(sl)]
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
        for i in range(ql):
            pos = sl - ql + i
            heads = []
            for h in range(q.shape[1]):
                s = (k[: pos + 1, h // group] @ q[start + i, h].double()) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                heads.append(s.softmax(0) @ v[: pos + 1, h // group])
            out.append(torch.stack(heads))
        start += ql
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_lens, seq_lens", [
    ([1, 1, 1], [5, 17, 40]),                  # decode
    ([5, 5, 3], [9, 30, 3]),                   # verification of drafts (ragged)
    ([20, 1, 4], [20, 33, 50]),                # a prefill chunk among decodes: the long-query branch
])
def test_matches_a_per_sequence_loop(q_lens, seq_lens, dtype, tol):
    H, KVH, D, scale = 6, 2, 16, 0.25
    q, k_cache, v_cache, tables, md = _case(q_lens, seq_lens, H, KVH, D, 4, dtype, seed=sum(seq_lens))
    out = torch_backend.paged_attention(q, k_cache, v_cache, md, scale)
    ref = _loop(q, k_cache, v_cache, tables, q_lens, seq_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.double() - ref).abs().max() / ref.abs().max() < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_lens, seq_lens", [([1, 1, 1], [5, 17, 40]), ([5, 5, 3], [9, 30, 3]),
                                              ([20, 1, 4], [20, 33, 50])])
def test_soft_cap_matches_a_per_sequence_loop(q_lens, seq_lens, dtype, tol):
    """Gemma 2's soft cap on every branch (the long-query one leaves SDPA for it), small enough to change every
    score: without it the output is far off."""
    H, KVH, D, scale, cap = 6, 2, 16, 0.25, 0.5
    q, k_cache, v_cache, tables, md = _case(q_lens, seq_lens, H, KVH, D, 4, dtype, seed=7 + sum(seq_lens))
    out = torch_backend.paged_attention(q, k_cache, v_cache, md, scale, None, cap)
    ref = _loop(q, k_cache, v_cache, tables, q_lens, seq_lens, scale, cap)
    assert (out.double() - ref).abs().max() / ref.abs().max() < tol
    uncapped = _loop(q, k_cache, v_cache, tables, q_lens, seq_lens, scale)
    assert (uncapped - ref).abs().max() / ref.abs().max() > 10 * tol


def test_short_and_long_query_branches_agree():
    """The same rows computed through either branch (SHORT_QUERY moved) give the same result."""
    q, k_cache, v_cache, _, md = _case([3, 2], [12, 7], 4, 2, 8, 4, torch.float32, seed=1)
    short = torch_backend.paged_attention(q, k_cache, v_cache, md, 0.3)
    saved = torch_backend.SHORT_QUERY
    try:
        torch_backend.SHORT_QUERY = 0
        md.__dict__.pop("_torch_layouts", None)
        long = torch_backend.paged_attention(q, k_cache, v_cache, md, 0.3)
    finally:
        torch_backend.SHORT_QUERY = saved
    torch.testing.assert_close(short, long, rtol=1e-5, atol=1e-6)

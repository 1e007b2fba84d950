"""The CPU attention kernel (csrc/cpu/paged_attention.cpp through attention/cpu_backend.py): against a
float64 loop and the torch backend, a token's output the same bits in any batch or query block, its
checks, and where it is chosen."""

from __future__ import annotations

import pytest
import torch

from vllm_spec import cpu_ops
from vllm_spec.attention import cpu_backend, torch_backend
from vllm_spec.attention.layer import select_backend

from .test_torch_backend import _case, _loop

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no AVX2 CPU kernels here (or not buildable)")


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H, KVH, D, block_size", [(6, 2, 16, 4), (9, 3, 64, 16), (4, 4, 24, 1), (8, 1, 128, 4),
                                                   (10, 2, 72, 4)])   # (24, 72: tails of d past 8 and 64 lanes)
@pytest.mark.parametrize("q_lens, seq_lens", [
    ([1, 1, 1], [5, 17, 40]),                  # decode
    ([5, 5, 3], [9, 30, 3]),                   # verification of drafts (ragged)
    ([2, 1, 16, 0], [70, 1, 16, 9]),           # catch-up, a first token, a 16-token block, a sequence without queries
    ([40, 1, 17], [40, 33, 50]),               # prompt chunks (tiles of 16 tokens and their tails) beside a decode
])
def test_matches_a_per_sequence_loop(q_lens, seq_lens, H, KVH, D, block_size, dtype, tol):
    q, k_cache, v_cache, tables, md = _case(q_lens, seq_lens, H, KVH, D, block_size, dtype, seed=sum(seq_lens) + D)
    assert cpu_backend.handles(q, k_cache, v_cache)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3)
    ref = _loop(q, k_cache, v_cache, tables, q_lens, seq_lens, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.double() - ref).abs().max() / ref.abs().max() < tol


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [3, 8, 21, 50])   # (50: past every sequence)
def test_sliding_window_as_the_torch_backend(window, dtype, tol):
    q, k_cache, v_cache, _, md = _case([1, 5, 3, 37], [40, 33, 9, 60], 6, 2, 16, 4, dtype, seed=window)
    ours = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3, window)
    theirs = torch_backend.paged_attention(q.double(), k_cache.double(), v_cache.double(), md, 0.3, window)
    assert (ours.double() - theirs).abs().max() / theirs.abs().max() < tol


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_lens, seq_lens", [([1, 1, 1], [5, 17, 40]), ([5, 5, 3], [9, 30, 3]),
                                              ([40, 1, 17], [40, 33, 50])])
def test_soft_cap_matches_a_per_sequence_loop(q_lens, seq_lens, dtype, tol):
    q, k_cache, v_cache, tables, md = _case(q_lens, seq_lens, 9, 3, 64, 16, dtype, seed=3 + sum(seq_lens))
    out = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3, None, 0.8)
    ref = _loop(q, k_cache, v_cache, tables, q_lens, seq_lens, 0.3, 0.8)
    assert (out.double() - ref).abs().max() / ref.abs().max() < tol


@needs_kernel
@pytest.mark.parametrize("window", [3, 21])
def test_soft_cap_in_a_window_as_the_torch_backend(window):
    q, k_cache, v_cache, _, md = _case([1, 5, 3, 37], [40, 33, 9, 60], 6, 2, 16, 4, torch.float32, seed=window)
    ours = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3, window, 0.6)
    theirs = torch_backend.paged_attention(q.double(), k_cache.double(), v_cache.double(), md, 0.3, window, 0.6)
    assert (ours.double() - theirs).abs().max() / theirs.abs().max() < 1e-5


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 11])
def test_a_token_gets_the_same_bits_in_any_block(dtype, window):
    """A draft verified in a (k+1)-token block gets exactly what a 1-token step gives it (and what the same
    token gets next to other sequences): lossless speculation in bfloat16 as in float32."""
    q, k_cache, v_cache, tables, md = _case([7, 3], [60, 21], 9, 3, 64, 4, dtype, seed=5)
    block = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.125, window)
    for i in range(7):   # the first sequence's tokens one at a time, each with its own length
        _, _, _, _, one = _case([1], [60 - 6 + i], 9, 3, 64, 4, dtype, seed=5)
        one.block_tables = md.block_tables[:1].contiguous()
        alone = cpu_backend.paged_attention(q[i:i + 1].contiguous(), k_cache, v_cache, one, 0.125, window)
        assert torch.equal(alone, block[i:i + 1]), i


@needs_kernel
def test_a_block_table_outside_the_cache_is_an_error():
    q, k_cache, v_cache, _, md = _case([1], [9], 4, 2, 8, 4, torch.float32, seed=0)
    md.block_tables = md.block_tables.clone()
    md.block_tables[0, 1] = k_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3)
    md.seq_lens = torch.tensor([md.block_tables.shape[1] * 4 + 1])   # longer than its table
    with pytest.raises(RuntimeError, match="block table of"):
        cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3)
    q, k_cache, v_cache, _, md = _case([1], [9], 4, 2, 8, 4, torch.float32, seed=0)
    md.query_start_loc = torch.tensor([-3, 1])   # (its rows would sit before the output)
    with pytest.raises(RuntimeError, match="from 0"):
        cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 11, 40])
def test_a_prompt_token_gets_the_same_bits_in_any_chunking(dtype, window):
    """A prompt's tokens get the same bits whether the prompt runs whole, in chunks of any size (a token budget
    that speculation shares, a prefix-cache hit's tail) or one token at a time; so do the decode rows beside
    a chunk. (torch's SDPA took chunks past SHORT_QUERY tokens and rounded differently: bf16 ties broke.)"""
    T, ctx = 45, 70
    q, k_cache, v_cache, _, md = _case([T, 1], [ctx, 30], 9, 3, 64, 4, dtype, seed=4)
    whole = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.125, window)
    ref = torch_backend.paged_attention(q.double(), k_cache.double(), v_cache.double(), md, 0.125, window)
    assert (whole.double() - ref).abs().max() / ref.abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    for size in (1, 3, 16, 17, 33):
        for start in range(0, T, size):
            stop = min(start + size, T)
            _, _, _, _, part = _case([stop - start], [ctx - T + stop], 9, 3, 64, 4, dtype, seed=4)
            part.block_tables = md.block_tables[:1].contiguous()
            alone = cpu_backend.paged_attention(q[start:stop].contiguous(), k_cache, v_cache, part, 0.125, window)
            assert torch.equal(alone, whole[start:stop]), (size, start)
    _, _, _, _, decode = _case([1], [30], 9, 3, 64, 4, dtype, seed=4)
    decode.block_tables = md.block_tables[1:].contiguous()
    assert torch.equal(cpu_backend.paged_attention(q[T:].contiguous(), k_cache, v_cache, decode, 0.125, window),
                       whole[T:])


@needs_kernel
def test_nan_stays_in_its_row():
    q, k_cache, v_cache, _, md = _case([1, 3], [9, 12], 4, 2, 8, 4, torch.float32, seed=3)
    q[1, 0, 0] = float("nan")   # the second sequence's first query, head 0 (KV head 0)
    out = cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3)
    assert out[1, 0].isnan().all()
    assert not out[0].isnan().any() and not out[2:].isnan().any() and not out[1, 1:].isnan().any()


def test_other_dtypes_take_the_torch_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(torch_backend, "paged_attention", lambda *a, **k: calls.append(a) or "torch")
    q, k_cache, v_cache, _, md = _case([1], [9], 4, 2, 8, 4, torch.float16, seed=2)
    assert not cpu_backend.handles(q, k_cache, v_cache)
    assert cpu_backend.paged_attention(q, k_cache, v_cache, md, 0.3) == "torch" and len(calls) == 1


def test_chosen_on_the_cpu_where_built(monkeypatch):
    for built in (True, False):
        monkeypatch.setattr(cpu_ops, "available", lambda built=built: built)
        for dtype in (torch.float32, torch.bfloat16):
            expected = cpu_backend if built else torch_backend
            assert select_backend(torch.device("cpu"), 64, dtype) is expected
        assert select_backend(torch.device("cpu"), 64, torch.float16) is torch_backend

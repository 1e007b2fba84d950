"""Triton paged attention and KV-cache writes against the torch reference backend (the oracle).

Every case draws fresh random inputs; outputs are poisoned with NaN before the kernel runs and cache
slots the kernel must not read (outside every sequence's [0, seq_len), the null block included) hold
NaN, so a missed row or a stray read fails. The reference runs in float32 on the same (rounded) inputs.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from conftest import rel_err

from vllm_spec.attention import torch_backend
from vllm_spec.attention.metadata import AttentionMetadata, compute_slot_mapping

DEVICE = os.environ.get("VLLM_SPEC_TRITON_TEST_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1 to debug
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 2e-3}

pytestmark = pytest.mark.gpu


def _tb():
    from vllm_spec.attention import triton_backend
    return triton_backend


def make_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
              table_dtype=torch.long, spare_blocks=7):
    """Random paged caches with non-contiguous block tables; returns (q, clean caches, poisoned caches, md)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B = len(q_lens)
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + spare_blocks
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    width = max(need + [1]) + rng.randint(0, 2)
    tables, used = [], torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b in range(B):
        blocks, ids = ids[:need[b]], ids[need[b]:]
        tables.append(blocks + [0] * (width - len(blocks)))
        for pos in range(seq_lens[b]):
            used[blocks[pos // block_size] * block_size + pos % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    unused = (~used).to(DEVICE)
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    k_bad.view(-1, num_kv_heads, head_dim)[unused] = float("nan")
    v_bad.view(-1, num_kv_heads, head_dim)[unused] = float("nan")
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, device=DEVICE).to(dtype)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long, device=DEVICE)
    qsl = torch.zeros(B + 1, dtype=torch.long, device=DEVICE)
    qsl[1:] = torch.cumsum(q_lens_t, 0)
    bt = torch.tensor(tables, dtype=table_dtype, device=DEVICE)
    positions = torch.tensor([p for b in range(B) for p in range(seq_lens[b] - q_lens[b], seq_lens[b])],
                             dtype=torch.long, device=DEVICE)
    req = torch.repeat_interleave(torch.arange(B, device=DEVICE), q_lens_t, output_size=T)
    md = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=DEVICE),
        block_tables=bt, slot_mapping=compute_slot_mapping(bt.long(), req, positions, block_size),
        max_query_len=max(q_lens + [0]), max_seq_len=max(seq_lens + [0]), block_size=block_size)
    return q, (k_cache, v_cache), (k_bad, v_bad), md


def reference(q, caches, md, scale, window, softcap=None):
    return torch_backend.paged_attention(q.float(), caches[0].float(), caches[1].float(), md, scale, window, softcap)


def check(q_lens, seq_lens, H, KVH, D, bs, dtype, seed, window=None, num_splits=None, softcap=None, **kw):
    q, clean, bad, md = make_case(q_lens, seq_lens, H, KVH, D, bs, dtype, seed, **kw)
    scale = D ** -0.5
    ref = reference(q, clean, md, scale, window, softcap)
    out = torch.full_like(q, float("nan"))
    _tb().paged_attention_out(q, bad[0], bad[1], md, scale, window, out, num_splits=num_splits, softcap=softcap)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"
    if num_splits is None:  # the public entry point (allocates its own output) agrees
        assert rel_err(_tb().paged_attention(q, bad[0], bad[1], md, scale, window, softcap), ref) < TOL[dtype]
    if softcap is not None:   # (a cap that changes the result: the test would see it dropped)
        assert rel_err(reference(q, clean, md, scale, window), ref) > 10 * TOL[dtype]
    return err


def _rand_lens(rng, n, lo, hi):
    return [rng.randint(lo, hi) for _ in range(n)]


DECODE = [  # (batch, heads, kv heads, head_dim, block_size, dtype)
    (1, 32, 8, 128, 16, torch.bfloat16),
    (7, 32, 8, 128, 32, torch.bfloat16),
    (64, 32, 8, 128, 16, torch.bfloat16),
    (7, 8, 8, 64, 16, torch.bfloat16),
    (64, 16, 2, 64, 32, torch.float16),
    (1, 16, 16, 128, 32, torch.float32),
    (7, 32, 4, 128, 16, torch.float32),
    (64, 28, 4, 128, 16, torch.bfloat16),    # GQA 7:1 (padded group)
    (7, 12, 2, 64, 16, torch.bfloat16),      # GQA 6:1
    (7, 16, 4, 80, 16, torch.bfloat16),      # head sizes padded to a power of two
    (64, 8, 2, 96, 32, torch.float16),
    (5, 4, 2, 24, 16, torch.float32),
    (3, 8, 8, 8, 16, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,KVH,D,bs,dtype", DECODE)
def test_decode(B, H, KVH, D, bs, dtype):
    for rep in range(2):
        rng = random.Random(1000 * B + H + rep)
        seq_lens = _rand_lens(rng, B, 1, 2000)
        check([1] * B, seq_lens, H, KVH, D, bs, dtype, seed=rng.randint(0, 1 << 30))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("H,KVH,D,bs,dtype", [(32, 8, 128, 16, torch.bfloat16), (8, 8, 64, 32, torch.bfloat16),
                                              (32, 4, 64, 16, torch.float32), (16, 2, 128, 32, torch.float16),
                                              (16, 4, 80, 16, torch.bfloat16)])
def test_verification_mixed(k, H, KVH, D, bs, dtype):
    """k+1 query tokens for speculating rows, 1 for rows with no draft, plus padded rows."""
    rng = random.Random(k * 7919 + H * 31 + D)
    q_lens = [rng.choice([k + 1, k + 1, 1]) for _ in range(13)]
    seq_lens = [rng.randint(q, 1500) for q in q_lens]
    q_lens += [0, 0]           # padded rows at the end (CUDA-graph buckets): no tokens, no keys
    seq_lens += [0, 0]
    check(q_lens, seq_lens, H, KVH, D, bs, dtype, seed=rng.randint(0, 1 << 30))


@pytest.mark.gpu
@pytest.mark.parametrize("H,KVH,D,bs,dtype", [(32, 8, 128, 16, torch.bfloat16), (8, 8, 128, 32, torch.bfloat16),
                                              (32, 4, 64, 16, torch.float16), (16, 2, 64, 32, torch.float32),
                                              (32, 32, 64, 16, torch.bfloat16), (8, 2, 96, 16, torch.bfloat16)])
def test_prefill_chunks(H, KVH, D, bs, dtype):
    """Prefill chunks (some from position 0, some continuing a prior context) mixed with decode rows."""
    rng = random.Random(H * 131 + KVH * 17 + D + bs)
    q_lens = [rng.randint(1, 300) for _ in range(3)] + [300, 1, 17]
    starts = [0, rng.randint(1, 700), rng.randint(1, 700), rng.randint(1, 200), rng.randint(0, 1000), 0]
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    check(q_lens, seq_lens, H, KVH, D, bs, dtype, seed=rng.randint(0, 1 << 30))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 37, 64, 300])
@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
def test_sliding_window(window, kind):
    rng = random.Random(window * 3 + len(kind))
    if kind == "decode":
        q_lens = [1] * 9
    elif kind == "verify":
        q_lens = [rng.choice([1, 5, 9]) for _ in range(9)]
    else:
        q_lens = [rng.randint(1, 300) for _ in range(4)]
    seq_lens = [rng.randint(q, q + 1200) for q in q_lens]
    check(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, seed=rng.randint(0, 1 << 30), window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])   # (256: Gemma's head size)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
def test_soft_cap(kind, window, num_splits, D):
    """Gemma 2's soft cap (scores = cap * tanh(scores / cap)) on every query kind, windowed or not, split or not."""
    rng = random.Random(len(kind) * 7 + (window or 0) + (num_splits or 0) + D)
    q_lens = {"decode": [1] * 9, "verify": [rng.choice([1, 5, 9]) for _ in range(9)],
              "prefill": [rng.randint(1, 200) for _ in range(4)]}[kind]
    seq_lens = [rng.randint(q, q + 700) for q in q_lens]
    check(q_lens, seq_lens, 16, 8, D, 16, torch.bfloat16, seed=rng.randint(0, 1 << 30), window=window,
          num_splits=num_splits if kind != "prefill" else None, softcap=0.7)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 3, 7, 16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("D", [128, 80])   # (80: the combine kernel's masked columns)
def test_forced_splits(num_splits, window, D):
    """The split-KV path (normally chosen for small batches) with any split count, empty splits included."""
    rng = random.Random(num_splits * 11 + (window or 0) + D)
    q_lens = [rng.choice([1, 5]) for _ in range(10)] + [0]
    seq_lens = [rng.randint(q, 900) for q in q_lens[:-1]] + [0]
    seq_lens[0] = q_lens[0]  # a sequence with fewer keys than splits
    check(q_lens, seq_lens, 32, 8, D, 16, torch.bfloat16, seed=rng.randint(0, 1 << 30), window=window,
          num_splits=num_splits)


@pytest.mark.gpu
def test_padding_rows_and_int32_tables():
    """Zero-length rows in the middle, q_len 0 rows with a context, int32 block tables."""
    q_lens = [3, 0, 1, 0, 5, 1, 0]
    seq_lens = [40, 0, 600, 77, 5, 1, 0]
    check(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, seed=5, table_dtype=torch.int32)
    check(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, seed=6, table_dtype=torch.int32, num_splits=4)


@pytest.mark.gpu
@pytest.mark.parametrize("KVH,D,bs,src_dtype,cache_dtype", [
    (8, 128, 16, torch.bfloat16, torch.bfloat16), (2, 64, 32, torch.float32, torch.float32),
    (3, 64, 16, torch.float32, torch.bfloat16), (1, 128, 32, torch.float16, torch.float16),
    (2, 80, 16, torch.bfloat16, torch.bfloat16), (4, 24, 16, torch.float32, torch.float32)])
def test_write_kv_cache(KVH, D, bs, src_dtype, cache_dtype):
    torch.manual_seed(KVH * D + bs)
    num_blocks, T = 50, 123
    H = 4 * KVH
    slots = torch.randperm(num_blocks * bs, device=DEVICE)[:T]
    # k/v as strided views of a fused qkv projection, as the model produces them
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=DEVICE).to(src_dtype)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    k_cache = torch.full((num_blocks, bs, KVH, D), float("nan"), dtype=cache_dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    _tb().write_kv_cache(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, KVH, D), v_cache.view(-1, KVH, D)
    assert torch.equal(flat_k[slots], k.to(cache_dtype)) and torch.equal(flat_v[slots], v.to(cache_dtype))
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("B", [4, 64])
def test_cuda_graph_replay(B):
    """Capture a decode batch once; change lengths, block tables and q in place; replay matches the oracle."""
    tb = _tb()
    H, KVH, D, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    max_len, num_blocks = 2048, 1 + 2 * B * 2048 // 16
    width = max_len // bs
    dev = DEVICE
    k_cache = torch.randn(num_blocks, bs, KVH, D, device=dev).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q_buf = torch.zeros(B, H, D, device=dev, dtype=dtype)
    md = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, device=dev), seq_lens=torch.ones(B, dtype=torch.long, device=dev),
        block_tables=torch.zeros(B, width, dtype=torch.long, device=dev),
        slot_mapping=torch.zeros(B, dtype=torch.long, device=dev),
        max_query_len=1, max_seq_len=max_len, block_size=bs)
    scale = D ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tb.paged_attention(q_buf, k_cache, v_cache, md, scale)   # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tb.paged_attention(q_buf, k_cache, v_cache, md, scale)
    rng = random.Random(B)
    for rep in range(3):
        seq_lens = [rng.randint(1, max_len) for _ in range(B)]
        perm = torch.randperm(num_blocks - 1, device=dev) + 1
        tables = torch.zeros(B, width, dtype=torch.long, device=dev)
        cursor = 0
        for b, s in enumerate(seq_lens):
            n = math.ceil(s / bs)
            tables[b, :n] = perm[cursor:cursor + n]
            cursor += n
        md.seq_lens.copy_(torch.tensor(seq_lens, device=dev))
        md.block_tables.copy_(tables)
        q_buf.copy_(torch.randn(B, H, D, device=dev).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_md = AttentionMetadata(md.query_start_loc.clone(), md.seq_lens.clone(), tables, md.slot_mapping,
                                   1, max(seq_lens), bs)
        ref = reference(q_buf, (k_cache, v_cache), ref_md, scale, None)
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"replay {rep}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="backend selection on CUDA")
def test_layer_selects_triton_on_cuda():
    from vllm_spec.attention.layer import Attention
    H, KVH, D, bs = 8, 2, 64, 16
    layer = Attention(H, KVH, D, D ** -0.5)
    q_lens, seq_lens = [4, 1, 9], [30, 50, 9]
    q, clean, _, md = make_case(q_lens, seq_lens, H, KVH, D, bs, torch.bfloat16, seed=3)
    layer.k_cache, layer.v_cache = clean[0].clone(), clean[1].clone()
    k = torch.randn(q.shape[0], KVH, D, device=DEVICE).to(torch.bfloat16)
    v = torch.randn_like(k)
    assert layer.backend_for(q) is _tb()
    out = layer(q, k, v, md)
    ref_k, ref_v = clean[0].clone(), clean[1].clone()
    torch_backend.write_kv_cache(k, v, ref_k, ref_v, md.slot_mapping)
    assert torch.equal(layer.k_cache, ref_k) and torch.equal(layer.v_cache, ref_v)
    assert rel_err(out, reference(q, (ref_k, ref_v), md, D ** -0.5, None)) < 1e-2


def _compiled(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


@pytest.mark.parametrize("H, KVH, D", [(32, 8, 128), (12, 12, 64), (14, 2, 64)])
def test_warm_up_compiles_every_variant_serving_needs(H, KVH, D):
    tb = _tb()
    dtype = torch.bfloat16
    cache = torch.zeros((64, 16, KVH, D), dtype=dtype, device=DEVICE)
    tb.warm_up(H, cache, cache, D ** -0.5, None, dtype)
    before = _compiled(tb._paged_attn_kernel) + _compiled(tb._combine_kernel)
    rng = random.Random(0)
    for seed in range(12):   # decode, verification, catch-up and prefill shapes, long and short contexts
        B = rng.choice([1, 3, 16, 64])
        q_lens = [rng.choice([1, 2, 3, 5, 9, 40, 200]) for _ in range(B)]
        seq_lens = [q + rng.choice([0, 7, 300, 900]) for q in q_lens]
        q, clean, _, md = make_case(q_lens, seq_lens, H, KVH, D, 16, dtype, seed)
        tb.paged_attention(q, *clean, md, D ** -0.5)
    assert _compiled(tb._paged_attn_kernel) + _compiled(tb._combine_kernel) == before

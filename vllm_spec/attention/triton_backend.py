"""Triton attention over the paged KV cache: the GPU fast path of `torch_backend` (same functions, same meaning).

* `write_kv_cache`: one program per new token stores all its KV heads at its slot.
* `paged_attention`: ONE kernel for every query length (prefill chunks, decode, draft catch-up,
  verification with k+1 tokens). A program owns (sequence, kv head, query tile) and packs all
  query heads of that kv head into the M dimension of its matrix products: rows are
  (query token in tile) x (head in the GQA group), so decode with GQA 4:1 already gives 4 rows
  and a 5-token verification 20. It streams the sequence's keys through its block table with an
  online softmax (fp32 accumulation), causal inside the query block, optional sliding window.
  When a batch has too few programs to fill the GPU (small decode/verification batches) the keys
  of each program are split across several programs, each writing an unnormalised partial result
  that a small combine kernel merges (flash-decoding).

Any head size: the kernels' tiles use the next power of two (at least 16) and mask the rest.

CUDA-graph safe: the grid and every specialisation come from host ints only (num_seqs, max_query_len,
max_seq_len, shapes); lengths, starts and block tables are read inside the kernels. A sequence with
q_len 0 writes nothing; one with no keys (seq_len 0) writes zeros, never NaN.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_spec.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------------------------

@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch,
                     stride_vcb, stride_vcs, stride_vch,
                     KVH: tl.constexpr, KVH_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slots (if a caller ever uses them for padding) are skipped
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, KVH_P)
        d = tl.arange(0, D_P)
        if D_P != D:
            mask = (h < KVH)[:, None] & (d < D)[None, :]
        else:
            mask = (h < KVH)[:, None]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :],
                 k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :],
                 v.to(vc_ptr.dtype.element_ty), mask=mask)


def _padded_head_dim(d: int) -> int:
    """The head size the kernels' tiles use: a power of two, at least 16 (tl.dot's least K); the
    columns past d are masked (head sizes like 80 or 96, or a tiny model's 8)."""
    assert d >= 1, f"head_dim must be positive, got {d}"
    return max(16, triton.next_power_of_2(d))


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, KVH, D]) at their slots of the [blocks, block_size, KVH, D] caches."""
    T, kvh, d = k.shape
    assert k_cache.shape[2:] == (kvh, d) and v_cache.shape == k_cache.shape
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KVH=kvh, KVH_P=triton.next_power_of_2(kvh), D=d, D_P=_padded_head_dim(d), BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if kvh * d >= 1024 else 2,
    )


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    """tanh from one exp2 (exp(-2|x|)): no overflow at any |x|, float32 rounding (absolute error ~1e-7)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# Arguments that vary from step to step are not specialised on (Triton otherwise compiles a
# new variant when one happens to be 1 or a multiple of 16: a stall in the middle of serving).
@triton.jit(do_not_specialize=["stride_bt", "window", "num_splits"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    qk_scale, cap, window, num_splits,
    KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    H: tl.constexpr = KVH * GROUP
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // KVH
    kvh = pid_bh % KVH

    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    tok0 = tile * BLOCK_Q
    if tok0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        ctx = seq_len - q_len                     # position of the first query token
        rows = tl.arange(0, BLOCK_M)
        tok = tok0 + rows // GROUP_P              # query token (inside the sequence's block) of each row
        g = rows % GROUP_P
        row_valid = (tok < q_len) & (g < GROUP)
        qpos = ctx + tok
        head = kvh * GROUP + g
        tok_glob = (q_start + tok).to(tl.int64)
        d = tl.arange(0, D_P)
        # Rows (query token, head) and, for a padded head size only, columns: a mask that varies
        # along d would keep the loads of a power-of-two head from being vectorised.
        if D_P != D:
            row_mask = row_valid[:, None] & (d < D)[None, :]
        else:
            row_mask = row_valid[:, None]
        q = tl.load(q_ptr + tok_glob[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_mask, other=0.0)

        # keys this tile can see: [lo, hi)
        hi = ctx + tl.minimum(tok0 + BLOCK_Q, q_len)
        if USE_WINDOW:
            lo = tl.maximum(ctx + tok0 - window + 1, 0)
        else:
            lo = 0
        if SPLIT:
            chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
            lo = lo + split * chunk
            hi = tl.minimum(hi, lo + chunk)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_P], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        for start in range(lo, hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            kmask = kpos < hi
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
            in_blk = (kpos % BLOCK_SIZE).to(tl.int64)
            k_off = blk * stride_kb + in_blk * stride_ks
            if D_P != D:
                k_mask = kmask[None, :] & (d < D)[:, None]
                v_mask = kmask[:, None] & (d < D)[None, :]
            else:
                k_mask = kmask[None, :]
                v_mask = kmask[:, None]
            k = tl.load(k_head + k_off[None, :] + d[:, None], mask=k_mask, other=0.0)  # [D_P, BLOCK_N]
            s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * qk_scale
            if SOFTCAP:   # qk_scale is scale / softcap and cap softcap * log2(e)
                s = _tanh(s) * cap
            valid = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
            if USE_WINDOW:
                valid = valid & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = blk * stride_vb + in_blk * stride_vs
            v = tl.load(v_head + v_off[:, None] + d[None, :], mask=v_mask, other=0.0)  # [BLOCK_N, D_P]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            m_i = m_new

        if SPLIT:
            idx = (tok_glob * H + head) * num_splits + split
            tl.store(part_acc_ptr + idx[:, None] * D + d[None, :], acc, mask=row_mask)
            tl.store(part_ml_ptr + idx * 2, m_i, mask=row_valid)
            tl.store(part_ml_ptr + idx * 2 + 1, l_i, mask=row_valid)
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + tok_glob[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                    H: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, SPLITS_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    smask = sp < num_splits
    base = (t * H + h) * num_splits
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=smask, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    d = tl.arange(0, D_P)
    acc_ptrs = part_acc_ptr + (base + sp)[:, None] * D + d[None, :]
    out_ptrs = out_ptr + t * stride_ot + h * stride_oh + d
    if D_P != D:   # (a padded head size only: see the attention kernel)
        acc = tl.load(acc_ptrs, mask=smask[:, None] & (d < D)[None, :], other=0.0)
    else:
        acc = tl.load(acc_ptrs, mask=smask[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = (num / tl.where(den > 0, den, 1.0)).to(out_ptr.dtype.element_ty)
    if D_P != D:
        tl.store(out_ptrs, out, mask=d < D)
    else:
        tl.store(out_ptrs, out)


@functools.lru_cache(maxsize=None)
def _num_sms_cuda(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    # CPU only under TRITON_INTERPRET=1 (debugging): pretend an H100/H200-sized GPU.
    return _num_sms_cuda(device.index or 0) if device.type == "cuda" else 132


# Launch configurations (tests/benchmarks may override entries of this dict).
CONFIG = {
    # small query tiles (decode, draft steps, verification): memory bound
    "small_block_n": 128, "small_warps": 4, "small_stages": 3,
    # big query tiles (prefill chunks): rows per tile, keys per step
    "big_block_m": 128, "big_block_n": 64, "big_warps": 8, "big_stages": 2,
    # split the keys of a program when the grid has fewer programs than this many SMs' worth
    "split_min_keys": 256, "max_splits": 32,
}


def _plan(num_seqs: int, kvh: int, group: int, d: int, max_query_len: int, max_seq_len: int,
          num_sms: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_Q, GROUP_P, BLOCK_N, num_splits, num_warps, num_stages) from host ints only."""
    gp = triton.next_power_of_2(group)
    mq = max(1, max_query_len)
    if mq * gp <= 64:   # decode / verification: one tile covers all of a sequence's queries
        block_q = max(triton.next_power_of_2(mq), triton.cdiv(16, gp))
        block_n, warps, stages = CONFIG["small_block_n"], CONFIG["small_warps"], CONFIG["small_stages"]
        small = True
    else:               # prefill: about 128 rows (tokens x heads) per tile
        block_q = max(1, CONFIG["big_block_m"] // gp)
        block_n, warps, stages = CONFIG["big_block_n"], CONFIG["big_warps"], CONFIG["big_stages"]
        small = False
    splits = 1
    programs = num_seqs * kvh * triton.cdiv(mq, block_q)
    if small and programs < num_sms and max_seq_len >= 2 * CONFIG["split_min_keys"]:
        want = triton.cdiv(2 * num_sms, programs)
        cap = max(1, max_seq_len // CONFIG["split_min_keys"])
        splits = min(triton.next_power_of_2(want), CONFIG["max_splits"], triton.next_power_of_2(cap))
    return block_q, gp, block_n, max(1, splits), warps, stages


def paged_attention_out(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                        scale: float, sliding_window: int | None, out: torch.Tensor,
                        num_splits: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """`paged_attention` into a caller-given out [T, H, D] (rows of real tokens only are written)."""
    T, H, D = q.shape
    kvh = k_cache.shape[2]
    assert H % kvh == 0, f"{H} query heads over {kvh} kv heads"
    assert k_cache.shape[3] == D and v_cache.shape == k_cache.shape and out.shape == q.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    B = md.num_seqs
    if T == 0 or B == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = H // kvh
    block_q, gp, block_n, splits, warps, stages = _plan(
        B, kvh, group, D, md.max_query_len, md.max_seq_len, _num_sms(q.device))
    if num_splits is not None:
        splits = num_splits
    q_tiles = triton.cdiv(max(1, md.max_query_len), block_q)
    use_window = sliding_window is not None and sliding_window > 0
    if splits > 1:
        part_acc = torch.empty((T, H, splits, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((T, H, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    bt = md.block_tables
    _paged_attn_kernel[(B * kvh, q_tiles, splits)](
        q, k_cache, v_cache, out, part_acc, part_ml,
        md.query_start_loc, md.seq_lens, bt,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0),
        scale / softcap if softcap else scale * _LOG2E, softcap * _LOG2E if softcap else 0.0,
        int(sliding_window) if use_window else 0, splits,
        KVH=kvh, GROUP=group, GROUP_P=gp, BLOCK_Q=block_q, D=D, D_P=_padded_head_dim(D), BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], USE_WINDOW=use_window, SOFTCAP=bool(softcap), SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _combine_kernel[(T, H)](part_acc, part_ml, out, out.stride(0), out.stride(1), splits,
                                H=H, D=D, D_P=_padded_head_dim(D), SPLITS_P=triton.next_power_of_2(splits),
                                num_warps=2)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D], attending to keys already written into the cache."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return paged_attention_out(q, k_cache, v_cache, md, scale, sliding_window, out, softcap=softcap)


def warm_up(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
            sliding_window: int | None, dtype: torch.dtype, softcap: float | None = None) -> None:
    """Compile now every attention variant a step can ask for, instead of in the middle of serving.

    Variants differ by query tile (from the longest query of a batch: decode, verification,
    a draft catching up after idle steps, prefill chunks) and by key splitting; a first-time
    compile takes around a second, a hundred decode steps of a large model.
    """
    kvh, D, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    dev = k_cache.device
    seen = set()
    for mq in (1, 2, 3, 5, 9, 17, 33, 65, 129):
        block_q, gp, block_n, _, warps, stages = _plan(1, kvh, num_heads // kvh, D, mq, mq, _num_sms(dev))
        split_options = (1, 2, 4, 8, 16, CONFIG["max_splits"]) if mq * gp <= 64 else (1,)
        for splits in split_options:
            key = (block_q, block_n, warps, stages, triton.next_power_of_2(splits) if splits > 1 else 1)
            if key in seen:
                continue
            seen.add(key)
            blocks = triton.cdiv(mq, block_size)
            md = AttentionMetadata(
                query_start_loc=torch.tensor([0, mq], device=dev), seq_lens=torch.tensor([mq], device=dev),
                block_tables=torch.zeros((1, blocks), dtype=torch.long, device=dev),   # the null block
                slot_mapping=torch.zeros(mq, dtype=torch.long, device=dev),
                max_query_len=mq, max_seq_len=mq, block_size=block_size)
            q = torch.zeros((mq, num_heads, D), dtype=dtype, device=dev)
            paged_attention_out(q, k_cache, v_cache, md, scale, sliding_window, torch.empty_like(q), splits, softcap)

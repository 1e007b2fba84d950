"""Attention over the paged KV cache on x86-64 CPUs: every query block (decode, verification of drafts,
the draft's catch-up, prompt chunks) on the C++ kernel of csrc/cpu/paged_attention.cpp, where it is built;
else torch_backend (same functions, same meaning).

torch_backend gathers each sequence's keys into a padded copy and runs a dozen small ops per layer; the
kernel reads the cache through the block table, once per KV head for the query heads sharing it. It
computes every query row alone, so a token's output does not depend on the rest of its batch or query
block: a verified draft gets the bits a 1-token step gives it, and a prompt token the bits of any other
chunking of its prompt (a token budget that speculation shares, a prefix-cache hit), in bfloat16 too.
(torch's SDPA for long chunks rounded differently from the kernel: greedy ties broke either way.)
"""

from __future__ import annotations

import torch

from vllm_spec import cpu_ops
from vllm_spec.attention import torch_backend
from vllm_spec.attention.metadata import AttentionMetadata

write_kv_cache = torch_backend.write_kv_cache


def handles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """A float32/bfloat16 model's queries and caches on the CPU, where the extension is built."""
    return (q.device.type == "cpu" and q.dtype in cpu_ops.DTYPES and k_cache.dtype == q.dtype
            and v_cache.dtype == q.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
            and cpu_ops.available())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D], attending to keys already written into the cache."""
    if not handles(q, k_cache, v_cache):
        return torch_backend.paged_attention(q, k_cache, v_cache, md, scale, sliding_window, softcap)
    meta = [cpu_ops.contiguous_as(t, torch.long) for t in (md.block_tables, md.seq_lens, md.query_start_loc)]
    out = cpu_ops.module().paged_attention(cpu_ops.contiguous_as(q, torch.float32), k_cache, v_cache, *meta, scale,
                                           sliding_window or 0, softcap or 0.0)
    return out if q.dtype == torch.float32 else out.to(q.dtype)

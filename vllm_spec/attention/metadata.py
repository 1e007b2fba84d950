"""The one attention metadata type, and the one place that maps positions to KV slots.

The same metadata drives prefill, chunked prefill, plain decode (query length 1),
draft steps and verification (query length k+1): each sequence contributes a
contiguous block of query tokens that sit at the END of its sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Block 0 of every KV cache is never handed to a sequence: padded tokens write
# their K/V there, so kernels never need a "skip this slot" branch.
NULL_BLOCK = 0


def compute_slot_mapping(block_tables: torch.Tensor | np.ndarray, req_indices: torch.Tensor | np.ndarray,
                         positions: torch.Tensor | np.ndarray, block_size: int) -> torch.Tensor | np.ndarray:
    """KV-cache slot of each token: its block from the sequence's table, then the offset.
    Device tensors, or host numpy arrays (a step's inputs: no per-operation torch dispatch)."""
    blocks = block_tables[req_indices, positions // block_size]
    return blocks * block_size + positions % block_size


@dataclass
class AttentionMetadata:
    """Batch layout for one forward pass over a paged KV cache.

    query_start_loc: [B+1] cumulative query lengths (tokens of sequence b are
        query_start_loc[b]:query_start_loc[b+1] of the flat batch).
    seq_lens: [B] total length of each sequence after this pass's tokens.
    block_tables: [B, max_blocks] physical block ids (NULL_BLOCK past the end).
    slot_mapping: [num_tokens] where each new token's K/V is written.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

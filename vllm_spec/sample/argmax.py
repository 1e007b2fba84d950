"""Row-wise argmax over the vocabulary, the greedy token of every row.

torch's argmax reduces a row in one thread block: over a 128k vocabulary at small
batch that is tens of microseconds, a sizeable part of a draft step. On CUDA the
rows are split into chunks reduced in parallel (first maximum of each chunk),
then the first chunk holding the row's maximum wins: the same index as
torch.argmax, ties included (the first maximal index). On x86-64 CPUs with AVX2,
float32 rows go to a C++ kernel (csrc/cpu/argmax.cpp, 8 columns per compare; torch's
CPU reduction took 0.5-1 ms for 16 rows of 49152), with torch's answer too.
"""

from __future__ import annotations

import torch

from vllm_spec import cpu_ops
from vllm_spec.platform import import_triton

triton, tl = import_triton()

_CHUNK = 2048
# From about one row per SM torch's reduction fills the device by itself, and one launch costs the
# host less than the chunked version's five (tens of microseconds each on a slow host).
_MANY_ROWS = 128


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along the last dim of a 2-D tensor (long [N])."""
    N, V = x.shape
    if x.device.type == "cpu" and x.dtype == torch.float32 and V > 0 and x.stride(-1) == 1 and cpu_ops.available():
        return cpu_ops.module().argmax_rows(x)   # (torch's CPU reduction reads a float at a time)
    if triton is None or not x.is_cuda or V < 4 * _CHUNK or N == 0 or N >= _MANY_ROWS or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    chunks = triton.cdiv(V, _CHUNK)
    best = torch.empty((N, chunks), dtype=torch.float32, device=x.device)
    where = torch.empty((N, chunks), dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(N, chunks)](x, best, where, V, x.stride(0), chunks, BLOCK=_CHUNK, num_warps=8)
    return where.gather(1, best.argmax(dim=-1, keepdim=True)).squeeze(1)


if triton is not None:
    @triton.jit(do_not_specialize=["stride_row"])
    def _chunk_argmax_kernel(x_ptr, best_ptr, where_ptr, V, stride_row, chunks, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(best_ptr + row * chunks + chunk, value)
        tl.store(where_ptr + row * chunks + chunk, chunk * BLOCK + index)

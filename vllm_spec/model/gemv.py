"""Matmuls of one to MAX_ROWS rows (y = x W^T for a few tokens) as Triton GEMVs, with the decoder's elementwise ops fused in.

A batch-1 decode step reads every weight once and multiplies it by one row, so its
time is the weights' bytes over memory bandwidth plus whatever else runs between
the matmuls. cuBLAS splits such products over K and reduces in a second kernel,
and the RMSNorm before q/k/v and gate/up and the SiLU·mul before down are kernels
of their own: ~5 small kernels per layer that each cost a launch slot in the graph.
Here a program owns BLOCK_N output rows over the whole K (no split, no reduce) and
may compute its input on the fly: the normed row (each program recomputes the
row's sum of squares: K elements from L2) or silu(gate)·up, for weights up to
FUSE_MAX_NUMEL. The inputs are rounded exactly as the unfused ops round them, so
only the summation order differs.

Verifying k drafts at batch 1 multiplies k + 1 rows by every weight: still one pass
over the weights, so 2..MAX_ROWS rows take a kernel that reads each weight tile once
and multiplies it by all rows on the tensor cores (padded to a 16- or 32-row tile:
CUDA cores multiplying every weight by 5-8 rows fell well behind the memory; past 32
rows cuBLAS is faster; up to LT_MAX_ROWS, cuBLASLt for the MLP's down projection:
lt_bias). The norm stays unfused there; the MLP's gate/up product takes SiLU·mul in its
epilogue (gate_up_silu) up to GATE_UP_MAX_ROWS: silu(gate) * up is written, never gate
and up, so the separate SiLU·mul kernel and its pass over [rows, 2I] are gone.

Used for float16/bfloat16 rows on CUDA; everything else (CPU, float32, more than
MAX_ROWS rows) takes the unfused ops, which are also the reference in tests/gpu.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_spec.model import fused, gemv_kernels as kernels
from vllm_spec.platform import import_triton

triton, _ = import_triton()

# Tests turn this off to compute the unfused reference on the same device.
ENABLED = True
# Fusing the norm or SiLU·mul makes every program recompute its input: that pays on small weights
# (a kernel saved is a large part of their time), not on large ones, which stream slower with it.
FUSE_MAX_NUMEL = 8 << 20

# 2..MAX_ROWS rows are padded to one tensor-core tile of 16 or 32 rows (module doc): up to 16 stream about as
# fast as one row; 20 rows in a 32-row tile beat cuBLAS by 5% over an 8B layer and 7% on its LM head; 80 rows
# lost to it over a layer by 15% even as tiles of 64 + 16 rows (146 vs 127 µs), though not on the LM head.
MAX_ROWS = 32
_ROWS_TILE = 16
LT_MAX_ROWS = 96   # lt_bias
GATE_UP_MIN_ROWS, GATE_UP_MAX_ROWS = 2, 96   # gate_up_silu (one row: the GEMV, then SiLU·mul)

_PLAIN, _NORM, _SILU = 0, 1, 2


def _kernel_rows(x: torch.Tensor, weight: torch.Tensor, least: int, most: int) -> bool:
    """least..most half-precision rows on CUDA, row-contiguous, against a weight of their dtype."""
    return (ENABLED and triton is not None and x.is_cuda and x.dim() == 2 and least <= x.shape[0] <= most
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and x.stride(-1) == 1)


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x W^T runs here: 1..MAX_ROWS half-precision rows on CUDA."""
    return _kernel_rows(x, weight, 1, MAX_ROWS)


def gate_up_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether silu(x G^T) * (x U^T) for weight = [G; U] runs here as one kernel (gate_up_silu): a few
    half-precision rows on CUDA and a large weight (a 68M draft's made too few programs: its steps
    slowed)."""
    return (_kernel_rows(x, weight, GATE_UP_MIN_ROWS, GATE_UP_MAX_ROWS) and weight.numel() > FUSE_MAX_NUMEL
            and weight.shape[0] % 2 == 0)


def fusable(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the elementwise op before this matmul (and the residual add before a norm) is worth
    computing inside it (see module doc): one row and a small weight."""
    return (eligible(x, weight) and x.shape[0] == 1 and weight.numel() <= FUSE_MAX_NUMEL
            and (residual is None or residual.stride(-1) == 1))


def _blocks(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from a sweep on an H200 (benchmarks/bench_gemv.py --sweep): tiles
    of 2048 weights over 4 warps, BLOCK_K the power of two in 128..1024 that leaves the smallest masked
    tail (a tail cost up to 25%), the largest on ties; rows of 8192+ weights stream best 16 at a time
    over 8 warps."""
    if k >= 8192 and k % 1024 == 0:
        return 16, 1024, 8
    block_k = _block_k(k, (1024, 512, 256, 128))
    return 2048 // block_k, block_k, 4


def _block_k(k: int, sizes: tuple[int, ...]) -> int:
    """The size (largest first) that leaves the smallest masked tail of K."""
    return min(sizes, key=lambda b: -k % b)


def _check_shapes(x: torch.Tensor, width: int, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    # The kernels would read past x or the bias (read as contiguous, as a Parameter is): fail like
    # F.linear does.
    if x.shape[1] != width or (bias is not None and (bias.shape != weight.shape[:1] or bias.stride(0) != 1)):
        got = "no bias" if bias is None else f"bias of shape {tuple(bias.shape)}, strides {bias.stride()}"
        raise ValueError(f"gemv: input of shape {tuple(x.shape)} ({got}) for a weight of shape "
                         f"{tuple(weight.shape)}: needs width {width} and a contiguous bias of {weight.shape[0]}")


def _launch(mode: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = weight.shape
    _check_shapes(x, 2 * k if mode == _SILU else k, weight, bias)   # [gate | up] for SiLU·mul
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"gemv: residual of shape {tuple(residual.shape)} for an input of shape {tuple(x.shape)}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(1, k, dtype=x.dtype, device=x.device) if residual is not None else None
    block_n, block_k, warps = _blocks(n, k)
    kernels.gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        weight, bias if bias is not None else x, y, res_out if res_out is not None else y,
        n, k, weight.stride(0), eps,
        MODE=mode, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps)
    return y, res_out


def _rows_tile(m: int) -> int:
    """The tensor-core tile (power of two, at least _ROWS_TILE) that holds m rows."""
    return max(_ROWS_TILE, triton.next_power_of_2(m))


class RowsBlocks(NamedTuple):
    """Launch config of the several-rows kernel: row tiles block_m (+ block_m2, 0 for none), weight rows
    per program, BLOCK_K, warps, pipeline stages, and whether the weight takes the tile's M side."""
    block_m: int
    block_m2: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    swap: bool = False


def _rows_blocks(m: int, n: int, k: int) -> RowsBlocks:
    """The several-rows kernel's config, from sweeps on an H200 (8B shapes; bench_gemv.py --rows-sweep):
    64 weight rows a program where that leaves enough programs (N >= 6144), the weight on the tile's M
    side (swap) for those, and 128 rows for LM heads; small N keeps 16 (32 for a 32-row tile) a program."""
    block_m = _rows_tile(m)
    if n > 65536:
        return RowsBlocks(block_m, 0, 128, 128, 4, 3, swap=block_m <= 16)
    if n > 16384:
        return RowsBlocks(block_m, 0, 64, 128, 4, 4, swap=True)
    block_k = _block_k(k, (256, 128, 64))
    if block_m > 16 or n >= 6144:
        return RowsBlocks(block_m, 0, 64, block_k, 4, 4, swap=True)
    return RowsBlocks(block_m, 0, 16, block_k, 2, 4)


def _row_tiles(m: int) -> tuple[int, int]:
    """(block_m, block_m2): one tile up to 32 rows, else the largest power of two below m plus a tile
    for the rest (80 rows as 64 + 16, not 128)."""
    one = _rows_tile(m)
    if m <= 32 or one == m:
        return one, 0
    first = 1 << (m.bit_length() - 1)
    return first, _rows_tile(m - first)


def _gate_up_blocks(m: int, n: int, k: int) -> RowsBlocks:
    """gate_up_silu's config (n: the output width, half the weight's rows), from bench_gemv.py
    --gate-up-sweep on an H200 (8B gate/up): 64 columns a program (64 rows of gate and 64 of up),
    BLOCK_K 128 over 3 stages up to 32 rows, 64 over 4 past them (80 rows: 64.3 µs; 32 columns a
    program took 152.8)."""
    block_m, block_m2 = _row_tiles(m)
    if block_m + block_m2 <= 32:
        return RowsBlocks(block_m, block_m2, 64, _block_k(k, (128, 64)), 4, 3, swap=True)
    return RowsBlocks(block_m, block_m2, 64, 64, 4, 4, swap=True)


# (N, dtype, device) -> zeros: the bias that sends a deep weight's product to cuBLASLt (lt_bias).
_ZERO_BIAS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def lt_bias(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """A zero bias for x W^T at MAX_ROWS + 1..LT_MAX_ROWS half-precision rows on CUDA of a weight deeper
    than it is wide (K > N), else None. Only row-parallel linears ask (the MLP's down projection, whole or
    split in two): column-parallel shards can be deep too (q/k/v at tp 4), and were not measured.
    torch runs a product with a bias through cuBLASLt's bias epilogue, whose kernel choice splits K for
    these and plain cuBLAS's does not: on an H200, 8B down (4096 x 14336) at 40-96 rows took 31.6-33.3
    µs against 34.1-38.2 (floor 27.6): plain decoding at batch 64 -2.8% a step, verifying 5 tokens at
    batch 16 -2%. At 128 rows it lost; at 256 it won alone but a whole batch-256 step was 0.2% slower;
    wide weights gained nothing steadily. The zeros are made outside graph capture (warm-up runs
    first), so a capture never records their fill."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2
            and MAX_ROWS < x.shape[0] <= LT_MAX_ROWS and weight.shape[1] > weight.shape[0]):
        return None
    key = (weight.shape[0], x.dtype, x.device)
    if key not in _ZERO_BIAS:
        if torch.cuda.is_current_stream_capturing():
            return None
        _ZERO_BIAS[key] = torch.zeros(weight.shape[0], dtype=x.dtype, device=x.device)
    return _ZERO_BIAS[key]


# (blocks, N, K) of weights whose several-rows blocks did not fit the device (shared memory: GPUs with
# ~100 KB per SM hold fewer pipeline stages than an H200); their products go to cuBLAS.
_ROWS_UNFIT: set[tuple[RowsBlocks, int, int]] = set()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for `eligible` rows."""
    if x.shape[0] == 1:
        return _launch(_PLAIN, x, weight, bias)[0]
    (m, k), n = x.shape, weight.shape[0]
    _check_shapes(x, weight.shape[1], weight, bias)
    blocks = _rows_blocks(m, n, k)
    if (blocks, n, k) not in _ROWS_UNFIT:
        try:
            return rows_linear(x, weight, bias, blocks)
        except triton.runtime.errors.OutOfResources:
            # Raised at the first launch (eager warm-up, before any graph capture): never launched since.
            _ROWS_UNFIT.add((blocks, n, k))
    return torch.nn.functional.linear(x, weight, bias)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                blocks: RowsBlocks) -> torch.Tensor:
    """x W^T (+ b) by the several-rows kernel with the given `_rows_blocks` (benchmark sweeps pass their own)."""
    return _launch_rows(kernels.rows_kernel, x, weight, bias, weight.shape[0], blocks)


def _launch_rows(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int,
                 blocks: RowsBlocks) -> torch.Tensor:
    """y [M, n] by a several-rows kernel (kernels.rows_kernel, kernels.rows_silu_kernel) in the given config."""
    m, k = x.shape
    if m > blocks.block_m + blocks.block_m2:
        raise ValueError(f"gemv: {m} rows do not fit tiles of {blocks.block_m} + {blocks.block_m2}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, blocks.block_n),)](
        x, weight, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=blocks.block_m, BLOCK_M2=blocks.block_m2, BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k, EVEN_K=k % blocks.block_k == 0, SWAP=blocks.swap, num_warps=blocks.warps,
        num_stages=blocks.stages)
    return y


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 blocks: RowsBlocks | None = None) -> torch.Tensor:
    """silu(gate) * up for [gate | up] = x W^T (+ b), W = [G; U] (the MLP's merged gate/up weight),
    for `gate_up_eligible` rows: [M, N/2], rounded as linear then fused.silu_mul round it.
    `blocks`: a config other than _gate_up_blocks' (benchmark sweeps)."""
    (m, k), n = x.shape, weight.shape[0] // 2
    _check_shapes(x, weight.shape[1], weight, bias)
    blocks = blocks or _gate_up_blocks(m, n, k)
    if (blocks, 2 * n, k) not in _ROWS_UNFIT:
        try:
            return _launch_rows(kernels.rows_silu_kernel, x, weight, bias, n, blocks)
        except triton.runtime.errors.OutOfResources:   # as in linear
            _ROWS_UNFIT.add((blocks, 2 * n, k))
    return fused.silu_mul(torch.nn.functional.linear(x, weight, bias))


@torch.inference_mode()
def warm_up_gate_up(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Compile gate_up_silu for every row tiling it may meet with this weight's shape (5-7 of them):
    a compile mid-serving (a prompt of a new length) would stall that step for about a second."""
    n, k = weight.shape[0] // 2, weight.shape[1]
    rows_of = {}
    for m in range(GATE_UP_MIN_ROWS, GATE_UP_MAX_ROWS + 1):
        rows_of.setdefault(_gate_up_blocks(m, n, k), m)
    for m in rows_of.values():
        gate_up_silu(torch.zeros(m, k, dtype=weight.dtype, device=weight.device), weight, bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) W^T (+ b), x + residual) for a `fusable` row: fused.add_rms_norm, then a linear."""
    y, res_out = _launch(_NORM, x, weight, bias, residual, norm_weight, eps)
    return y, res_out if res_out is not None else x


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(silu(gate) * up) W^T (+ b) for a `fusable` row x = [gate | up]: fused.silu_mul, then a linear."""
    return _launch(_SILU, x, weight, bias)[0]

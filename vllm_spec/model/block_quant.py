"""Float32 weights that are exactly the values of llama.cpp's Q4_0, Q4_1 or Q8_0 blocks, held as blocks.

A GGUF checkpoint's quantized tensors are dequantized on load (gguf_loader), and a float32 model keeps
the float32 values: 4 bytes a weight, where the file spent 0.56-0.63 (Q4_0, Q4_1) or 1.06 (Q8_0). CPU decoding
reads every weight once per step, so on the CPU kernel (cpu_linear) such a weight is held as 32-column
blocks again: `find` recovers each block's scale d (and minimum m) and integers q from the float32
values and keeps them only where d q (+ m) gives back every value exactly. The kernel widens the
blocks in registers to those same float32 values, so the products are exactly the float32 model's,
from a fifth (Q4_1) or a third (Q8_0) of the bytes. Nothing here depends on where the values came from:
weights that are not such blocks are left as they are.

Block layouts (little-endian, rows of K // 32 blocks, what csrc/cpu/rows_linear.cpp reads):
Q4_1: float32 d, float32 m, 16 bytes with q[j] in byte j's low nibble and q[j + 16] in its high nibble,
w = d q + m, q in 0..15 (Q4_0's w = d (q - 8) too, as m = -8 d: its blocks are held in this layout,
block by block alongside Q4_1's). Q8_0: float32 d, 32 int8 q, w = d q. d is always a float16 value (as
in the file), so d q is exact and the kernel's one rounding of d q + m equals torch's two.

Q8_0_I8 (`int8_tiles`, a draft's lossy choice): Q8_0 blocks re-laid in tiles of 8 rows for
csrc/cpu/q8_int8.cpp, which rounds the activations to int8 blocks too and multiplies by integer dot
products (llama.cpp's Q8_0 arithmetic): per tile and block, the 8 rows' float32 d, then for each 4
columns the 8 rows' 4 values q + 128 as uint8. The bytes of N rows are those of N rows of Q8_0.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

BLOCK = 32
BLOCK_BYTES = {"q4_1": 24, "q8_0": 36, "q8_0_i8": 36}
TILE_ROWS = 8   # Q8_0_I8's rows per tile
# Rows encoded at a time: bounds the temporaries of a large embedding; the first chunk is one row,
# so a weight that is not blocks is turned down after a row's work.
_CHUNK_ROWS = 4096
_D_STEPS = 8   # float16 steps either side of the nearest Q4_1 scale tried
_HALF_MAX_BITS = 0x7BFF   # the largest finite float16


@dataclasses.dataclass(frozen=True)
class BlockWeight:
    """A float32 [N, K] weight held as 32-column Q4_1 or Q8_0 blocks (uint8 [N, K // 32 * bytes])."""

    format: str
    blocks: torch.Tensor
    shape: torch.Size
    dtype = torch.float32
    requires_grad = False   # (a detached copy, as every packed weight)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (a zero may come back as -0.0 or 0.0: see _same_values)."""
        n, k = self.shape
        if self.format == "q8_0_i8":
            t = self.blocks.view(n // TILE_ROWS, k // BLOCK, TILE_ROWS * BLOCK_BYTES["q8_0_i8"])
            d = t[..., :32].contiguous().view(torch.float32).transpose(1, 2)              # [tiles, 8, blocks]
            q = t[..., 32:].view(-1, k // BLOCK, 8, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)   # [tiles, 8, blocks, 8, 4]
            q = (q.reshape(-1, TILE_ROWS, k // BLOCK, BLOCK).short() - 128).float()
            return (d.unsqueeze(-1) * q).reshape(n, k)
        b = self.blocks.view(n, k // BLOCK, BLOCK_BYTES[self.format])
        d = b[..., 0:4].contiguous().view(torch.float32)
        if self.format == "q8_0":
            return (d * b[..., 4:].view(torch.int8).float()).view(n, k)
        m = b[..., 4:8].contiguous().view(torch.float32)
        nibbles = b[..., 8:]
        q = torch.cat([nibbles & 15, nibbles >> 4], -1).float()
        return (d * q + m).view(n, k)


def find(weight: torch.Tensor) -> BlockWeight | None:
    """The weight in the Q4_1 layout (Q4_1 / Q4_0 values), else as Q8_0 blocks, where they hold every value
    exactly; else None."""
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK
            or weight.shape[0] == 0 or weight.device.type != "cpu"):
        return None
    w = weight.detach()
    n = w.shape[0]
    chunks = [(0, 1), *((s, min(s + _CHUNK_ROWS, n)) for s in range(1, n, _CHUNK_ROWS))]
    for fmt, encode in _ENCODERS.items():
        parts = []
        for start, stop in chunks:
            part = encode(w[start:stop].reshape(stop - start, -1, BLOCK))
            if part is None:
                break
            parts.append(part)
        else:
            return BlockWeight(fmt, torch.cat(parts).reshape(n, -1), w.shape)
    return None


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight | None:
    """The nearest Q8_0 blocks of a float32 [N, K] CPU weight (d = max |w| / 127 as a float16 value, q the
    nearest integer; every element within d / 2 of the weight, up to d's rounding), or None where it
    has no such blocks (K not a multiple of 32, a scale past float16). Lossy: only for weights whose
    values may move a little (a draft's, whose numerics only set how many of its tokens are accepted)."""
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK
            or weight.shape[0] == 0 or weight.device.type != "cpu"):
        return None
    b = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    if not torch.isfinite(d).all():
        return None
    q = torch.where(d > 0, b / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127).to(torch.int8)
    return BlockWeight("q8_0", torch.cat([_bytes(d), _bytes(q)], -1).reshape(weight.shape[0], -1), weight.shape)


def int8_tiles(weight: BlockWeight) -> BlockWeight | None:
    """Q8_0 blocks as Q8_0_I8 (see the module's docstring), or None where the rows do not fill tiles of 8
    (or the blocks are not Q8_0). The weights keep their values; products with them round the activations
    to int8 blocks: lossy, only for a draft (ArchConfig.cpu_weights)."""
    n, k = weight.shape
    if weight.format != "q8_0" or n % TILE_ROWS:
        return None
    b = weight.blocks.view(n // TILE_ROWS, TILE_ROWS, k // BLOCK, BLOCK_BYTES["q8_0"])
    d = b[..., :4].permute(0, 2, 1, 3).reshape(n // TILE_ROWS, k // BLOCK, 32)
    q = b[..., 4:].view(torch.int8).view(n // TILE_ROWS, TILE_ROWS, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)
    q = (q.short() + 128).to(torch.uint8).reshape(n // TILE_ROWS, k // BLOCK, 256)
    return BlockWeight("q8_0_i8", torch.cat([d, q], -1).reshape(n, -1).contiguous(), weight.shape)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Equal values, NaN never: a zero's sign cannot reach the products' sums (they start from +0.0, and
    # s + (-0.0) = s + 0.0 for every s), and Q4_0's d (q - 8) gives -0.0 where d < 0 that the Q4_1
    # layout's d q + m gives as 0.0.
    return a == b


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _encode_q4_1(b: torch.Tensor) -> torch.Tensor | None:
    """b [rows, blocks, 32] -> uint8 [rows, blocks, 24], or None where some block is not Q4_1 (or Q4_0)."""
    found = torch.zeros(b.shape[:-1], dtype=torch.bool)
    d_of, m_of = torch.zeros(*b.shape[:-1], 1), torch.zeros(*b.shape[:-1], 1)
    q_of = torch.zeros(b.shape, dtype=torch.uint8)
    for d, m in _q4_scales(b):
        q = torch.where(d != 0, (b - m) / torch.where(d != 0, d, 1), 0).round().clamp(0, 15).to(torch.uint8)
        # (d a float16 value: d q is exact, so the kernel's fused d q + m rounds as this one does)
        ok = _same_values(d * q.float() + m, b).all(-1) & (d.half().float() == d).squeeze(-1) & ~found
        d_of[ok], m_of[ok], q_of[ok] = d[ok], m[ok], q[ok]
        found |= ok
        if found.all():
            return torch.cat([_bytes(d_of), _bytes(m_of), q_of[..., :16] | (q_of[..., 16:] << 4)], -1)
    return None


def _q4_scales(b: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Candidate (d, m) per block, the likeliest first."""
    # Q4_1: m the minimum (q = 0), d a float16 value near (max - m) / 15 (the maximum is q = 15): within a
    # few float16 steps where |m| >> d, as max = 15 d + m was rounded to float32.
    m = b.amin(-1, keepdim=True)
    nearest = ((b.amax(-1, keepdim=True) - m) / 15).half().view(torch.int16).int()

    def q4_1(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (nearest + step).clamp(0, _HALF_MAX_BITS).short().view(torch.half).float(), m

    yield q4_1(0)
    # Q4_0: w = d (q - 8), the element of largest magnitude at q = 0 (d = -it / 8, of either sign).
    extreme = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    yield -extreme / 8, extreme
    for i in range(1, _D_STEPS + 1):
        yield q4_1(i)
        yield q4_1(-i)


def _encode_q8_0(b: torch.Tensor) -> torch.Tensor | None:
    """b [rows, blocks, 32] -> uint8 [rows, blocks, 36], or None where some block is not Q8_0."""
    d = b.abs().amax(-1, keepdim=True) / 127   # the largest |q| is 127: d = max / 127, exactly
    if not (torch.isfinite(d).all() and torch.equal(d.half().float(), d)):
        return None
    q = torch.where(d > 0, b / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127).to(torch.int8)
    if not _same_values(d * q.float(), b).all():
        return None
    return torch.cat([_bytes(d), _bytes(q)], -1)


_ENCODERS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {"q4_1": _encode_q4_1, "q8_0": _encode_q8_0}

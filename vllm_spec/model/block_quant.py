"""Float32 weights that are exactly the values of llama.cpp's quantized blocks, held as blocks.

A GGUF checkpoint's quantized tensors are dequantized on load (gguf_loader), and a float32 model keeps
the float32 values: 4 bytes a weight, where the file spent 0.56-0.63 (Q4_0, Q4_1) or 1.06 (Q8_0). CPU decoding
reads every weight once per step, so on the CPU kernel (cpu_linear) such a weight is held as 32-column
blocks again: `find` recovers each block's scale d (and minimum m) and integers q from the float32
values and keeps them only where d q (+ m) gives back every value exactly. The kernel widens the
blocks in registers to those same float32 values, so the products are exactly the float32 model's,
from a fifth (Q4_1; Q4_0's and Q4_K's 4-bit values too) or a third (Q8_0) of the bytes. Other formats
(Q5_0/Q5_1, the k-quants Q2_K-Q6_K but Q4_K, a tensor's rows of mixed formats) are held as U8X16, from 1.5
bytes a weight. Nothing here depends on where the values came from: weights that are not such blocks are
left as they are.

Block layouts (little-endian, rows of K // 32 blocks, what csrc/cpu/rows_linear.cpp reads):
Q4_1: float32 d, float32 m, 16 bytes with q[j] in byte j's low nibble and q[j + 16] in its high nibble,
w = d q + m, q in 0..15 (Q4_0's w = d (q - 8) too, as m = -8 d: its blocks are held in this layout,
block by block alongside Q4_1's; Q4_K's too, d a float16 times a 6-bit scale). Q8_0: float32 d, 32 int8 q,
w = d q. d is a float16 value (as in the file) or checked to give exact products d q, so the kernel's one
rounding of d q + m equals torch's two.
U8X16: per 16 columns float32 d and m (two pairs: d0, m0, d1, m1), then the 32 columns' q as uint8, w = d q
+ m with d q exact. Every llama.cpp format is some d q + m per group of 16 or 32 columns with small q (the
k-quants' d a float16 times a 6- or 8-bit scale); m is the group's minimum (q = 0) and d the greatest
common divisor of the differences from it, found by Euclid's algorithm on floats (fmod is exact). Where
the values were rounded from d q + m (|m| >> d), d and m are fitted to them (_rounded_divisor). Every group
is checked exactly.

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
BLOCK_BYTES = {"q4_1": 24, "q8_0": 36, "q8_0_i8": 36, "u8x16": 48}
GROUP = 16   # U8X16's columns per (d, m)
_MAX_OFFSET = 64   # q of a group's least value tried (values rounded from d q + m, see _rounded_divisor)
TILE_ROWS = 8   # Q8_0_I8's rows per tile
# Rows encoded at a time: bounds the temporaries of a large embedding; the first chunk is one row,
# so a weight that is not blocks is turned down after a row's work.
_CHUNK_ROWS = 4096
_D_STEPS = 8   # float16 steps either side of the nearest Q4_1 scale tried
_HALF_MAX_BITS = 0x7BFF   # the largest finite float16


@dataclasses.dataclass(frozen=True)
class BlockWeight:
    """A float32 [N, K] weight held as 32-column blocks of a format (uint8 [N, K // 32 * bytes])."""

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
        if self.format == "u8x16":
            dm = b[..., :16].contiguous().view(torch.float32).view(n, k // GROUP, 2)
            q = b[..., 16:].reshape(n, k // GROUP, GROUP).float()
            return (dm[..., :1] * q + dm[..., 1:]).view(n, k)
        d = b[..., 0:4].contiguous().view(torch.float32)
        if self.format == "q8_0":
            return (d * b[..., 4:].view(torch.int8).float()).view(n, k)
        m = b[..., 4:8].contiguous().view(torch.float32)
        nibbles = b[..., 8:]
        q = torch.cat([nibbles & 15, nibbles >> 4], -1).float()
        return (d * q + m).view(n, k)


def find(weight: torch.Tensor) -> BlockWeight | None:
    """The weight in the Q4_1 layout (Q4_1 / Q4_0 / Q4_K values), else as Q8_0 blocks, else as U8X16 (the
    fewest bytes first), where they hold every value exactly; else None."""
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
    """b [rows, blocks, 32] -> uint8 [rows, blocks, 24], or None where some block is not Q4_1 (or Q4_0, Q4_K)."""
    found = torch.zeros(b.shape[:-1], dtype=torch.bool)
    d_of, m_of = torch.zeros(*b.shape[:-1], 1), torch.zeros(*b.shape[:-1], 1)
    q_of = torch.zeros(b.shape, dtype=torch.uint8)
    for i, (d, m) in enumerate(_q4_scales(b)):
        if i == 2:
            # After Q4_1's and Q4_0's likeliest scales: any d q + m with q in 0..15 (Q4_K's d is a float16
            # times a 6-bit scale); the further float16 candidates for what is left.
            d_rest, q_rest, m_rest, ok = _affine(b[~found])
            ok &= q_rest.amax(-1) <= 15
            fits = ~found
            fits[fits.clone()] = ok   # the blocks left that these values fit
            d_of[fits], m_of[fits], q_of[fits] = d_rest[ok], m_rest[ok], q_rest[ok].to(torch.uint8)
            found |= fits
            if found.all():
                break
        q = torch.where(d != 0, (b - m) / torch.where(d != 0, d, 1), 0).round().clamp(0, 15).to(torch.uint8)
        # (d a float16 value: d q is exact, so the kernel's fused d q + m rounds as this one does)
        ok = _same_values(d * q.float() + m, b).all(-1) & (d.half().float() == d).squeeze(-1) & ~found
        d_of[ok], m_of[ok], q_of[ok] = d[ok], m[ok], q[ok]
        found |= ok
        if found.all():
            break
    if not found.all():
        return None
    return torch.cat([_bytes(d_of), _bytes(m_of), q_of[..., :16] | (q_of[..., 16:] << 4)], -1)


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


def _encode_u8x16(b: torch.Tensor) -> torch.Tensor | None:
    """b [rows, blocks, 32] -> uint8 [rows, blocks, 48], or None where some group of 16 is not d q + m with
    q in 0..255 and d q exact."""
    d, q, m, ok = _affine(b.reshape(-1, GROUP))
    if not ok.all():
        return None
    dm = torch.cat([d, m], -1).reshape(*b.shape[:-1], 4)
    return torch.cat([_bytes(dm), q.to(torch.uint8).reshape(b.shape)], -1)


def _affine(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d [n, 1], q [n, w] float, m [n, 1], ok [n]): d q + m every value of group g[i] (of n, w wide), q in
    0..255 and d q exact, where ok[i]."""
    finite = torch.isfinite(g).all(-1)
    if not finite.all():
        g = torch.where(torch.isfinite(g), g, 0.0)   # (those groups stay not ok)
    m = g.amin(-1, keepdim=True)
    diff = g - m
    # Most groups: the least difference divides every other (then it is their greatest divisor).
    d = torch.where(diff > 0, diff, torch.inf).amin(-1, keepdim=True)
    d = torch.where(torch.isfinite(d), d, 0.0)
    rest = (torch.fmod(diff, torch.where(d > 0, d, 1)) != 0).any(-1)
    if rest.any():
        d[rest] = _common_divisor(diff[rest])
    q = (diff / torch.where(d > 0, d, 1)).round()
    ok = _exact(d, q, m, g)
    missed = ~ok
    # Values rounded from d q + m (|m| >> d: their differences share no divisor), where few groups miss
    # (a k-quant's; many missing: not blocks)
    if missed.any() and missed.sum() <= len(g) // 4:
        d[missed], q[missed], m[missed] = found = _rounded_divisor(g[missed], m[missed])
        ok[missed] = _exact(*found, g[missed])
    return d, q, m, ok & finite


def _exact(d: torch.Tensor, q: torch.Tensor, m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """[groups]: whether q is in 0..255, d q exact (the kernel's fused d q + m then rounds as torch's two
    operations do) and d q + m every value of the group. d q is exact where d's significant bits and the
    largest q's fit in float32's 24 (else, as for subnormal d, checked in float64)."""
    q_max = q.amax(-1, keepdim=True)
    bits = d.view(torch.int32) & 0x7FFFFF
    normal = (d.view(torch.int32) & 0x7F800000) != 0
    low = (bits | 0x800000) & -(bits | 0x800000)   # the lowest set bit of the significand
    fits = normal & (24 - torch.frexp(low.float())[1] + 1 + torch.frexp(q_max)[1] <= 24) | (d == 0)
    exact = fits.squeeze(-1)
    if not exact.all():
        odd = ~exact
        exact[odd] = (d[odd].double() * q[odd].double() == (d[odd] * q[odd]).double()).all(-1)
    return (q_max.squeeze(-1) <= 255) & exact & ((d * q + m) == g).all(-1)


def _rounded_divisor(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, q, m) for groups [n, w] whose values are some d q + m rounded (|m| >> d: the differences share no
    divisor), where one is found: q up to an offset from a divisor of the differences up to their rounding,
    d and m fitted to the values (d with few enough bits that d q is exact), then the nearby floats tried
    for both, and offsets of q (the group's least value need not be q = 0). Unfound groups keep a
    candidate that the caller's check turns down."""
    g64 = g.double()
    diff = g64 - m.double()
    half_ulp = (torch.nextafter(g, torch.full_like(g, float("inf"))) - g).double() / 2
    # (q <= 255 puts d at 2^-8 of the largest difference or more: remainders below 2^-6 of that are
    # rounding, which Euclid's steps carry and multiply)
    approx = _common_divisor(diff, tolerance=diff.amax(-1, keepdim=True) * 2.0 ** -14)
    q0 = (diff / torch.where(approx > 0, approx, 1)).round().clamp(0, 256)
    # least squares of g = d q0 + c
    qm, gm = q0.mean(-1, keepdim=True), g64.mean(-1, keepdim=True)
    var = ((q0 - qm) ** 2).sum(-1, keepdim=True)
    slope = torch.where(var > 0, ((q0 - qm) * (g64 - gm)).sum(-1, keepdim=True) / torch.where(var > 0, var, 1), 0)
    mantissa, exponent = torch.frexp(slope)
    best = (torch.zeros_like(m), q0.float(), m.clone())
    found = torch.zeros(len(g), dtype=torch.bool)
    for offset in range(_MAX_OFFSET):
        q64 = q0 + offset
        q = q64.float()
        bits = 24 - torch.frexp(q64.amax(-1, keepdim=True))[1]   # d q exact: d has 24 less q's bits or fewer
        for d_step in (0, 1, -1):
            d64 = torch.ldexp(torch.ldexp(mantissa, bits).round() + d_step, exponent - bits)
            d = d64.float()
            # m within half a unit in the last place of every value less its d q: the middle of what
            # that leaves, and its neighbours
            low = (g64 - half_ulp - d64 * q64).amax(-1, keepdim=True)
            c = ((low + (g64 + half_ulp - d64 * q64).amin(-1, keepdim=True)) / 2).float()
            for c_try in (c, torch.nextafter(c, c + 1), torch.nextafter(c, c - 1)):
                ok = _exact(d, q, c_try, g) & ~found
                best[0][ok], best[1][ok], best[2][ok] = d[ok], q[ok], c_try[ok]
                found |= ok
                if found.all():
                    return best
    return best


def _common_divisor(diff: torch.Tensor, tolerance: torch.Tensor | None = None) -> torch.Tensor:
    """[groups, 1]: the greatest float dividing every element of diff [groups, n] (>= 0) an integral number
    of times (up to tolerance: remainders at most it count as none), by Euclid's algorithm (exact: fmod is);
    0 for an all-zero group. Values of d q + m groups end in a few steps each; others only fail the
    caller's checks. With a tolerance each step's divisor is re-read off the largest element (a whole
    number of it there): rounding carried through Euclid's steps would otherwise grow with their quotients."""
    top = diff.amax(-1, keepdim=True)
    d = top.clone()   # (so that every divisor met divides it)
    for i in range(diff.shape[1]):
        a, r = d, diff[:, i:i + 1].clone()
        while True:
            live = r > (0.0 if tolerance is None else tolerance)
            if not live.any():
                break
            a, r = torch.where(live, r, a), torch.where(live, torch.fmod(a, torch.where(live, r, 1)), r)
        d = a
        if tolerance is not None:
            times = (top / torch.where(d > 0, d, 1)).round()
            d = torch.where((d > 0) & (times > 0), top / times.clamp(min=1), d)
    return d


_ENCODERS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "q4_1": _encode_q4_1, "q8_0": _encode_q8_0, "u8x16": _encode_u8x16}

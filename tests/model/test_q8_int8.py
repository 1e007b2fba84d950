"""A draft's int8 matmul (csrc/cpu/q8_int8.cpp, BlockWeight format "q8_0_i8"): Q8_0 weights re-laid in
tiles of 8 rows keep their values, and the products are llama.cpp's Q8_0 arithmetic (activations rounded
to int8 blocks, integer dot products per block, float32 scales), the same for a row in any batch."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.model import block_quant, cpu_linear
from vllm_spec.model.layers import linear, quantize_for_cpu

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX2 CPU kernel here (or not buildable)")


def int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, block_quant.BlockWeight]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n).unsqueeze(1)
    w[0, :32] = 0.0                                          # an all-zero block
    w[-1, 5] = 40.0                                          # an outlier that sets its block's scale
    return w, block_quant.int8_tiles(block_quant.quantize_q8_0(w))


def reference(x: torch.Tensor, tiles: block_quant.BlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(llama.cpp's Q8_0 dot products in float64 from the same roundings, sum of |terms|): x's blocks
    rounded as the kernel does (scale max |x| / 127, q = x * (127 / max) in float32, to the nearest
    integer, ties to even), exact integer sums, each block scaled by float32(d_w * d_x)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    top = xb.abs().amax(-1)
    inv = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros(()))
    q_x = torch.round(xb * inv.unsqueeze(-1)).double()
    d_x = top / 127
    w = tiles.dequantize().view(-1, k // 32, 32)
    d_w = w.abs().amax(-1) / 127
    q_w = torch.where(d_w.unsqueeze(-1) > 0, w / d_w.unsqueeze(-1).clamp_min(1e-30), 0).round().double()
    ints = torch.einsum("mbj,nbj->mnb", q_x, q_w)            # exact in float64
    scales = (d_w.unsqueeze(0) * d_x.unsqueeze(1)).double()  # float32 products, as the kernel's
    terms = ints * scales
    return terms.sum(-1), terms.abs().sum(-1)


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 40])
@pytest.mark.parametrize("n, k", [(8, 32), (16, 96), (64, 576), (40, 1536)])
def test_kernel_is_q8_0_arithmetic_on_int8_rounded_activations(rows, n, k):
    _, tiles = int8_weight(n, k, seed=rows + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    if rows > 1:
        x[1, :32] = 0.0   # an all-zero activation block
        x[1, 40 % k] = -25.0
    expected, size = reference(x, tiles)
    got = cpu_linear.linear(x, tiles)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # float32 sums of k / 32 exact block terms; one activation rounded otherwise moves a result by about
    # |term| / 127, far past this bound.
    assert ((got.double() - expected).abs() <= 4 * (k // 32) * 2 ** -24 * size + 1e-30).all()


@needs_kernel
def test_a_row_gets_the_same_bits_in_any_batch():
    _, tiles = int8_weight(96, 576, seed=1)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(2))
    batch = cpu_linear.linear(x, tiles)
    for i in range(len(x)):
        assert torch.equal(cpu_linear.linear(x[i:i + 1], tiles).view(torch.int32), batch[i:i + 1].view(torch.int32))
    assert torch.equal(cpu_linear.linear(x[3:8], tiles).view(torch.int32), batch[3:8].view(torch.int32))


@pytest.mark.parametrize("n, k", [(8, 32), (24, 96), (64, 576)])
def test_tiles_keep_the_q8_0_values(n, k):
    w, tiles = int8_weight(n, k, seed=n)
    blocks = block_quant.quantize_q8_0(w)
    assert tiles.format == "q8_0_i8" and tiles.shape == w.shape and tiles.blocks.shape == blocks.blocks.shape
    assert torch.equal(tiles.dequantize(), blocks.dequantize())


def test_rows_that_do_not_fill_tiles_stay_q8_0_blocks():
    blocks = block_quant.quantize_q8_0(torch.randn(12, 64))
    assert block_quant.int8_tiles(blocks) is None
    q4_1 = block_quant.BlockWeight("q4_1", torch.zeros(8, 24, dtype=torch.uint8), torch.Size([8, 32]))
    assert block_quant.int8_tiles(q4_1) is None
    if cpu_linear.available():
        assert quantize_for_cpu(torch.randn(12, 64), "q8_0").format == "q8_0"
        assert quantize_for_cpu(torch.randn(16, 64), "q8_0").format == "q8_0_i8"
        assert quantize_for_cpu(torch.randn(16, 40), "q8_0") is None   # K not a multiple of 32


@needs_kernel
def test_a_malformed_tile_weight_is_a_clear_error():
    tiles = block_quant.int8_tiles(block_quant.quantize_q8_0(torch.randn(16, 64)))
    with pytest.raises(RuntimeError, match="tiles of 8 rows"):
        cpu_linear.kernel().rows_linear_blocks(torch.randn(2, 64), tiles.blocks[:12].contiguous(), "q8_0_i8")
    with pytest.raises(RuntimeError, match="format q4_1, q8_0, q8_0_i8 or u8x16"):
        cpu_linear.kernel().rows_linear_blocks(torch.randn(2, 64), tiles.blocks, "q8_1")


def test_autograd_takes_the_dequantized_weight():
    w, tiles = int8_weight(16, 64, seed=3)
    x = torch.randn(2, 64, requires_grad=True)
    y = linear(x, tiles)
    y.sum().backward()
    assert torch.allclose(y, x.detach() @ tiles.dequantize().T, atol=1e-5)
    assert torch.allclose(x.grad, tiles.dequantize().sum(0).expand(2, -1))

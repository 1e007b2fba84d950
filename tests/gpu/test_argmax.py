"""The chunked Triton argmax against torch.argmax: same index, first maximum on ties."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.sample.argmax import argmax_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, V", [(1, 128256), (16, 49152), (37, 151936), (3, 8193), (256, 128256)])
def test_argmax_rows_matches_torch(dtype, N, V):
    x = torch.randn(N, V, device="cuda", dtype=dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("rows", [4, 256])   # the chunked kernel, and torch past _MANY_ROWS
def test_argmax_rows_ties_and_infinities(rows):
    x = torch.zeros(rows, 20000, device="cuda")
    x[0, [5000, 100, 19999]] = 3.0              # tie across chunks: the first index wins
    x[1, [4097, 4096]] = 1.0                     # tie inside a chunk
    x[2] = float("-inf")                         # nothing finite
    x[3, -1] = 1.0                               # the last column, in the ragged last chunk
    assert argmax_rows(x)[:4].tolist() == [100, 4096, 0, 19999]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_on_a_row_view():
    x = torch.randn(8, 2 * 32768, device="cuda")[:, :32768]   # strided rows
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))

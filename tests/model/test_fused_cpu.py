"""The decoder's elementwise ops on the CPU's C++ kernels (csrc/cpu/elementwise.cpp, through model/fused.py)
against the torch code they replace: the same rounding in float32 and bfloat16 (the RMSNorm's sum of squares
may add in another order), every row alone, and where they are used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_spec import cpu_ops
from vllm_spec.model import fused

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no AVX2 CPU kernels here (or not buildable)")
DTYPES = [torch.float32, torch.bfloat16]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 576), (5, 64), (16, 100), (3, 7)])
def test_add_rms_norm(dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, 2 * width, generator=gen).to(dtype)[:, :width]   # strided rows
    res = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    for residual in (res, None):
        out, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
        ref_out, ref_summed = fused.add_rms_norm_torch(x, residual, weight, 1e-5)
        assert out.dtype == dtype and out.shape == (rows, width)
        assert torch.equal(summed, ref_summed) and (residual is not None or summed is x)
        # One rounding of the statistic apart at most (float32: a few ulp; bf16: one step of the output).
        step = 2 ** -20 if dtype == torch.float32 else 2 ** -7
        assert ((out.double() - ref_out.double()).abs() <= ref_out.double().abs() * step + 1e-6).all()
    alone = torch.cat([fused.add_rms_norm(x[i:i + 1], res[i:i + 1], weight, 1e-5)[0] for i in range(rows)])
    assert torch.equal(alone, fused.add_rms_norm(x, res, weight, 1e-5)[0])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 13)])
def test_silu_mul(dtype, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)
    x[0, 0], x[0, 1] = -200.0, 200.0   # exp's ends: -0.0-ish and x
    got = fused.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == (rows, inter)
    step = 2 ** -20 if dtype == torch.float32 else 2 ** -7   # (exp within 2 ulp: at most a rounding apart)
    assert ((got.double() - ref.double()).abs() <= ref.double().abs() * step + 1e-30).all()
    nan = x.clone()
    nan[0, 2] = float("nan")
    assert fused.silu_mul(nan)[0, 2].isnan()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    T, H, KVH, D = 5, 9, 3, 64
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen).to(dtype)   # q and k as views of the q/k/v product
    q, k = qkv[:, : H * D].view(T, H, D), qkv[:, H * D: (H + KVH) * D].view(T, KVH, D)
    cos, sin = torch.randn(T, D, generator=gen).to(dtype), torch.randn(T, D, generator=gen).to(dtype)
    got_q, got_k = fused.rotary(q, k, cos, sin)
    ref_q, ref_k = fused.rotary_torch(q, k, cos, sin)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


def test_used_on_the_cpu_only_where_built(monkeypatch):
    x, w = torch.randn(2, 8), torch.rand(8)
    assert fused._cpu_ok(x, w) == cpu_ops.available()
    assert not fused._cpu_ok(x.half(), w.half()) and not fused._cpu_ok(x.double(), w.double())
    assert not fused._cpu_ok(x, w.bfloat16())   # (mixed dtypes: the torch code)
    assert not fused._cpu_ok(x.requires_grad_(), w)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    assert not fused._cpu_ok(torch.randn(2, 8), w)
    out, summed = fused.add_rms_norm(torch.ones(2, 8), None, w, 1e-5)   # the torch code
    torch.testing.assert_close(out, w.expand(2, -1))

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
@pytest.mark.parametrize("width", [4096, 8192])
def test_rms_norm_of_wide_heavy_tailed_rows_as_accurate_as_torch(width):
    """The sum of squares in double: as close to float64 as torch's pairwise float sum, however wide."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(3, width, generator=gen) * torch.logspace(-3, 3, width)[torch.randperm(width, generator=gen)]
    weight = torch.ones(width)
    ours = fused.add_rms_norm(x, None, weight, 1e-6)[0].double()
    theirs = fused.add_rms_norm_torch(x, None, weight, 1e-6)[0].double()
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert ((ours - exact).abs() / exact.abs().clamp_min(1e-30)).max() <= 2 ** -22
    assert ((theirs - exact).abs() / exact.abs().clamp_min(1e-30)).max() <= 2 ** -20   # (torch's, for scale)


@needs_kernel
def test_the_cpu_ops_are_what_runs(monkeypatch):
    """The comparisons above would hold trivially on the torch fallback: the C++ ops do run."""
    called = []
    real = cpu_ops.module()

    class Spy:
        def __getattr__(self, name):
            called.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu_ops, "module", lambda: Spy())
    x, w = torch.randn(2, 16), torch.rand(16)
    fused.add_rms_norm(x, x, w, 1e-5)
    fused.silu_mul(torch.randn(2, 16))
    fused.rotary(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 8), torch.randn(2, 8))
    assert called == ["add_rms_norm", "silu_mul", "rotary"]
    # Shapes the torch code broadcasts (a [1, D] cos, a 1-D residual) take the torch code.
    called.clear()
    fused.add_rms_norm(x, x[0], w, 1e-5)
    fused.rotary(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(1, 8), torch.randn(1, 8))
    assert called == []


@needs_kernel
def test_bad_arguments_are_errors_not_crashes():
    ops = cpu_ops.module()
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight"):
        ops.add_rms_norm(x, None, torch.empty(8, device="meta"), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(x, torch.empty(2, 8, device="meta"), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="cos"):
        ops.rotary(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.empty(2, 8, device="meta"), torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="2I"):
        ops.silu_mul(torch.randn(2, 7))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 13)])
def test_silu_mul(dtype, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 6).to(dtype)
    x[0, :6] = torch.tensor([-200.0, 200.0, -88.5, 88.5, -3e38, float("inf")])   # exp's ends
    x[0, inter: inter + 2] = 3e38   # a large up: silu's tiny values stay tiny
    got = fused.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == (rows, inter)
    step = 2 ** -20 if dtype == torch.float32 else 2 ** -7   # (exp within 2 ulp: at most a rounding apart)
    assert ((got.double() == ref.double()) | ((got.double() - ref.double()).abs() <= ref.double().abs() * step)).all()
    special = x.clone()
    special[0, 2], special[0, 3] = float("nan"), float("-inf")
    out = fused.silu_mul(special)
    assert out[0, 2].isnan() and out[0, 3].isnan()   # (-inf / inf, as torch)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, D", [(5, 64), (1, 2), (7, 6), (0, 128), (3, 128)])
def test_rotary_bit_for_bit(dtype, T, D):
    gen = torch.Generator().manual_seed(T * D)
    H, KVH = 9, 3
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

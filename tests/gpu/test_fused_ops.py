"""Triton fused ops against their torch implementations (fresh random inputs, relative error bounds)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from vllm_spec.model import fused

pytestmark = pytest.mark.gpu
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T, N", [(1, 4096), (7, 576), (300, 2048), (64, 896)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, T, N, with_residual):
    x = torch.randn(T, N, device="cuda", dtype=dtype)
    res = torch.randn(T, N, device="cuda", dtype=dtype) if with_residual else None
    w = torch.rand(N, device="cuda", dtype=dtype) + 0.5
    out, new_res = fused.add_rms_norm(x, res, w, 1e-5)
    ref, ref_res = fused.add_rms_norm_torch(x, res, w, 1e-5)
    assert rel_err(out, ref) < BOUND[dtype]
    assert torch.equal(new_res, ref_res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, inter", [(1, 14336), (33, 1536), (256, 8192)])
def test_silu_mul(dtype, T, inter):
    x = torch.randn(T, 2 * inter, device="cuda", dtype=dtype) * 3
    gate, up = x.chunk(2, dim=-1)
    assert rel_err(fused.silu_mul(x), torch.nn.functional.silu(gate) * up) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, KVH, D", [(1, 32, 8, 128), (80, 32, 8, 128), (19, 9, 3, 64), (260, 4, 2, 16),
                                          (3, 1, 1, 32)])
def test_rotary_in_place_on_qkv_views(dtype, T, H, KVH, D):
    qkv = torch.randn(T, (H + 2 * KVH) * D, device="cuda", dtype=dtype)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k = q.view(T, H, D), k.view(T, KVH, D)
    cos, sin = _cos_sin(T, D, dtype)
    ref_q, ref_k = fused.rotary_torch(q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    out_q, out_k = fused.rotary(q, k, cos, sin)
    assert rel_err(out_q, ref_q) < BOUND[dtype] and rel_err(out_k, ref_k) < BOUND[dtype]
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("T, H, KVH, D", [(5, 32, 8, 128), (3, 9, 3, 64)])
def test_rotary_on_separate_q_and_k(T, H, KVH, D):
    # In a qkv row q's head H is k's head 0, so views alone cannot tell which tensor a head is read from.
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, KVH, D, device="cuda", dtype=torch.bfloat16)
    cos, sin = _cos_sin(T, D, torch.bfloat16)
    ref_q, ref_k = fused.rotary_torch(q.clone(), k.clone(), cos, sin)
    out_q, out_k = fused.rotary(q, k, cos, sin)
    assert rel_err(out_q, ref_q) < BOUND[torch.bfloat16] and rel_err(out_k, ref_k) < BOUND[torch.bfloat16]


def _cos_sin(T: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 4096, (T,), device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)

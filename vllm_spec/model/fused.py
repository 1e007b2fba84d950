"""Fused elementwise ops of the decoder: residual add + RMSNorm, SiLU·mul, rotary embedding.

A decode step is memory-bound on the weights; unfused, these small ops cost one
kernel launch each (about a thousand per step for an 8B model). On CUDA each is
one Triton kernel; on x86-64 CPUs with AVX2 one C++ call (csrc/cpu/elementwise.cpp,
rounding as the torch code); elsewhere the torch code below is the implementation
(and the reference the kernels' tests compare against). The torch versions round
like HF's Llama code, which CPU tests check token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_spec import cpu_ops
from vllm_spec.platform import import_triton

triton, tl = import_triton()


def _triton_ok(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def _cpu_ok(*tensors: torch.Tensor) -> bool:
    """CPU float32/bfloat16 tensors of one dtype, elements contiguous, no autograd: the C++ ops take them."""
    dtype = tensors[0].dtype
    if dtype not in cpu_ops.DTYPES:
        return False
    for t in tensors:   # (a loop, not all(genexpr): this runs a few hundred times a decode step)
        if t.device.type != "cpu" or t.dtype != dtype or t.stride(-1) != 1 or t.requires_grad:
            return False
    return cpu_ops.available()   # (last: tensors on other devices must not build the CPU kernels)


# Residual add + RMSNorm ----------------------------------------------------------------

def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); residual None means just x."""
    if (x.dim() == 2 and weight.shape == x.shape[1:] and (residual is None or residual.shape == x.shape)
            and _cpu_ok(x, weight, *([] if residual is None else [residual]))):
        return cpu_ops.module().add_rms_norm(x, residual, weight.contiguous(), eps)
    if not _triton_ok(x) or x.dim() != 2 or x.stride(-1) != 1:
        return add_rms_norm_torch(x, residual, weight, eps)
    T, N = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if T:
        _add_rms_norm_kernel[(T,)](
            x, residual if residual is not None else x, weight, out, res_out, N, x.stride(0),
            residual.stride(0) if residual is not None else 0, eps,
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(N), num_warps=_norm_warps(N))
    return out, res_out


def _norm_warps(n: int) -> int:
    """Warps of the norm kernel for rows of n (bench_fused_ops.py --sweep patches this: none beat it)."""
    return 8 if n >= 4096 else 4


# SiLU(gate) * up --------------------------------------------------------------------

def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    if x.dim() == 2 and _cpu_ok(x):
        return cpu_ops.module().silu_mul(x)
    if not _triton_ok(x) or x.dim() != 2 or x.stride(-1) != 1:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    T, I2 = x.shape
    inter = I2 // 2
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    if T:
        block, warps = _SILU_CONFIG
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](x, out, inter, x.stride(0), BLOCK=block, num_warps=warps)
    return out


# (BLOCK, num_warps) of the SiLU·mul kernel: no other served any row count better in
# bench_fused_ops.py --sweep (which patches this).
_SILU_CONFIG = (1024, 4)


# Rotary embedding (rotate-half layout) ---------------------------------------------------------

_ROTARY_HEADS = 8   # heads per program


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin: [T, D] in q's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, KVH, D]; on CUDA in place, one kernel for both."""
    T, H, D = q.shape
    if (cos.shape == sin.shape == (T, D) and cos.stride() == sin.stride() and q.stride(1) == D and k.stride(1) == D
            and D % 2 == 0 and _cpu_ok(q, k, cos, sin)):
        return cpu_ops.module().rotary(q, k, cos, sin)
    if not _triton_ok(q) or q.stride(-1) != 1 or k.stride(-1) != 1 or D & (D - 1) or cos.stride(-1) != 1:
        return rotary_torch(q, k, cos, sin)
    heads = H + k.shape[1]
    if T:
        # A program rotates a block of one token's heads: one program per (token, head) left most
        # of a program idle (64 elements) and made the launch grow with the rows (80 verification
        # rows of an 8B model: 3200 programs).
        block = min(_ROTARY_HEADS, triton.next_power_of_2(heads))
        _rotary_kernel[(T, triton.cdiv(heads, block))](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), H, heads,
            HALF=D // 2, HEADS=block)
    return q, k


def rotary_leading(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary() on the leading `dims` dimensions of each head (all of them, or Phi-3's and GPT-NeoX's partial
    rotation: the rest pass as they are)."""
    if dims == q.shape[-1]:
        return rotary(q, k, cos, sin)
    q_rot, k_rot = rotary(q[..., :dims], k[..., :dims], cos, sin)
    return torch.cat((q_rot, q[..., dims:]), dim=-1), torch.cat((k_rot, k[..., dims:]), dim=-1)


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, stride_x, stride_r, eps,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)   # rounded like torch's add
            tl.store(res_out_ptr + row * N + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
        normed = (x32 * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (normed * w).to(x.dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
        g32 = g.to(tl.float32)
        s = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (s * u.to(tl.float32)).to(g.dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, sq_t, sq_h, sk_t, sk_h, sc_t, H, heads,
                       HALF: tl.constexpr, HEADS: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        valid = (h < heads)[:, None]
        # Heads [0, H) are q's, [H, heads) k's (both of q's dtype).
        base = tl.where(h < H, q_ptr + t * sq_t + h * sq_h, k_ptr + t * sk_t + (h - H) * sk_h)
        offs = tl.arange(0, HALF)
        lo = base[:, None] + offs[None, :]
        x1 = tl.load(lo, mask=valid, other=0.0).to(tl.float32)
        x2 = tl.load(lo + HALF, mask=valid, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * sc_t + offs).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * sc_t + HALF + offs).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * sc_t + offs).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * sc_t + HALF + offs).to(tl.float32)[None, :]
        dtype = q_ptr.dtype.element_ty
        tl.store(lo, (x1 * c1 - x2 * s1).to(dtype), mask=valid)
        tl.store(lo + HALF, (x2 * c2 + x1 * s2).to(dtype), mask=valid)

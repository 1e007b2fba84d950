"""x W^T on x86-64 CPUs by the AVX2/FMA kernel in csrc/cpu/rows_linear.cpp, built on first use: float32,
and bfloat16 on CPUs without bf16 arithmetic (weights widened in registers, sums in float32, the result
rounded once, as torch's), where torch's own bf16 matmul was 6x slower than float32 at 16 rows.

A float32 model's weights that bfloat16 or float16 holds exactly (a half-precision checkpoint run in
float32, as most HF checkpoints and the shipped draft are) are stored in that type, and those that are
exactly the values of llama.cpp's blocks (a GGUF checkpoint's quantized tensors, dequantized) as blocks
(`narrowed`, block_quant): the kernel widens them exactly, so the products are bit-for-bit the float32
ones, from a half to a fifth of the bytes.

Decoding reads every weight once per step for a few rows of activations. oneDNN (even with its packed
weights) did not overlap those reads with the arithmetic: on a 2-core AMD EPYC a (k+1)-row verification
cost 11-46% more than a 1-row step. This kernel reads each weight row once for all rows and prefetches
ahead; it runs 1-row steps faster than oneDNN too, and stays on par up to prefill sizes, so on such CPUs
it serves every float32 linear layer and the weights stay in their plain layout (no blocked copy).

It also sums each output element in the same order whatever the number of rows: a token's logits in a
(k+1)-token verification are bit-for-bit those of a 1-token step.

The kernel is part of the CPU extension that vllm_spec.cpu_ops builds on first use; where it cannot be
built `available()` is False and linear layers use oneDNN / torch as before.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from vllm_spec import cpu_ops
from vllm_spec.model import block_quant
from vllm_spec.model.block_quant import BlockWeight
from vllm_spec.platform import cpu_flags, cpu_has_native_bf16


def handles(x: torch.Tensor, weight: torch.Tensor | BlockWeight) -> bool:
    """Whether linear(x, weight) runs on the kernel: CPU rows of the weight's dtype (or float32 rows and a
    `narrowed` weight), a weight it takes."""
    if (x.device.type != "cpu" or x.shape[-1] != weight.shape[-1]
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):   # (no backward)
        return False
    if isinstance(weight, BlockWeight):
        return x.dtype == torch.float32 and available()
    if x.dtype == weight.dtype:
        return keeps_plain(weight)
    return x.dtype == torch.float32 and weight.dtype in narrow_dtypes() and _plain(weight)


def keeps_plain(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight as it is (a plain, contiguous 2-D CPU weight of a dtype it
    serves here), so it is best left in that layout."""
    # (The device and a dtype it could take first: other models' weights must not build the kernel.)
    return (weight.device.type == "cpu" and weight.dtype in cpu_ops.DTYPES and _plain(weight)
            and weight.dtype in dtypes())


def narrowed(weight: torch.Tensor) -> torch.Tensor | BlockWeight:
    """A float32 weight the kernel takes, as Q4_1 / Q8_0 / U8X16 blocks or a bfloat16 / float16 copy where they hold
    every element exactly (products bit-for-bit the float32 ones, a fifth to a half of the bytes read);
    else the weight itself. One copy per weight: layers sharing it (a tied LM head, a draft's borrowed
    one) share the copy too."""
    if weight.dtype != torch.float32 or not keeps_plain(weight):
        return weight
    version, copy = getattr(weight, _NARROWED, (None, None))   # (kept on the weight: it lives as long)
    if version != weight._version:   # first asked, or the weight was written since
        copy = block_quant.find(weight) or _exact_half(weight)
        setattr(weight, _NARROWED, (weight._version, copy))
    return weight if copy is None else copy


def _exact_half(weight: torch.Tensor) -> torch.Tensor | None:
    for dtype in (torch.bfloat16, torch.float16):   # bfloat16 first: the cheaper widening
        if dtype not in narrow_dtypes():
            continue
        copy = weight.detach().to(dtype)
        if torch.equal(copy.to(torch.float32), weight):
            return copy
    return None


# The attribute of a float32 weight that holds (its version, its narrowed copy or None: nothing narrower holds it).
_NARROWED = "_vllm_spec_narrowed"


def _plain(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and not weight.is_mkldnn and weight.dim() == 2 and weight.is_contiguous()


def available() -> bool:
    """The kernel is built (or was built before) and this CPU runs it."""
    return cpu_ops.available()


@functools.cache
def dtypes() -> frozenset[torch.dtype]:
    """The dtypes the kernel serves here: none without it; bfloat16 only where the CPU has no bf16
    arithmetic (with it, oneDNN's packed bf16 path is the faster one)."""
    if not available():
        return frozenset()
    return frozenset({torch.float32} if cpu_has_native_bf16() else {torch.float32, torch.bfloat16})


@functools.cache
def narrow_dtypes() -> frozenset[torch.dtype]:
    """The half types a float32 model's exact weights may be stored in here (float16 needs F16C)."""
    if not available():
        return frozenset()
    return frozenset({torch.bfloat16, torch.float16} if "f16c" in cpu_flags() else {torch.bfloat16})


def kernel() -> ModuleType:
    """The built extension: rows_linear(x [M, K] float32, w [N, K] float32, bfloat16 or float16) -> [M, N]
    float32, and rows_linear_blocks(x, blocks, format) for a BlockWeight's."""
    return cpu_ops.module()


def linear(x: torch.Tensor, weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for x [..., K], W [N, K]; only where handles(x, weight)."""
    rows = cpu_ops.contiguous_as(x.reshape(-1, x.shape[-1]), torch.float32)
    if isinstance(weight, BlockWeight):
        y = kernel().rows_linear_blocks(rows, weight.blocks, weight.format)
    else:
        y = kernel().rows_linear(rows, weight)
    if bias is not None:
        y.add_(bias)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])

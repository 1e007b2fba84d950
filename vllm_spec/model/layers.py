"""Tensor-parallel building blocks: sharded linears, embedding, LM head, RMSNorm, LayerNorm, activations.

Each parameter carries a `weight_loader(param, full_weight, shard_id)` that copies
only this rank's slice, so checkpoints load shard by shard.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model import block_quant, cpu_linear, gemv
from vllm_spec.model.block_quant import BlockWeight
from vllm_spec.model.fused import add_rms_norm, silu_mul

# The MLP activations (ArchConfig.hidden_act).
ACTIVATION_FNS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
                  "relu": F.relu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({d}).")
    return n // d


def _check_shape(weight: torch.Tensor, expected: tuple[int, ...]) -> None:
    """A checkpoint tensor must have its parameter's full (unsharded) shape: narrowing a larger one
    would load part of it silently."""
    if tuple(weight.shape) != tuple(expected):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the expected {tuple(expected)}")


def _default_loader(param: nn.Parameter, weight: torch.Tensor, shard_id=None) -> None:
    _check_shape(weight, param.shape)
    param.data.copy_(weight)


def linear(x: torch.Tensor, weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b); W may be a copy made by pack_for_cpu."""
    if isinstance(weight, BlockWeight):
        if cpu_linear.handles(x, weight):
            return cpu_linear.linear(x, weight, bias)
        weight = weight.dequantize()   # exactly the float32 weight (autograd; other dtypes fail as they would)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if gemv.eligible(x, weight):
        return gemv.linear(x, weight, bias)
    if cpu_linear.handles(x, weight):
        return cpu_linear.linear(x, weight, bias)
    if x.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
        weight = weight.float()   # a narrowed copy the kernel does not take here (autograd): widened, exactly
    return F.linear(x, weight, bias)


def pack_for_cpu(weight: torch.Tensor, quantize: str | None = None) -> torch.Tensor | BlockWeight:
    """A copy of a linear layer's weight in oneDNN's blocked layout, or the weight itself where that
    does not apply (not on CPU, no oneDNN, a dtype other than float32/bfloat16); for a weight that
    cpu_linear's kernel multiplies faster in the plain layout, the weight or its exact narrower copy
    (half precision or quantized blocks: cpu_linear.narrowed). quantize (ArchConfig.cpu_weights, a
    draft's): the lossy copy quantize_for_cpu makes, where the kernel takes it.

    On CPU this made the matmuls of a SmolLM2-sized model 1.7-2.5x faster at 1-16 rows (bf16 and
    fp32, 2 cores): decoding streams every weight once per step and the plain layout is read slowly.
    """
    quantized = quantize_for_cpu(weight, quantize) if quantize else None
    if quantized is not None:
        return quantized
    if cpu_linear.keeps_plain(weight):
        return cpu_linear.narrowed(weight)
    if (weight.is_mkldnn or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or weight.dtype in _UNPACKABLE or not torch.backends.mkldnn.is_available()):
        return weight
    try:
        return _reorder_linear_weight(weight.detach())
    except RuntimeError:
        # oneDNN's bfloat16 path needs CPU features (AVX-512 BF16 or AVX-NE-CONVERT) that many CPUs lack:
        # the plain layout, for this dtype from then on.
        _UNPACKABLE.add(weight.dtype)
        return weight


_UNPACKABLE: set[torch.dtype] = set()


def quantize_for_cpu(weight: torch.Tensor, fmt: str) -> BlockWeight | None:
    """A float32 weight the CPU kernel multiplies, quantized as ArchConfig.cpu_weights says (lossy: a
    draft's), or None where the kernel does not take it. "q8_0": its nearest Q8_0 values, in the tiles
    whose products round the activations to int8 blocks too (block_quant.int8_tiles; plain Q8_0 blocks
    where the rows do not fill them): llama.cpp's Q8_0 arithmetic, 2.5-3x the float32 products' speed."""
    if fmt != "q8_0" or not cpu_linear.available() or weight.requires_grad:
        return None
    blocks = block_quant.quantize_q8_0(weight)
    return blocks and (block_quant.int8_tiles(blocks) or blocks)


def _reorder_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 16)


class LinearBase(nn.Module):
    """A module whose weight only multiplies activations (so it may be kept packed for the CPU)."""

    weight: nn.Parameter
    packed: torch.Tensor | BlockWeight | None = None
    # The weight may be another module's too (an LM head's may be the embedding, or a target's head
    # a draft borrows): keep it.
    shares_weight = False

    def pack_for_cpu(self, quantize: str | None = None) -> None:
        """Multiply by a packed copy from now on. The plain weight's memory goes unless shared: the
        parameter keeps its shape (parameter counts, names) over a single NaN element, so a stray
        read shows in the output and a late load fails. quantize: see quantize_for_cpu."""
        if self.packed is not None:   # packed already (the plain weight may be gone)
            return
        packed = pack_for_cpu(self.weight, quantize)
        if packed is self.weight:
            return
        self.packed = packed
        if not self.shares_weight:
            self.weight.data = torch.full((1,), float("nan"), dtype=self.weight.dtype).expand(self.weight.shape)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight if self.packed is None else self.packed, bias)


def _param(*shape: int, dtype: torch.dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class ColumnParallelLinear(LinearBase):
    """y = xA^T + b with A's output rows split across ranks; output stays sharded.

    `output_sizes` lists the fused sub-matrices (e.g. gate and up) so each is
    split on its own and a checkpoint's separate tensors land in their slots.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.shard_sizes = [_divide(s, tp.world_size, "linear output size") for s in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = _param(out, input_size, dtype=dtype, loader=self._load)
        self.bias = _param(out, dtype=dtype, loader=self._load) if bias else None

    def _offsets(self, shard_id: int) -> tuple[int, int]:
        return sum(self.shard_sizes[:shard_id]), self.shard_sizes[shard_id]

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            assert len(self.shard_sizes) == 1
            shard_id = 0
        offset, size = self._offsets(shard_id)
        _check_shape(weight, (size * self.tp.world_size, *param.shape[1:]))
        src = weight.narrow(0, self.tp.rank * size, size)
        param.data.narrow(0, offset, size).copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: "RMSNorm") -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x, residual)[0]), x + residual), in one kernel where gemv fuses them."""
        if gemv.fusable(x, self.weight, residual):
            return gemv.norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias)
        x, residual = norm(x, residual)
        return self(x), residual


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when tp > num_kv_heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: GroupCoordinator, dtype: torch.dtype):
        self.num_heads = _divide(num_heads, tp.world_size, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = _divide(num_kv_heads, tp.world_size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp.world_size, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
        self.head_dim = head_dim
        q, kv = self.num_heads * head_dim * tp.world_size, self.num_kv_heads * head_dim * tp.world_size
        super().__init__(hidden, [q, kv, kv], bias, tp, dtype)

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: str | None = None) -> None:
        idx = {"q": 0, "k": 1, "v": 2}[shard_id]
        offset, size = self._offsets(idx)
        replicas = 1 if idx == 0 else self.kv_replicas
        _check_shape(weight, (size * self.tp.world_size // replicas, *param.shape[1:]))
        rank = self.tp.rank // replicas
        param.data.narrow(0, offset, size).copy_(weight.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """y = xA^T + b with A's input columns split across ranks; the partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.in_shard = _divide(input_size, tp.world_size, "linear input size")
        self.weight = _param(output_size, self.in_shard, dtype=dtype, loader=self._load)
        self.bias = _param(output_size, dtype=dtype, loader=_default_loader) if bias else None

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id=None) -> None:
        _check_shape(weight, (param.shape[0], self.in_shard * self.tp.world_size))
        param.data.copy_(weight.narrow(1, self.tp.rank * self.in_shard, self.in_shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Its bias comes after the reduce, so the matmul's bias slot is free for gemv.lt_bias's zeros.
        return self._reduce(self._matmul(x, gemv.lt_bias(x, self.weight)))

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """self(silu_mul(x)) for x = [gate | up], in one kernel where gemv fuses them."""
        if gemv.fusable(x, self.weight):
            return self._reduce(gemv.silu_mul_linear(x, self.weight))
        return self(silu_mul(x))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks (padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden: int, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.shard
        self.weight = _param(self.shard, hidden, dtype=dtype, loader=self._load)

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id=None) -> None:
        _check_shape(weight, (self.vocab_size, *param.shape[1:]))
        rows = weight[self.start: self.start + self.shard]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Output projection sharded over the vocabulary (with a bias where the model has one: Phi's); logits are
    gathered across ranks."""

    shares_weight = True

    def __init__(self, vocab_size: int, hidden: int, tp: GroupCoordinator, dtype: torch.dtype, bias: bool = False):
        super().__init__(vocab_size, hidden, tp, dtype)
        self.bias = _param(self.shard, dtype=dtype, loader=self._load) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self._matmul(hidden, self.bias), dim=-1)
        return logits[..., : self.vocab_size]


def _unit_offset_loader(param: nn.Parameter, weight: torch.Tensor, shard_id=None) -> None:
    _default_loader(param, weight.float() + 1.0)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, then scaled in the model dtype (as HF Llama does),
    fused with the residual add that precedes it. unit_offset: the checkpoint holds each scale
    less 1 (Gemma's), kept here as the scale itself (the same float32 products)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden, dtype=dtype, loader=_unit_offset_loader if unit_offset else _default_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm (OPT's) with nn.LayerNorm's arithmetic; affine=False: no weight or bias."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden, dtype=dtype, loader=_default_loader) if affine else None
        self.bias = _param(hidden, dtype=dtype, loader=_default_loader) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class ReplicatedLinear(LinearBase):
    """y = xA^T + b with the whole of A on every rank (small projections)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(output_size, input_size, dtype=dtype, loader=_default_loader)
        self.bias = _param(output_size, dtype=dtype, loader=_default_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks top_k of num_experts MLPs per
token (Qwen2-MoE adds a shared expert every token takes).

Every expert runs on every token of the batch and the router's weights (zero for the experts a token did not
pick) mix their outputs: no control flow depends on the routing, so the block runs inside CUDA graphs as the
dense MLP does. (vLLM's fused MoE kernels read only the picked experts' weights; that is a GPU speed-up this
engine does not have.) Adding an unpicked expert's exact zero leaves a token's sum as transformers' sum over its
picked experts in expert order, bit for bit (an unpicked expert's output is masked out, so an overflow there
stays out). Under tensor parallelism each rank holds every expert's slice of
the intermediate dimension (as the dense MLP) and the router whole; the experts' partial sums are all-reduced
once (Qwen2-MoE's shared expert reduces its own, as the dense MLP does).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.layers import (
    ACTIVATION_FNS,
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    _check_shape,
    _default_loader,
    _divide,
    _param,
)
from vllm_spec.model.moe_config import LAYOUTS, MoeConfig

# A checkpoint's expert tensor in each layout: experts.{e}.{its gate, up or down name}.
EXPERT_TENSORS = {layout: re.compile(r"\.experts\.(\d+)\.(" + "|".join(names.values()) + r")\.")
                  for layout, (_, names) in LAYOUTS.items()}
# The kind of each expert tensor name (w1 / gate_proj: "gate", ...).
EXPERT_KIND = {name: kind for _, names in LAYOUTS.values() for kind, name in names.items()}


class SparseMoE(nn.Module):
    """Router (gate) + experts; w13 holds each expert's gate and up rows (this rank's slice), w2 its down
    columns."""

    def __init__(self, hidden: int, moe: MoeConfig, act: str, tp: GroupCoordinator, dtype: torch.dtype):
        super().__init__()
        self.tp, self.moe = tp, moe
        self.inter = _divide(moe.intermediate, tp.world_size, "the experts' intermediate size")
        self.act = ACTIVATION_FNS[act]
        self.gate = nn.Module()
        self.gate.weight = _param(moe.num_experts, hidden, dtype=dtype, loader=_default_loader)
        self.w13 = _param(moe.num_experts, 2 * self.inter, hidden, dtype=dtype, loader=self._load)
        self.w2 = _param(moe.num_experts, hidden, self.inter, dtype=dtype, loader=self._load)
        if moe.shared_intermediate:   # (checkpoint names: shared_expert.{gate,up,down}_proj, shared_expert_gate)
            size = moe.shared_intermediate
            self.shared_expert = nn.Module()
            self.shared_expert.gate_up_proj = ColumnParallelLinear(hidden, [size, size], False, tp, dtype)
            self.shared_expert.down_proj = RowParallelLinear(size, hidden, False, tp, dtype)
            self.shared_expert_gate = nn.Module()
            self.shared_expert_gate.weight = _param(1, hidden, dtype=dtype, loader=_default_loader)

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """One expert's gate or up ([intermediate, hidden]: rows of w13) or down ([hidden, intermediate]) tensor."""
        expert, kind = shard_id
        if not 0 <= expert < self.moe.num_experts:
            raise ValueError(f"expert {expert} is not one of the model's {self.moe.num_experts} experts.")
        rows = slice(self.tp.rank * self.inter, (self.tp.rank + 1) * self.inter)
        if kind == "down":
            _check_shape(weight, (param.shape[1], self.inter * self.tp.world_size))
            param.data[expert].copy_(weight[:, rows])
        else:
            _check_shape(weight, (self.inter * self.tp.world_size, param.shape[2]))
            offset = 0 if kind == "gate" else self.inter
            param.data[expert, offset:offset + self.inter].copy_(weight[rows])

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, E] weights: the softmax's top-k (renormalized where the model does), 0 for the experts a token did
        not pick (float32, or the model's dtype where the model rounds them so: the Qwen MoEs); and which it
        picked."""
        probs = F.linear(x, self.gate.weight).float().softmax(dim=-1)
        top, idx = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter_(1, idx, top)
        picked = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, idx, True)
        return weights.to(x.dtype) if self.moe.weights_in_model_dtype else weights, picked

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(MoE of norm(x + residual), x + residual)."""
        x, residual = norm(x, residual)
        weights, picked = self.routing(x)
        out = torch.zeros_like(x)
        for e in range(self.moe.num_experts):
            gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.w2[e])
            # (selected, not multiplied by 0: an expert the token did not pick must not bring its inf or NaN)
            out += torch.where(picked[:, e:e + 1], y * weights[:, e:e + 1], 0).to(x.dtype)
        out = self.tp.all_reduce(out)
        if self.moe.shared_intermediate:
            gate, up = self.shared_expert.gate_up_proj(x).chunk(2, dim=-1)
            shared = self.shared_expert.down_proj(self.act(gate) * up)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return out, residual

"""Mixtral's sparse mixture-of-experts MLP: a router picks num_experts_per_tok of num_experts MLPs per token.

Every expert runs on every token of the batch and the router's weights (zero for the experts a token did not
pick) mix their outputs: no control flow depends on the routing, so the block runs inside CUDA graphs as the
dense MLP does. (vLLM's fused MoE kernels read only the picked experts' weights; that is a GPU speed-up this
engine does not have.) Adding an unpicked expert's exact zero leaves a token's sum as transformers' sum over its
picked experts in expert order, bit for bit. Under tensor parallelism each rank holds every expert's slice of
the intermediate dimension (as the dense MLP) and the router whole; the partial sums are all-reduced once.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model.layers import RMSNorm, _check_shape, _default_loader, _divide, _param

# A checkpoint's expert tensor: experts.{e}.w1 (gate), w3 (up), w2 (down).
EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(w[123])\.")


class MixtralMoE(nn.Module):
    """Router (gate) + experts; w13 holds each expert's gate and up rows (this rank's slice), w2 its down
    columns."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str, tp: GroupCoordinator,
                 dtype: torch.dtype):
        super().__init__()
        self.tp, self.num_experts, self.top_k = tp, num_experts, top_k
        self.act = F.silu if act == "silu" else functools.partial(F.gelu, approximate="tanh")
        self.inter = _divide(intermediate, tp.world_size, "intermediate_size")
        self.gate = nn.Module()
        self.gate.weight = _param(num_experts, hidden, dtype=dtype, loader=_default_loader)
        self.w13 = _param(num_experts, 2 * self.inter, hidden, dtype=dtype, loader=self._load)
        self.w2 = _param(num_experts, hidden, self.inter, dtype=dtype, loader=self._load)

    def _load(self, param: nn.Parameter, weight: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """One expert's w1 / w3 ([intermediate, hidden]: rows of w13) or w2 ([hidden, intermediate])."""
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is not one of the model's num_local_experts ({self.num_experts}).")
        rows = slice(self.tp.rank * self.inter, (self.tp.rank + 1) * self.inter)
        if kind == "w2":
            _check_shape(weight, (param.shape[1], self.inter * self.tp.world_size))
            param.data[expert].copy_(weight[:, rows])
        else:
            _check_shape(weight, (self.inter * self.tp.world_size, param.shape[2]))
            offset = 0 if kind == "w1" else self.inter
            param.data[expert, offset:offset + self.inter].copy_(weight[rows])

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] float32 weights: the softmax's top-k renormalized, 0 for the experts a token did not pick."""
        probs = F.linear(x, self.gate.weight).float().softmax(dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        return torch.zeros_like(probs).scatter_(1, idx, top / top.sum(dim=-1, keepdim=True))

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(MoE of norm(x + residual), x + residual)."""
        x, residual = norm(x, residual)
        weights = self.routing(x)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.w2[e])
            out += (y * weights[:, e:e + 1]).to(x.dtype)
        return self.tp.all_reduce(out), residual

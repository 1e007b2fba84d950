"""Routing in the tensor-parallel linears."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_spec.distributed.parallel_state import GroupCoordinator
from vllm_spec.model import gemv
from vllm_spec.model.layers import ColumnParallelLinear, RowParallelLinear


def test_only_row_parallel_linears_multiply_with_lt_bias(monkeypatch):
    """A row-parallel linear's matmul takes what gemv.lt_bias gives (cuBLASLt's zeros on a GPU; a stand-in
    here so that the product shows it), its own bias still added after the reduce; a column-parallel
    linear's shards (deep ones too: q/k/v at tp 4) never ask."""
    stand_in = torch.randn(8)
    asked = []
    monkeypatch.setattr(gemv, "lt_bias", lambda x, w: asked.append(w) or stand_in)
    row = RowParallelLinear(24, 8, True, GroupCoordinator(), torch.float32)
    for p in (row.weight, row.bias):
        p.data.normal_()
    x = torch.randn(5, 24)
    torch.testing.assert_close(row(x), F.linear(x, row.weight, stand_in) + row.bias)
    assert asked == [row.weight]
    column = ColumnParallelLinear(24, [8], False, GroupCoordinator(), torch.float32)
    column.weight.data.normal_()
    torch.testing.assert_close(column(x), F.linear(x, column.weight))
    assert len(asked) == 1

"""Shared helpers: to_device gives what torch.tensor gives, whatever the route it takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_spec.utils import to_device

CASES = [
    ([0.5, -1.25, float("nan"), float("inf")], torch.float32),
    ([True, False, True], torch.bool),
    (list(range(-3, 300)), torch.long),
    ((7, 8, 9), torch.int32),
    ([[1, 2], [3, 4]], torch.long),
    ([], torch.long),
    ([], torch.float32),
    ([1.5, 2.25], torch.bfloat16),   # no numpy dtype: torch converts
    ([0.1, 0.2], torch.float64),
    ([True, 3, 0], torch.long),
]


@pytest.mark.parametrize("values,dtype", CASES)
def test_to_device_equals_torch_tensor(values, dtype):
    got = to_device(values, torch.device("cpu"), dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.isnan(got.float()).tolist() == torch.isnan(want.float()).tolist()


def test_to_device_never_aliases_a_numpy_input():
    host = np.arange(4, dtype=np.int64)
    got = to_device(host, torch.device("cpu"))
    host[0] = 99
    assert got.tolist() == [0, 1, 2, 3]

"""Shared helpers: to_device gives what torch.tensor gives, whatever the route it takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_spec.utils import KeptForIds, to_device

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


def test_kept_for_ids_serves_a_value_again_only_for_the_same_ids_in_the_same_order():
    kept, built = KeptForIds(), []
    def build(value):
        return lambda: (built.append(value), value)[1]
    assert kept.get([1, 2], build("a")) == "a"
    assert kept.get([1, 2], build("b")) == "a"        # the same ids: not built again
    assert kept.get([2, 1], build("c")) == "c"        # another order is another batch
    assert kept.get([2, 1, 3], build("d")) == "d"
    assert kept.get([2, 1, 3], build("e")) == "d"
    assert built == ["a", "c", "d"]

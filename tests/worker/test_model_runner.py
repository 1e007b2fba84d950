"""ModelRunner's host-to-device packing: several int64 arrays sent as one buffer."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_spec.worker.model_runner import _ALIGN, ragged_grid, to_device_aligned


@pytest.mark.parametrize("seed", range(4))
def test_to_device_aligned_gives_each_part_as_an_aligned_view_of_one_buffer(seed):
    rng = random.Random(seed)
    for _ in range(50):
        parts = [np.array([rng.randrange(-9, 1000) for _ in range(rng.choice([0, 1, 7, 8, 9, 33]))], dtype=np.int64)
                 for _ in range(rng.randint(1, 7))]
        views = to_device_aligned(parts, torch.device("cpu"))
        assert [v.tolist() for v in views] == [p.tolist() for p in parts]
        assert all(v.dtype == torch.int64 and v.storage_offset() % _ALIGN == 0 for v in views)
        if any(len(p) for p in parts):   # one buffer behind them all
            assert len({v.untyped_storage().data_ptr() for v in views}) == 1


def test_to_device_aligned_with_every_part_empty():
    views = to_device_aligned([np.zeros(0, dtype=np.int64)] * 3, torch.device("cpu"))
    assert [v.numel() for v in views] == [0, 0, 0]


def test_ragged_grid():
    rows, offsets = ragged_grid(np.array([2, 0, 3]))
    assert rows.tolist() == [0, 0, 2, 2, 2] and offsets.tolist() == [0, 1, 0, 1, 2]

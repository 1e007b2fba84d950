"""Token counts a pass runs well at: padding to a faster count, and the start-up profile (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_spec.model.layers import LinearBase
from vllm_spec.worker.token_counts import GRID, MAX_PAD, TokenPadding, profile_linear


def _padding(slow: dict[int, float]) -> TokenPadding:
    counts = np.arange(GRID, 1024 + GRID, GRID)
    return TokenPadding(counts, counts * 1e-5 * np.array([slow.get(int(c), 1.0) for c in counts]))


def test_a_slow_count_runs_at_the_fastest_count_a_little_above():
    padding = _padding({448: 1.45, 416: 1.1})
    assert padding.padded(448, limit=1024) == 464         # the next count, 3.6% more tokens for 31% less time
    assert padding.padded(440, limit=1024) == 464          # (off the grid: timed as the count above)
    assert padding.padded(384, limit=1024) == 384          # fast already
    assert padding.padded(448, limit=450) == 448           # not past the limit
    assert padding.padded(400, limit=1024) == 400          # within MIN_GAIN: no padding for 1-4%


def test_padding_stays_within_its_share_of_the_tokens():
    # 64 tokens cost as much as 128: padding to 80 (1.25x) is the most allowed, and it pays.
    padding = _padding({64: 2.0})
    assert padding.padded(64, limit=1024) == 80
    assert padding.padded(64, limit=1024) <= 64 * MAX_PAD
    assert padding.seconds_at(1) == padding.seconds_at(GRID) and padding.seconds_at(5000) == padding.seconds[-1]


class _Linear(LinearBase):
    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16),
                                         requires_grad=False)


@pytest.mark.gpu
def test_profile_times_every_count_of_a_layers_matmuls():
    layer = torch.nn.Sequential(_Linear(96, 64), _Linear(64, 96))
    padding = profile_linear(layer, 200)
    assert padding.counts.tolist() == list(range(GRID, 208 + 1, GRID))
    assert (padding.seconds > 0).all() and np.isfinite(padding.seconds).all()

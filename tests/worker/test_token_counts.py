"""Token counts a pass runs well at: padding to a faster count, and the start-up profile (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_spec.model.layers import LinearBase
from vllm_spec.worker.token_counts import GRID, MAX_PAD, MIN_ROWS, TokenPadding, profile_linear


def _padding(slow: dict[int, float]) -> TokenPadding:
    counts = np.arange(MIN_ROWS + GRID, 1024 + GRID, GRID)   # (what profile_linear keeps of a grid)
    return TokenPadding(counts, counts * 1e-5 * np.array([slow.get(int(c), 1.0) for c in counts]))


def test_a_slow_count_runs_at_the_fastest_count_a_little_above():
    padding = _padding({448: 1.45, 416: 1.1})
    assert padding.padded(448, limit=1024) == 464         # the next count, 3.6% more tokens for 31% less time
    assert padding.padded(440, limit=1024) == 464          # (off the grid: timed as the count above)
    assert padding.padded(384, limit=1024) == 384          # fast already
    assert padding.padded(448, limit=450) == 448           # not past the limit
    assert padding.padded(400, limit=1024) == 400          # within MIN_GAIN: no padding for 1-4%


def test_padding_stays_within_its_share_of_the_tokens():
    # 128 tokens cost as much as 256: the next count pays. Slow up to 160 (1.25x): 176 is too far.
    assert _padding({128: 2.0}).padded(128, limit=1024) == 144
    assert _padding({128: 2.0, 144: 2.0, 160: 2.0}).padded(128, limit=1024) == 128 < 176 / MAX_PAD


def test_counts_of_the_fused_small_row_kernels_are_left_alone():
    """Up to MIN_ROWS tokens the model runs other kernels than the matmuls profiled: not covered, never
    padded (nor past the largest count profiled)."""
    padding = _padding({MIN_ROWS: 3.0, MIN_ROWS + GRID: 3.0})
    assert not padding.covers(MIN_ROWS) and padding.padded(MIN_ROWS, limit=1024) == MIN_ROWS
    assert padding.covers(MIN_ROWS + 1) and not padding.covers(int(padding.counts[-1]) + 1)


class _Linear(LinearBase):
    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16),
                                         requires_grad=False)


@pytest.mark.gpu
def test_profile_times_every_count_of_a_layers_matmuls():
    layer = torch.nn.Sequential(_Linear(96, 64), _Linear(64, 96))
    padding = profile_linear(layer, [200, 16, 120, 200, MIN_ROWS + 8])
    assert padding.counts.tolist() == [MIN_ROWS + 8, 120, 200]   # past MIN_ROWS, once each, ascending
    assert (padding.seconds > 0).all() and np.isfinite(padding.seconds).all()

"""StagingBuffer: the fixed part and the block tables reach the device as written on the host, the
tables as whole rows (one copy) or, past the size limit, as a compact block copied into place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_spec.attention.metadata import NULL_BLOCK
from vllm_spec.worker import staging
from vllm_spec.worker.staging import StagingBuffer

FIXED, ROWS, MAX_BLOCKS = 10, 16, 7


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("full_rows_max", [0, 40, 1 << 20])   # always compact, either, always whole rows
def test_send_writes_fixed_part_and_tables(device, full_rows_max, monkeypatch):
    monkeypatch.setattr(staging, "_FULL_ROWS_MAX", full_rows_max)
    buf = StagingBuffer(FIXED, ROWS, MAX_BLOCKS, torch.device(device))
    rng = np.random.default_rng(0)
    for step in range(30):
        fixed = rng.integers(0, 1000, FIXED)
        buf.host()[:FIXED] = fixed
        B = int(rng.integers(0, ROWS + 1))
        rows = int(rng.integers(B, ROWS + 1))
        width = int(rng.integers(1, MAX_BLOCKS + 1))
        tables = rng.integers(1, 500, (B, width))
        buf.send(tables, rows)
        assert buf.device[:FIXED].tolist() == fixed.tolist(), step
        got = buf.tables.cpu()
        assert got[:B, :width].tolist() == tables.tolist(), step
        assert (got[B:rows, :width] == NULL_BLOCK).all(), step   # padding rows: the null block
        buf.host()[:FIXED] = 0
        buf.send()   # the fixed part alone leaves the tables as they were
        assert (buf.device[:FIXED] == 0).all() and torch.equal(buf.tables.cpu(), got), step

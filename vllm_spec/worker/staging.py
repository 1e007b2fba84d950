"""Static int64 inputs of a CUDA graph, written through a host mirror and sent in one copy.

On the H200's host every call that queues device work costs tens of microseconds: a step whose
inputs live in one buffer, written in place on the host (pinned memory) and sent by ONE
asynchronous copy, pays for one such call instead of one per input tensor. The mirror is
written while earlier copies may still be queued; an event recorded after each send says when
the copies have read it, so a write never races the copy before it.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_spec.attention.metadata import NULL_BLOCK

# Block tables go as whole rows of max_blocks (the static table's layout: one copy with the rest)
# while that stays this small; past it (long contexts, large batches) the rows' used columns go as
# a compact block, copied into place on the device: two copies more, a fraction of the bytes.
_FULL_ROWS_MAX = 1 << 15


class StagingBuffer:
    """A device buffer [fixed part | block tables (rows x max_blocks)] and its host mirror of the same
    layout; `host()` is the mirror to write, `send` queues the copies. Compact tables go through a
    device scratch allocated on first use (short contexts never need it)."""

    def __init__(self, fixed: int, rows: int, max_blocks: int, device: torch.device):
        self.fixed, self.max_blocks = fixed, max_blocks
        size = fixed + rows * max_blocks
        self.device = torch.zeros(size, dtype=torch.long, device=device)
        self.tables = self.device[fixed:].view(rows, max_blocks)
        self._compact: torch.Tensor | None = None
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host_array = self._host.numpy()
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self._in_flight = False
        self._prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # stop -> (device, host) views

    def host(self) -> np.ndarray:
        """The mirror, to write into: waits (rarely) until the last send has read it."""
        if self._in_flight:
            self._sent.synchronize()
            self._in_flight = False
        return self._host_array

    def send(self, tables: np.ndarray | None = None, rows: int = 0) -> None:
        """Queue the fixed part's copy and, given `tables` [B, width], the block tables of rows
        [0, rows): B real rows, then null ones (padding). Call after writing the fixed part into
        host(); returns at once. Columns past `width` keep older ids: no row reads past its length."""
        host, fixed = self.host(), self.fixed
        if tables is None or rows == 0:
            self._send_prefix(fixed)
        else:
            B, width = tables.shape
            W = self.max_blocks
            if rows * W <= _FULL_ROWS_MAX:
                block = host[fixed: fixed + rows * W].reshape(rows, W)
                block[:B, :width] = tables
                block[B:] = NULL_BLOCK
                self._send_prefix(fixed + rows * W)
            else:
                host[fixed: fixed + B * width] = tables.ravel()
                host[fixed + B * width: fixed + rows * width] = NULL_BLOCK
                if self._compact is None:
                    self._compact = torch.empty(self.tables.numel(), dtype=torch.long, device=self.device.device)
                self._compact[: rows * width].copy_(self._host[fixed: fixed + rows * width], non_blocking=True)
                self._send_prefix(fixed)
                self.tables[:rows, :width].copy_(self._compact[: rows * width].view(rows, width))
        if self._sent is not None:
            self._sent.record()
            self._in_flight = True

    def _send_prefix(self, stop: int) -> None:
        views = self._prefixes.get(stop)
        if views is None:   # the same few lengths come back step after step: sliced once each
            views = self._prefixes[stop] = (self.device[:stop], self._host[:stop])
        views[0].copy_(views[1], non_blocking=True)

"""An int64 device buffer written through a host mirror and sent in one copy.

On the H200's host every call that queues device work costs tens of microseconds: a step
whose inputs live in one buffer, written in place on the host (pinned memory) and sent by ONE
asynchronous copy, pays for one such call instead of one per input tensor. The mirror is
written while earlier copies may still be queued; an event recorded after each send says when
the copy has read it, so a write never races the copy before it.
"""

from __future__ import annotations

import numpy as np
import torch


class StagingBuffer:
    """`device` [size] int64 and its host mirror; send(stop) copies the mirror's first stop entries."""

    def __init__(self, size: int, device: torch.device):
        self.device = torch.zeros(size, dtype=torch.long, device=device)
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host_array = self._host.numpy()
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self._in_flight = False

    def host(self) -> np.ndarray:
        """The mirror, to write into: waits (rarely) until the last send has read it."""
        if self._in_flight:
            self._sent.synchronize()
            self._in_flight = False
        return self._host_array

    def send(self, stop: int) -> None:
        """Queue the copy of the mirror's [0, stop) into the device buffer; returns at once."""
        self.device[:stop].copy_(self._host[:stop], non_blocking=True)
        if self._sent is not None:
            self._sent.record()
            self._in_flight = True

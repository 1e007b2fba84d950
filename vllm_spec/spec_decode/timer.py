"""Draft and verify time of one step: CUDA events on the GPU (the host only enqueues), a clock on CPU."""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Marks the end of the draft phase; finish() returns (draft, verify) seconds.

    Call finish() after the step's device->host copy: by then the events have completed.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        self.marks.append(self._now())

    def finish(self) -> tuple[float, float]:
        start, mid, end = self.marks[0], self.marks[1], self._now()
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(mid) / 1e3, mid.elapsed_time(end) / 1e3
        return mid - start, end - mid

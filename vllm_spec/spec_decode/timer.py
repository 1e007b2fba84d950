"""Phase times of one step: CUDA events on the GPU (the host only enqueues), a clock on CPU."""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Marks the end of each phase of a step; finish() returns the seconds each phase took.

    Mark the last phase's end when its work is queued; call finish() once the step's outputs
    reached the host (by then the events have completed).
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

    def mark(self, queued: bool = True, last: torch.cuda.Event | None = None) -> None:
        """End the current phase. Each event recorded costs the host tens of microseconds while the device
        runs, so none is where one exists: queued=False, the phase queued no device work (it took no
        time there); `last`, an event with timing just recorded after the phase's last work."""
        if last is not None:
            self.marks.append(last)
        else:
            self.marks.append(self._now() if queued or not self.cuda else self.marks[-1])

    def finish(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

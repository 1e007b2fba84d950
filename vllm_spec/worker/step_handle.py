"""A launched step: its device work is queued; its outputs reach the host when asked for.

With async scheduling the engine schedules and launches step N+1 before it reads step N's
outputs, so the host's work overlaps the device's. That is only possible when step N emits
exactly one token per sampled sequence (the engine then knows every sequence's length without
the tokens themselves); a handle says whether its step does.
"""

from __future__ import annotations

import time

import torch

from vllm_spec.worker.batch import StepOutput


class StepHandle:
    """One launched step. `result()` waits for the device and returns the step's outputs (once
    computed, the same object on every call)."""

    # Every sampled sequence gets exactly one token (no speculation): the next step may be
    # scheduled before this one's tokens are read.
    one_token_per_seq: bool = False

    def result(self) -> StepOutput:
        raise NotImplementedError


class DoneStep(StepHandle):
    """A step that ran to completion on launch (speculative steps, executors without overlap), or
    one that samples nothing (`one_token_per_seq`: vacuously, so the next step may overlap it)."""

    def __init__(self, output: StepOutput, one_token_per_seq: bool = False):
        self._output = output
        self.one_token_per_seq = one_token_per_seq

    def result(self) -> StepOutput:
        return self._output


class DeviceSpan:
    """The device-clock span of a step's queued work: begun at construction, ended by end()."""

    def __init__(self, device: torch.device):
        self._start = self._end = None
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end(self, last: "HostCopy | None" = None) -> None:
        """End the span now, or where `last` (the step's last device work, just queued; a timed
        copy) ends: its event serves both (one event less to record per step on the H200)."""
        if self._start is None:
            return
        if last is not None:
            self._end = last.event
        else:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()

    def seconds(self) -> float:
        """The span, once the step's outputs reached the host (0 on CPU)."""
        if self._start is None:
            return 0.0
        return self._start.elapsed_time(self._end) / 1e3


class HostCopy:
    """A device tensor's copy to the host, started now without waiting; `values()` waits for it.
    `event` (CUDA) is recorded right after the copy; `timed`: with timing enabled, so that it may
    end a DeviceSpan."""

    def __init__(self, t: torch.Tensor, timed: bool = False):
        self.event = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=timed)
            self.event.record()
        else:   # a copy still: the values are those of now, whatever is written into t later
            self._host = t.clone()
        self._values: list | None = None
        self.wait_time = 0.0   # seconds the host waited for the device

    def values(self) -> list:
        if self._values is None:
            start = time.perf_counter()
            if self.event is not None:
                self.event.synchronize()
            self._values = self._host.tolist()
            self.wait_time = time.perf_counter() - start
        return self._values

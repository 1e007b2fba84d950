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
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def end(self) -> None:
        if self._events is not None:
            self._events[1].record()

    def seconds(self) -> float:
        """The span, once the step's outputs reached the host (0 on CPU)."""
        if self._events is None:
            return 0.0
        return self._events[0].elapsed_time(self._events[1]) / 1e3


class HostCopy:
    """A device tensor's copy to the host, started now without waiting; `values()` waits for it."""

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = t, None
        self._values: list | None = None
        self.wait_time = 0.0   # seconds the host waited for the device

    def values(self) -> list:
        if self._values is None:
            start = time.perf_counter()
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
            self.wait_time = time.perf_counter() - start
        return self._values

"""vLLM's start_profile / stop_profile: a torch profiler trace of the engine's process (its host work and
the in-process worker's kernels; workers of other tensor-parallel ranks are not traced), written to
$VLLM_TORCH_PROFILER_DIR for TensorBoard or Perfetto. VLLM_TORCH_PROFILER_RECORD_SHAPES and
VLLM_TORCH_PROFILER_WITH_STACK (0 or 1) choose what each event records."""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "1" if default else "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}.")
    return value == "1"


class EngineProfiler:
    """One trace at a time, from start() to stop()."""

    def __init__(self):
        self._profile: profile | None = None

    def start(self) -> None:
        directory = os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not directory:
            raise RuntimeError("the profiler is not enabled: set VLLM_TORCH_PROFILER_DIR to the directory its "
                               "traces go to.")
        if self._profile is not None:
            raise RuntimeError("the profiler is already running: stop_profile() first.")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(activities=activities, record_shapes=_flag("VLLM_TORCH_PROFILER_RECORD_SHAPES", False),
                                with_stack=_flag("VLLM_TORCH_PROFILER_WITH_STACK", True),
                                on_trace_ready=tensorboard_trace_handler(directory, use_gzip=True))
        self._profile.start()

    def stop(self) -> None:
        if self._profile is None:
            raise RuntimeError("the profiler is not running: start_profile() first.")
        running, self._profile = self._profile, None
        running.stop()   # writes the trace

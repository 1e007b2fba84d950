"""StepTimer on CUDA: phases that queued nothing record no event, and an event just recorded can end a phase."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.spec_decode.timer import StepTimer

pytestmark = pytest.mark.gpu


def test_marks_reuse_events_where_they_can():
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    timer = StepTimer(device)
    timer.mark(queued=False)              # nothing queued: the start event again, a phase of 0 s
    for _ in range(20):
        a = a @ a / 2048
    timer.mark()
    done = torch.cuda.Event(enable_timing=True)
    a.sum()
    done.record()
    timer.mark(last=done)
    assert timer.marks[1] is timer.marks[0] and timer.marks[3] is done
    idle, work, tail = timer.finish()
    assert idle == 0.0 and work > 0.0 and tail >= 0.0

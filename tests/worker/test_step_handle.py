"""HostCopy (a step's one device->host copy) and DeviceSpan (its span on the device's clock)."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.worker.step_handle import DeviceSpan, HostCopy


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_copy_values_and_the_span_it_ends(device):
    span = DeviceSpan(torch.device(device))
    t = torch.arange(37, device=device) * 3
    if device == "cuda":   # some device work inside the span
        big = torch.randn(2048, 2048, device=device)
        for _ in range(8):
            big = big @ big.T / 2048
    copy = HostCopy(t, timed=True)
    span.end(copy)
    t.fill_(-1)   # written after the copy was queued: the copy holds the values before
    assert copy.values() == list(range(0, 111, 3))
    assert copy.values() is copy.values() and copy.wait_time >= 0.0
    if device == "cpu":
        assert span.seconds() == 0.0
    else:
        assert span._end is copy.event   # one event serves the copy and the span
        assert span.seconds() > 0.0


@pytest.mark.gpu
def test_a_span_ended_without_a_copy_records_its_own_end():
    span = DeviceSpan(torch.device("cuda"))
    torch.randn(1024, 1024, device="cuda").sum()
    span.end()
    torch.cuda.synchronize()
    assert span.seconds() > 0.0

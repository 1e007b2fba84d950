"""HostCopy (a step's one device->host copy), its PinnedBuffers, and DeviceSpan (its span on the device's clock)."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.worker.step_handle import DeviceSpan, HostCopy, PinnedBuffers


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_copy_values_and_the_span_it_ends(device):
    span = DeviceSpan(torch.device(device))
    t = torch.arange(37, device=device) * 3
    if device == "cuda":   # some device work inside the span
        big = torch.randn(2048, 2048, device=device)
        for _ in range(8):
            big = big @ big.T / 2048
    copy = HostCopy(t, PinnedBuffers(), timed=True)
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


@pytest.mark.gpu
def test_copies_reuse_the_buffers_read_and_never_share_one_unread():
    buffers = PinnedBuffers()
    first = HostCopy(torch.arange(256 * 5, device="cuda").view(256, 5), buffers)
    held = first._buffer
    # Unread, its buffer is in use: a second copy in flight gets another one.
    second = HostCopy(torch.full((201, 5), 7, device="cuda"), buffers)
    smaller = second._buffer
    assert smaller.data_ptr() != held.data_ptr() and len(held) == 16384 and len(smaller) == 8192
    assert first.values() == torch.arange(256 * 5).view(256, 5).tolist()
    assert second.values() == [[7] * 5] * 201
    # Both read: a smaller output (a shrinking batch) takes the smallest of theirs that fits, no new
    # page-locked allocation; a larger one then finds the other.
    third = HostCopy(torch.ones(170, 5, dtype=torch.long, device="cuda"), buffers)
    assert third._buffer.data_ptr() == smaller.data_ptr()
    fourth = HostCopy(torch.ones(250, 5, dtype=torch.long, device="cuda"), buffers)
    assert fourth._buffer.data_ptr() == held.data_ptr()
    assert third.values() == [[1] * 5] * 170 and fourth.values() == [[1] * 5] * 250
    assert len(buffers._free) == 2


@pytest.mark.gpu
def test_buffers_are_powers_of_two_that_fit_any_element_type():
    buffers = PinnedBuffers()
    assert len(buffers.take(1)) == 4096
    assert len(buffers.take(4097)) == 8192
    b = buffers.take(8040)
    assert len(b) == 8192 and b.is_pinned()
    buffers.give(b)
    assert buffers.take(6800).data_ptr() == b.data_ptr()
    copy = HostCopy(torch.tensor([0.5, -2.0], dtype=torch.float64, device="cuda"), buffers)
    assert copy.values() == [0.5, -2.0]


def test_buffers_given_back_are_taken_smallest_fit_first():
    buffers = PinnedBuffers()   # (fed plain buffers: the choice among kept ones needs no device)
    big, small = torch.empty(16384, dtype=torch.uint8), torch.empty(8192, dtype=torch.uint8)
    buffers.give(big)
    buffers.give(small)
    assert buffers.take(6800) is small
    buffers.give(small)
    assert buffers.take(8192) is small
    assert buffers.take(8193) is big
    assert buffers._free == []

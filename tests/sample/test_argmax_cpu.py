"""The CPU sampler's row argmax (csrc/cpu/argmax.cpp): torch.argmax's answer on every row, ties, NaN,
infinities and signed zeros included."""

from __future__ import annotations

import pytest
import torch

from vllm_spec import cpu_ops
from vllm_spec.sample.argmax import argmax_rows

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no AVX2 CPU kernel here (or not buildable)")


@needs_kernel
@pytest.mark.parametrize("V", [1, 3, 7, 8, 9, 15, 16, 17, 100, 49152])
def test_the_first_maximum_as_torch(V):
    gen = torch.Generator().manual_seed(V)
    for trial in range(12):
        # small integers: ties everywhere (the first maximal index must win, across vector lanes too)
        x = torch.randint(-3, 4, (6, V), generator=gen).float() if trial % 3 == 0 else torch.randn(6, V, generator=gen)
        if trial % 4 == 1:   # NaN counts as the maximum: the first one wins
            x[torch.rand(6, V, generator=gen) < 0.05] = float("nan")
            x[3, V // 2] = float("nan")
        x[1] = -float("inf")
        x[2] = 0.0
        x[2, ::3] = -0.0
        x[4, -1] = float("inf")
        assert torch.equal(argmax_rows(x), x.argmax(-1)), trial
    strided = torch.randn(6, V + 5, generator=gen)[:, 2:2 + V]   # rows with a stride of their own
    assert torch.equal(argmax_rows(strided), strided.argmax(-1))


@needs_kernel
def test_no_rows_and_other_dtypes():
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(-1))   # (torch's, as before)
    with pytest.raises(RuntimeError, match="1 to 2"):
        cpu_ops.module().argmax_rows(torch.empty(2, 0))


def test_other_devices_never_build_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_ops, "available", lambda: pytest.fail("the CPU kernels were asked for"))
    x = torch.empty(2, 16, device="meta")
    assert argmax_rows(x).shape == (2,)

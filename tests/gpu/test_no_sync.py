"""Mid-step host->device copies must not synchronise the stream (the GPU would idle while the host works)."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.sample.metadata import SamplingMetadata, SamplingRow
from vllm_spec.sampling_params import SamplingParams
from vllm_spec.utils import to_device

pytestmark = pytest.mark.gpu


def test_sampling_metadata_and_index_lists_do_not_synchronise():
    dev = torch.device("cuda")
    rows = [SamplingRow(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, presence_penalty=0.5,
                                       min_tokens=3, extra_args={"synthetic_acceptance_rate": 0.5}),
                        [1, 2, 3], [4], None),
            SamplingRow(SamplingParams(temperature=0), [5], [], None)]
    rows[0].params.all_stop_token_ids = {2}
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = SamplingMetadata.build(rows, 32, dev)
        index = to_device([0, 1, 1], dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert md.temperature.device.type == "cuda" and index.tolist() == [0, 1, 1]
    assert md.top_k.tolist() == [5, 32] and md.banned_tokens.tolist() == [2]

"""Request models -> SamplingParams: what the engine is asked to return per step."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from vllm_spec.entrypoints.openai.protocol_chat import ChatCompletionRequest
from vllm_spec.entrypoints.openai.protocol_completion import CompletionRequest
from vllm_spec.sampling_params import RequestOutputKind


@pytest.mark.parametrize("stream, kind", [(False, RequestOutputKind.FINAL_ONLY), (True, RequestOutputKind.CUMULATIVE),
                                          (None, RequestOutputKind.FINAL_ONLY)])
def test_output_kind_follows_stream(stream, kind):
    completion = CompletionRequest(model="m", prompt="hi", stream=stream, n=2, max_tokens=4)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=stream)
    for params in (completion.to_sampling_params(), chat.to_sampling_params()):
        assert params.output_kind is kind
    assert completion.to_sampling_params().n == 2

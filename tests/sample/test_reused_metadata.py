"""ReusedMetadata: a batch's sampling metadata serves again only for the same sequences, in the
same order, and only when it does not follow their tokens."""

from __future__ import annotations

import torch

from vllm_spec.sample.metadata import ReusedMetadata, SamplingMetadata, SamplingRow
from vllm_spec.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _builder(params: SamplingParams, calls: list[int], for_draft: bool = False):
    def build() -> SamplingMetadata:
        calls.append(1)
        return SamplingMetadata.build([SamplingRow(params, [1, 2], [3], None)] * 2, 50, CPU, for_draft)
    return build


def test_kept_for_the_same_sequences_only():
    reused, calls = ReusedMetadata(), []
    build = _builder(SamplingParams(temperature=0.7, top_k=5), calls)
    first = reused.get([4, 9], build)
    assert reused.get([4, 9], build) is first and len(calls) == 1
    assert reused.get([9, 4], build) is not first and len(calls) == 2   # same rows, another order
    assert reused.get([9, 4, 11], build) is not None and len(calls) == 3


def test_metadata_that_follows_tokens_is_built_every_time():
    reused, calls = ReusedMetadata(), []
    penalized = SamplingParams(temperature=0.7, presence_penalty=0.5)
    first = reused.get([4, 9], _builder(penalized, calls))
    assert first.follows_tokens and reused.get([4, 9], _builder(penalized, calls)) is not first
    # A draft's metadata leaves penalties out: it does not follow tokens and is kept.
    draft = reused.get([4, 9], _builder(penalized, calls, for_draft=True))
    assert not draft.follows_tokens and reused.get([4, 9], _builder(penalized, calls, for_draft=True)) is draft


def test_min_tokens_follow_tokens_only_while_a_row_is_short_of_them():
    reused, calls = ReusedMetadata(), []
    params = SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=[7])

    def build(outputs: list[int]):
        def make() -> SamplingMetadata:
            calls.append(1)
            return SamplingMetadata.build([SamplingRow(params, [1, 2], outputs, None)], 50, CPU)
        return make

    short = reused.get([4], build([3]))
    assert short.follows_tokens and short.banned_rows is not None
    met = reused.get([4], build([3, 5]))   # rebuilt, and now min_tokens is met
    assert met is not short and len(calls) == 2
    assert not met.follows_tokens and met.banned_rows is None
    assert reused.get([4], build([3, 5, 6])) is met and len(calls) == 2

"""Incremental detokenization: the streaming (DecodeStream) path gives the text the window path gives."""

from __future__ import annotations

import random

import pytest

from vllm_spec.core.sequence import Sequence
from vllm_spec.engine.output_processor import OutputProcessor
from vllm_spec.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_llama))


def _text(processor: OutputProcessor, prompt: list[int], output: list[int], stream: bool, skip: bool) -> str:
    params = SamplingParams(max_tokens=len(output), ignore_eos=True, skip_special_tokens=skip)
    seq = Sequence("r", 0, list(prompt), params, len(output))
    processor.start(seq)
    if not stream:
        seq.detok_stream = None
    for t in output:
        processor.append(seq, [t], None)
    return seq.output_text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_stream_matches_window_detokenization(tokenizer, skip, seed):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    processor = OutputProcessor(tokenizer, set(), 10_000)
    prompt = tokenizer("def wrap(text, width=70): é ü 中").input_ids[: rng.randrange(1, 12)]
    # Random ids include special tokens and byte tokens that only form characters together.
    output = [rng.randrange(vocab) for _ in range(40)]
    streamed = _text(processor, prompt, output, stream=True, skip=skip)
    windowed = _text(processor, prompt, output, stream=False, skip=skip)
    assert streamed == windowed and streamed


def test_stream_is_used_for_fast_tokenizers(tokenizer):
    seq = Sequence("r", 0, [5, 6], SamplingParams(), 4)
    OutputProcessor(tokenizer, set(), 100).start(seq)
    assert seq.detok_stream is not None
    seq = Sequence("r", 0, [5, 6], SamplingParams(detokenize=False), 4)
    OutputProcessor(tokenizer, set(), 100).start(seq)
    assert seq.detok_stream is None

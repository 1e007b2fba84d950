"""The output processor: incremental detokenization (the streaming DecodeStream path gives the text the
window path gives) and the quick stop check against the full one."""

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
    processor = OutputProcessor(tokenizer, 10_000)
    prompt = tokenizer("def wrap(text, width=70): é ü 中").input_ids[: rng.randrange(1, 12)]
    # Random ids include special tokens and byte tokens that only form characters together.
    output = [rng.randrange(vocab) for _ in range(40)]
    streamed = _text(processor, prompt, output, stream=True, skip=skip)
    windowed = _text(processor, prompt, output, stream=False, skip=skip)
    assert streamed == windowed and streamed


def test_stream_is_used_for_fast_tokenizers(tokenizer):
    seq = Sequence("r", 0, [5, 6], SamplingParams(), 4)
    OutputProcessor(tokenizer, 100).start(seq)
    assert seq.detok_stream is not None
    seq = Sequence("r", 0, [5, 6], SamplingParams(detokenize=False), 4)
    OutputProcessor(tokenizer, 100).start(seq)
    assert seq.detok_stream is None


class _EveryToken:
    def __contains__(self, token: int) -> bool:
        return True


def _finish(processor: OutputProcessor, params: SamplingParams, prompt: list[int], max_tokens: int,
            output: list[int], quick: bool) -> tuple:
    """Append `output` in chunks of 1-3 tokens until the sequence stops; quick=False runs the full
    stop check at every token: every token counts as one that may stop it and the length limit is 0,
    so the reference does not rest on any one of the quick conditions it is compared with."""
    seq = Sequence("r", 0, list(prompt), params, max_tokens)
    processor.start(seq)
    if not quick:
        seq.stop_check_ids, seq.max_output_len = _EveryToken(), 0
    kept, i = [], 0
    while i < len(output) and not seq.is_finished:
        chunk = output[i: i + 1 + i % 3]
        kept.append(processor.append(seq, chunk, None))
        i += len(chunk)
    return seq.output_token_ids, seq.status, seq.stop_reason, seq.output_text, kept


@pytest.mark.parametrize("seed", range(40))
def test_append_quick_stop_check_matches_the_full_check(seed):
    """append runs the full stop check only for a stop/EOS token, new text or the length limit:
    it must stop exactly where the full check at every token stops (eos, stop ids, ignore_eos,
    min_tokens, max_tokens, max_model_len)."""
    rng = random.Random(seed)
    vocab = 12
    eos = set(rng.sample(range(vocab), rng.randrange(0, 3)))
    processor = OutputProcessor(None, max_model_len=rng.randrange(8, 40))
    processor.eos_token_ids = eos
    max_tokens = rng.randrange(1, 30)
    params = SamplingParams(stop_token_ids=rng.sample(range(vocab), rng.randrange(0, 3)),
                            ignore_eos=rng.random() < 0.3, min_tokens=rng.randrange(0, max_tokens + 1),
                            max_tokens=max_tokens)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
    output = [rng.randrange(vocab) for _ in range(40)]
    assert _finish(processor, params, prompt, max_tokens, output, quick=True) == \
        _finish(processor, params, prompt, max_tokens, output, quick=False)


@pytest.mark.parametrize("seed", range(6))
def test_append_quick_stop_check_matches_with_stop_strings(tokenizer, seed):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    output = [rng.randrange(vocab) for _ in range(30)]
    text = tokenizer.decode(output)
    # A stop string taken from the text itself (so that it is met), or one that is never met.
    start = rng.randrange(len(text) - 3)
    stop = text[start: start + rng.randrange(1, 4)] if rng.random() < 0.7 else "\x00never\x00"
    params = SamplingParams(stop=[stop], include_stop_str_in_output=rng.random() < 0.5,
                            min_tokens=rng.randrange(0, 5), max_tokens=30, stop_token_ids=[output[-5]])
    processor = OutputProcessor(tokenizer, 10_000)
    processor.eos_token_ids, processor.primary_eos_token_id = {tokenizer.eos_token_id}, tokenizer.eos_token_id
    assert _finish(processor, params, [5, 6], 30, output, quick=True) == \
        _finish(processor, params, [5, 6], 30, output, quick=False)


def test_only_the_primary_eos_has_no_stop_reason():
    """As vLLM: the tokenizer's EOS ends a request with stop_reason None; the model's other EOS ids (vLLM
    adds a generation config's to stop_token_ids) are reported as the stop reason."""
    processor = OutputProcessor(None, 100)
    processor.eos_token_ids, processor.primary_eos_token_id = {2, 5}, 2
    params = SamplingParams(max_tokens=10)
    for token, reason in ((2, None), (5, 5)):
        ids, status, stop_reason, _, _ = _finish(processor, params, [7, 8], 10, [9, token, 9], quick=True)
        assert ids == [9, token] and status.finish_reason == "stop" and stop_reason == reason

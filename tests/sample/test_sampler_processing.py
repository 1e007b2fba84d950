"""Logits processing (logit_bias, allowed_token_ids, penalties, min_tokens, temperature, top-k/top-p/min-p)
against the per-row reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampler_reference import NEG_INF, build, reference_logits

from vllm_spec.sample.sampler import Sampler, process_logits
from vllm_spec.sampling_params import SamplingParams


def assert_rows_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    kept_ours, kept_ref = torch.isfinite(ours), torch.isfinite(ref)
    assert torch.equal(kept_ours, kept_ref), f"kept sets differ: {kept_ours.nonzero().flatten().tolist()} " \
                                             f"vs {kept_ref.nonzero().flatten().tolist()}"
    torch.testing.assert_close(ours[kept_ours].double(), ref[kept_ref], atol=1e-4, rtol=1e-4)


# Each knob on its own and mixed, in one batch. -----------------------------------------------------------

PROMPT = [3, 3, 5, 9, 30]
OUTPUT = [5, 7, 7, 7, 11, 30]
CASES = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.6),
    "top_k": SamplingParams(top_k=5),
    "top_p": SamplingParams(top_p=0.6),
    "min_p": SamplingParams(min_p=0.2),
    "presence": SamplingParams(temperature=0, presence_penalty=1.5),
    "negative_presence": SamplingParams(presence_penalty=-1.0),
    "frequency": SamplingParams(temperature=0, frequency_penalty=0.7),
    "repetition": SamplingParams(temperature=0, repetition_penalty=1.8),
    "repetition_below_one": SamplingParams(repetition_penalty=0.5),
    "min_tokens": SamplingParams(min_tokens=10, stop_token_ids=[2, 7]),
    "logit_bias": SamplingParams(temperature=0, logit_bias={4: 30.0, 9: -2.5}),
    "allowed_token_ids": SamplingParams(temperature=0, allowed_token_ids=[1, 6, 7, 20]),
    "bad_words": SamplingParams(temperature=0, bad_words=["a"]),   # token ids set below
    "allowed_and_biased": SamplingParams(temperature=0.7, top_k=3, allowed_token_ids=[1, 6, 7, 20, 30],
                                         logit_bias={6: 5.0, 2: 50.0}, repetition_penalty=1.4),
    "all": SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05, presence_penalty=0.3,
                          frequency_penalty=0.2, repetition_penalty=1.3),
}


# OUTPUT ends with 11, 30: [11, 30, 4] bans 4, [30, 12] bans 12, [9] bans 9 always; [7, 30, 5] bans nothing.
CASES["bad_words"].bad_words_token_ids = [[11, 30, 4], [30, 12], [9], [7, 30, 5]]


@pytest.mark.parametrize("name", list(CASES))
def test_processing_matches_reference_per_knob(name):
    torch.manual_seed(0)
    logits = torch.randn(1, 32) * 3
    p = CASES[name]
    md = build([p], [PROMPT], [OUTPUT])
    ours = process_logits(logits.clone(), md)[0]
    ref = reference_logits(logits[0], p, PROMPT, OUTPUT)
    assert_rows_match(ours, ref)
    assert torch.equal(ours, logits[0]) == (name == "greedy")  # every knob has an effect here


def test_mixed_batch_matches_reference_row_by_row():
    torch.manual_seed(1)
    params = list(CASES.values())
    logits = torch.randn(len(params), 32) * 3
    prompts = [PROMPT[: i % 5 + 1] for i in range(len(params))]
    outputs = [OUTPUT[i % 3:] for i in range(len(params))]
    md = build(params, prompts, outputs)
    ours = process_logits(logits.clone(), md)
    for i, p in enumerate(params):
        assert_rows_match(ours[i], reference_logits(logits[i], p, prompts[i], outputs[i]))


def test_penalty_semantics_spelled_out():
    """Presence/frequency see output tokens only; repetition sees prompt and output; sign matters."""
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0]])
    prompt, output = [0, 1], [2, 3, 3]
    md = build([SamplingParams(temperature=0, repetition_penalty=2.0)], [prompt], [output], vocab=6)
    assert process_logits(logits.clone(), md)[0].tolist() == [1.0, -4.0, 1.0, -4.0, 1.0, 1.0]
    md = build([SamplingParams(temperature=0, frequency_penalty=0.5)], [prompt], [output], vocab=6)
    assert process_logits(logits.clone(), md)[0].tolist() == [2.0, -2.0, 1.5, -3.0, 1.0, 1.0]
    md = build([SamplingParams(temperature=0, presence_penalty=0.5)], [prompt], [output], vocab=6)
    assert process_logits(logits.clone(), md)[0].tolist() == [2.0, -2.0, 1.5, -2.5, 1.0, 1.0]


def test_min_tokens_bans_stop_ids_until_reached():
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    p.all_stop_token_ids |= {0}  # the engine adds the EOS ids
    logits = torch.zeros(1, 6)
    logits[0, 0], logits[0, 4] = 5.0, 4.0
    for n_out, expect in [(0, 1), (2, 1), (3, 0)]:
        md = build([p], [[1]], [[1] * n_out], vocab=6)
        out = Sampler()(logits.clone(), md)
        processed = process_logits(logits.clone(), md)[0]
        if n_out < 3:
            assert processed[0] == NEG_INF and processed[4] == NEG_INF
            assert out.sampled.item() not in (0, 4)
        else:
            assert out.sampled.item() == 0


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_processing_matches_reference_random(data):
    V = 24
    n = data.draw(st.integers(1, 4))
    params, prompts, outputs = [], [], []
    for _ in range(n):
        greedy = data.draw(st.booleans())
        p = SamplingParams(
            temperature=0.0 if greedy else data.draw(st.sampled_from([0.3, 0.7, 1.0, 1.5])),
            top_k=data.draw(st.sampled_from([0, 1, 3, 10, 24, 40])),
            top_p=data.draw(st.sampled_from([1.0, 0.95, 0.5, 0.1])),
            min_p=data.draw(st.sampled_from([0.0, 0.05, 0.3])),
            presence_penalty=data.draw(st.sampled_from([0.0, 1.0, -0.5])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 0.4, -0.3])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 1.3, 0.7])),
            min_tokens=data.draw(st.integers(0, 3)),
            stop_token_ids=data.draw(st.lists(st.integers(0, V - 1), max_size=2)),
        )
        params.append(p)
        prompts.append(data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=8)))
        outputs.append(data.draw(st.lists(st.integers(0, V - 1), max_size=8)))
    seed = data.draw(st.integers(0, 2**16))
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2
    md = build(params, prompts, outputs, vocab=V)
    ours = process_logits(logits.clone(), md)
    tokens = Sampler(torch.Generator().manual_seed(seed))(logits.clone(), md).sampled
    for i, p in enumerate(params):
        ref = reference_logits(logits[i], p, prompts[i], outputs[i])
        assert_rows_match(ours[i], ref)
        assert torch.isfinite(ref[tokens[i]])  # the sampled token is always in the kept set
        if p.is_greedy:
            assert tokens[i].item() == ref.argmax().item()



def test_logit_bias_rows_shared_by_parameters_match_per_row_reference():
    """A verification's k+1 rows of one sequence share its parameters (built once, expanded on the device);
    unbiased rows between them keep the raw logits."""
    torch.manual_seed(5)
    biased = SamplingParams(temperature=0, allowed_token_ids=[1, 6, 7, 20], logit_bias={6: 3.0})
    other = SamplingParams(temperature=0, logit_bias={2: -50.0})
    plain = SamplingParams(temperature=0)
    params = [biased, biased, plain, other, biased, plain]
    logits = torch.randn(len(params), 32) * 3
    ours = process_logits(logits.clone(), build(params))
    for i, p in enumerate(params):
        assert_rows_match(ours[i], reference_logits(logits[i], p, [], []))

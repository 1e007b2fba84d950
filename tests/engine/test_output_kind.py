"""RequestOutputKind: what each engine step reports for a request (vLLM semantics)."""

from __future__ import annotations

import pytest

from vllm_spec import EngineArgs, LLMEngine, SamplingParams
from vllm_spec.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24))


def _run(engine, kind: RequestOutputKind, n: int = 1) -> list:
    params = SamplingParams(temperature=0 if n == 1 else 1.0, seed=3, max_tokens=12, ignore_eos=True, n=n,
                            output_kind=kind, logprobs=1)
    engine.add_request(kind.name, "hello world", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_cumulative_reports_everything_every_step(engine):
    outs = _run(engine, RequestOutputKind.CUMULATIVE)
    assert len(outs) == 12
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 13))
    assert [o.finished for o in outs] == [False] * 11 + [True]


def test_delta_pieces_add_up_to_the_cumulative_output(engine):
    full = _run(engine, RequestOutputKind.CUMULATIVE, n=2)[-1]
    outs = _run(engine, RequestOutputKind.DELTA, n=2)
    for i in range(2):
        assert sum((o.outputs[i].token_ids for o in outs), []) == full.outputs[i].token_ids
        assert "".join(o.outputs[i].text for o in outs) == full.outputs[i].text
        assert sum((o.outputs[i].logprobs for o in outs), []) == full.outputs[i].logprobs
        assert all(len(o.outputs[i].token_ids) == 1 for o in outs)


def test_final_only_reports_once(engine):
    full = _run(engine, RequestOutputKind.CUMULATIVE)[-1]
    outs = _run(engine, RequestOutputKind.FINAL_ONLY)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == full.outputs[0].token_ids


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")



def _texts(engine, kind: RequestOutputKind, **kw) -> list[str]:
    engine.add_request(f"{kind.name}-{kw}", "hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                       output_kind=kind, **kw))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    return texts


def _spanning_stop(steps: list[str]) -> str:
    """A 3-character stop string that starts with the last character of one step's text and ends
    in the next step's, first seen there."""
    full = steps[-1]
    for t in range(1, len(steps) - 1):
        end = len(steps[t])
        if len(steps[t + 1]) >= end + 2 and full.find(full[end - 1:end + 2]) == end - 1:
            return full[end - 1:end + 2]
    pytest.skip("no step boundary to put a stop string across")


def test_streamed_text_holds_back_a_possible_stop_string(engine):
    """vLLM holds back len(longest stop) - 1 characters of unfinished outputs: text that a stop string
    completed later would cut must not be reported first (cumulative text never shrinks, deltas add
    up to the final text)."""
    unheld = _texts(engine, RequestOutputKind.CUMULATIVE)
    stop = _spanning_stop(unheld)
    cumulative = _texts(engine, RequestOutputKind.CUMULATIVE, stop=[stop, "\x00"])
    final = cumulative[-1]
    assert final == unheld[-1][:unheld[-1].index(stop)]
    assert cumulative[:-1] == [t[:max(len(t) - 2, 0)] for t in unheld[:len(cumulative) - 1]]
    assert "".join(_texts(engine, RequestOutputKind.DELTA, stop=[stop])) == final
    # Kept in the output, a stop string cuts nothing: nothing is held back.
    kept = _texts(engine, RequestOutputKind.CUMULATIVE, stop=[stop], include_stop_str_in_output=True)
    assert kept[-1] == final + stop and all(kept[-1].startswith(t) for t in kept)
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0

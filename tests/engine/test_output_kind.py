"""RequestOutputKind: what each engine step reports for a request (vLLM semantics)."""

from __future__ import annotations

import pytest

from vllm_spec import EngineArgs, LLMEngine, SamplingParams
from vllm_spec.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24))


def _run(engine, kind: RequestOutputKind, n: int = 1) -> list:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=n, output_kind=kind, logprobs=1)
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


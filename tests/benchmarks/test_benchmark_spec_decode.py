"""run_decode, the timing loop of the GPU benchmarks, on tiny CPU models: what it reports."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_run_decode_reports_host_time_mean_and_median(tmp_path, monkeypatch, async_scheduling):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_spec_decode as bench

    target = bench.write_config(tmp_path, "t", 256, vocab=300, dims=SMALL)
    engine = bench.build(target, None, 1, 256, 4, dtype="float32", async_scheduling=async_scheduling)
    out = bench.run_decode(engine, 4, 8, 12, seed=1, vocab=300)
    assert out["tokens_per_s"] > 0 and out["ms_per_step"] > 0
    # On the CPU the model runs on the host: host time is most of each step, never more than it.
    assert 0 < out["host_ms_median"] <= 2 * out["ms_per_step"]
    assert 0 < out["host_ms_per_step"] <= 1.01 * out["ms_per_step"]
    assert not engine.has_unfinished_requests()

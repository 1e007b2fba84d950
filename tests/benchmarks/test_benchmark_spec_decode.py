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


GPU_ONLY = ["bench_attention.py", "bench_gemv.py", "bench_fused_ops.py", "profile_decode.py", "benchmark_spec_decode.py"]


@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_only_benchmarks_help_and_refuse_without_cuda(script):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run")
    run = [sys.executable, str(BENCHMARKS / script)]
    assert subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120).returncode == 0
    # profile_decode built an 8B-shape model on the CPU first; the others raised tracebacks.
    proc = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "needs" in proc.stderr and script in proc.stderr

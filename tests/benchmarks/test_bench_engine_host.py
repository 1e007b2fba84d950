"""bench_engine_host: the engine's per-step host time with the worker stubbed out, on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_engine_host_benchmark_times_every_phase(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_engine_host as bench

    monkeypatch.setattr(sys, "argv", ["bench_engine_host.py", "--batch-sizes", "3", "--steps", "6",
                                      "--prompt-len", "5", "--out-dir", str(tmp_path)])
    assert bench.main() == 0
    rows = json.loads(next(tmp_path.glob("engine_host_*.json")).read_text())["rows"]
    assert {r["output_kind"] for r in rows} == {"CUMULATIVE", "DELTA", "FINAL_ONLY"}
    for r in rows:
        assert r["batch"] == 3
        phases = r["schedule_us"] + r["request_us"] + r["read_us"]
        assert 0 < r["schedule_us"] and 0 < r["request_us"] and 0 < r["read_us"]
        assert phases <= r["step_us"]
    assert "FINAL_ONLY" in capsys.readouterr().out


def test_stub_launch_samples_one_token_per_sampled_sequence(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_engine_host as bench

    from vllm_spec.worker.batch import ExecuteModelRequest, SeqInput

    req = ExecuteModelRequest([SeqInput(1, [5], 3, [0], True), SeqInput(2, [5, 6], 0, [0], False)])
    handle = bench.stub_launch(req)
    assert handle.one_token_per_seq
    out = handle.result()
    assert out.seq_ids == [1] and out.token_ids == [[7]]

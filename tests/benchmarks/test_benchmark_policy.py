"""Smoke test of the issue #7 policy benchmark: the whole sweep on tiny CPU models."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_policy_benchmark_tiny_sweep(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_policy as bench

    out = tmp_path / "policy.json"
    bench.main(["--tiny", "--batch-sizes", "1", "3", "--prompt-len", "8", "--gen-len", "32", "--warmup-len", "4",
                "--window", "4", "--min-seq-steps", "8", "--trace",
                "--out", str(out), "--plot", str(tmp_path / "policy.png")])
    result = json.loads(out.read_text())
    rows = {(r["draft"], r["workload"], r["batch"], r["policy"]) for r in result["rows"]}
    plain = {(None, None, b, "plain") for b in (1, 3)}
    workloads = ("A=0.5", "A=0.8", "mixed")
    spec_policies = [p for p in bench.POLICIES if p != "plain"]
    expected = {(d, w, b, p) for d in ("68m", "1b") for w in workloads for b in (1, 3) for p in spec_policies}
    assert rows == plain | expected
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert len(result["summary"]) == 2 * len(workloads) * 2
    for s in result["summary"]:
        assert set(s["tokens_per_s"]) == set(bench.POLICIES)
        assert s["adaptive_over_plain"] > 0 and s["adaptive_over_best_fixed"] > 0
    # --trace: every step the adaptive policies observed, warm-ups included (at least the timed windows).
    trace = result["adaptive_trace"]
    assert len(trace) >= 2 * len(workloads) * 2 * 4
    assert {(t["draft"], t["workload"], t["batch"]) for t in trace} == {
        (d, w, b) for d in ("68m", "1b") for w in workloads for b in (1, 3)}
    assert all(t["step_ms"] > 0 and isinstance(t["refill"], bool) and 0 <= t["k"] <= bench.MAX_K for t in trace)
    assert (tmp_path / "policy.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_repeats_interleave_the_policies_and_report_medians(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_policy as bench

    out = tmp_path / "policy.json"
    bench.main(["--tiny", "--batch-sizes", "2", "--drafts", "68m", "--acceptance", "0.5", "--prompt-len", "8",
                "--gen-len", "32", "--warmup-len", "4", "--window", "4", "--min-seq-steps", "1", "--repeats", "3",
                "--out", str(out)])
    result = json.loads(out.read_text())
    for policy in bench.POLICIES:
        runs = [r for r in result["rows"] if r["policy"] == policy and r["workload"] in (None, "A=0.5")]
        assert sorted(r["repeat"] for r in runs) == [0, 1, 2]
        median = sorted(r["tokens_per_s"] for r in runs)[1]
        summary = next(s for s in result["summary"] if s["workload"] == "A=0.5")
        assert summary["tokens_per_s"][policy] == median



def test_small_batches_time_more_steps(monkeypatch):
    """A timed run holds at least min_seq_steps sequence-steps, and requests long enough that none
    finishes inside it at the most drafts a step may accept."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_policy as bench

    sweep = bench.Sweep([1, 8, 256], prompt_len=64, gen_len=192, warmup_len=16, vocab=512, window=32,
                        min_seq_steps=256, max_k=4)
    assert [sweep.window_for(b) for b in (1, 3, 8, 256)] == [256, 86, 32, 32]
    assert sweep.gen_len_for(1) == 256 * 5 + 32
    assert sweep.gen_len_for(256) == 192
    sweep.max_k = 8
    assert sweep.gen_len_for(256) == 32 * 9 + 32


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_put_every_policy_after_every_other_equally_often(n, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_policy as bench

    orders = bench.balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    if n > 1:
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(follows.values())) == 1

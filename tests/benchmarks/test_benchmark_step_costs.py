"""Smoke test of the step-cost benchmark: every k on tiny CPU models, steady and settling steps apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_step_costs_tiny(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_step_costs as bench

    out = tmp_path / "costs.json"
    bench.main(["--tiny", "--batch", "3", "--max-k", "2", "--prompt-len", "8", "--gen-len", "32",
                "--warmup-len", "4", "--window", "10", "--out", str(out)])
    result = json.loads(out.read_text())
    costs = result["costs"]
    assert [c["k"] for c in costs] == [0, 1, 2]
    for c in costs:
        assert len(c["tokens_per_s"]) == 2 and all(t > 0 for t in c["tokens_per_s"])
        assert c["steady_charge_ms"] >= c["steady_verify_ms"] > 0
        assert len(c["settling_over_steady"]) == bench.SETTLING_REPORTED
        assert all(r > 0 for r in c["settling_over_steady"])
    assert costs[0]["steady_draft_ms"] < costs[2]["steady_draft_ms"]   # plain steps draft nothing
    steps = result["steps"]
    assert {(s["k"], s["round"]) for s in steps} == {(k, r) for k in range(3) for r in range(2)}
    for k in range(3):   # steady steps of every k, and the first ones after its prefills apart
        positions = {s["after_prefill"] for s in steps if s["k"] == k}
        assert set(range(1, bench.SETTLING_REPORTED + 2)) <= positions


def test_acceptance_out_of_range_is_refused(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_step_costs as bench

    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--acceptance", "1.0"])

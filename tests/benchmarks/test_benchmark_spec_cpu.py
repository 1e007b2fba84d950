"""The CPU speculative benchmark's prompt choice: built-in messages or a --prompts-file, cycled to --num-prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import benchmark_spec_cpu
    return benchmark_spec_cpu


def test_built_in_prompts_by_default(bench):
    assert bench.prompt_texts(None, None) == bench.PROMPTS
    assert bench.prompt_texts(None, 3) == bench.PROMPTS[:3]
    n = len(bench.PROMPTS) + 2
    assert bench.prompt_texts(None, n) == bench.PROMPTS + bench.PROMPTS[:2]


def test_prompts_file(bench, tmp_path):
    path = tmp_path / "held.json"
    path.write_text(json.dumps(["first message", "second\nmessage"]))
    assert bench.prompt_texts(str(path), None) == ["first message", "second\nmessage"]
    assert bench.prompt_texts(str(path), 5) == ["first message", "second\nmessage"] * 2 + ["first message"]


@pytest.mark.parametrize("content", ['{"a": 1}', "[]", '["ok", 3]', '["ok", ""]'])
def test_prompts_file_must_be_a_list_of_messages(bench, tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SystemExit, match="--prompts-file"):
        bench.prompt_texts(str(path), None)


def test_interleaved_passes_alternate_between_systems(bench):
    """measure() over several systems: each repeat runs every system once, in turn, and each row reports
    its own system's median pass."""
    calls = []

    class FakeOutput:
        def __init__(self, ids):
            self.outputs = [type("Completion", (), {"token_ids": ids})()]

    class FakeLLM:
        def __init__(self, name):
            self.name = name

        def generate(self, prompts, params, use_tqdm=False):
            calls.append((self.name, len(prompts)))
            return [FakeOutput([1, 2, 3]) for _ in prompts]

        def get_metrics(self):
            return []

    systems = [bench.System("p", name, "-", 0, FakeLLM(name), [{}] * 3, 0.0) for name in ("plain", "draft")]
    args = type("Args", (), {"batch": [2], "repeats": 2, "max_tokens": 4, "ignore_eos": True})()
    measured = bench.measure(systems, args)
    assert calls == [("plain", 2), ("plain", 1), ("draft", 2), ("draft", 1)] * 2
    assert [(r.system, r.batch, r.tokens, r.prompts) for r, _ in measured] == [("plain", 2, 9, 3), ("draft", 2, 9, 3)]
    assert all(ids == [[1, 2, 3]] * 3 for _, ids in measured)

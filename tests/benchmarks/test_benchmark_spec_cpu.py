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

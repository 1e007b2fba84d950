"""The draft-training prompt families (tools/draft_training/corpora.py) on a tiny stand-in corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def corpora(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    from draft_training import corpora

    return corpora


def _src():
    news = [(f"news/tech/{i}", f"Title {i}", " ".join(f"word{j}" for j in range(200))) for i in range(5)]
    passages = [(f"lit/play/{i}", "To be, or not to be\nthat is the question\nWhether 'tis nobler") for i in range(3100)]
    verses = [(f"bible/Gen/{i}", f"Gen 1:{i}", "In the beginning") for i in range(2100)]
    docs = [("doc/os.path.join", "os.path.join", "Join two or more pathname components.")]
    return {"news": news, "passages": passages, "verses": verses}, docs


def test_default_families_have_no_raw_completions(corpora):
    prompts = corpora.build_prompts(*_src(), seed=0)
    assert {kind for _, kind, _ in prompts} == {"topic", "news", "lit", "bible", "doc", "code", "math"}
    assert prompts == corpora.build_prompts(*_src(), seed=0)   # the seed alone decides


def test_completion_prompts_add_openings_in_both_forms(corpora):
    base = corpora.build_prompts(*_src(), seed=0)
    wider = corpora.build_prompts(*_src(), seed=0, completions=True)
    assert wider[: len(base)] == base
    kinds = {kind for _, kind, _ in wider[len(base):]}
    assert kinds == {"translate", "opening", "completion"}
    raw = {text for _, kind, text in wider if kind == "completion"}
    chat = [text for _, kind, text in wider if kind == "opening"]
    assert chat and set(chat) <= raw   # every chat opening is also sent raw
    assert any(text.startswith("def ") for text in raw)
    assert any("Translate '" in text for text in raw)

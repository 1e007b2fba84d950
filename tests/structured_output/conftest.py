"""Fixtures for the grammar tests: the tiny model's tokenizer and a grammar compiler over it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from vllm_spec.structured_output.grammar import GrammarCompiler


@pytest.fixture(scope="package")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="package")
def compiler(tok):
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])

"""Python's collector tuned for serving (engine/gc_tuning.py): what an engine is built from is frozen out
of collections while the engine lives, and collectable again once it is dropped."""

from __future__ import annotations

import gc
import weakref

from conftest import SPEC_KV
from vllm_spec import LLM, SamplingParams


def test_an_engine_freezes_what_it_was_built_from(tiny_llama):
    llm = LLM(str(tiny_llama), **SPEC_KV)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] >= 20 * llm.llm_engine.config.scheduler.max_num_seqs
    del llm


def test_a_dropped_speculative_engine_is_collected(spec_pair):
    """Its worker sits in a reference cycle with the step it left unread; frozen, the cycle (the weights and
    the KV caches with it) was never collected: 2.4 GB a SmolLM2 engine, each time one was built."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2, **SPEC_KV)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    worker = llm.llm_engine.executor.worker
    kv = weakref.ref(worker.target.runner.model.attention_layers()[0].k_cache)
    worker = weakref.ref(worker)
    del llm
    gc.collect()
    assert worker() is None and kv() is None

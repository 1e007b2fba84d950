"""Python's collector tuned for serving (engine/gc_tuning.py): what an engine is built from is frozen out
of collections while the engine lives, and collectable again once it is dropped."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

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



# An application object in a reference cycle (a bound method of itself) builds an engine: the build's
# freeze takes the cycle in, so it (and the engine it holds) is never collected unless the engine's
# shutdown gives the frozen objects back. A process of its own: other engines' finalizers unfreeze too.
_OWNER_SCRIPT = """
import gc, sys, weakref
from vllm_spec import LLM

class Owner:
    def __init__(self):
        self.callback = self.report
        self.llm = LLM(sys.argv[1], kv_cache_memory_bytes=1 << 22)

    def report(self):
        pass

def dropped(shut_down):
    owner = Owner()
    engine = weakref.ref(owner.llm.llm_engine)
    if shut_down:
        owner.llm.llm_engine.shutdown()
        owner.llm.llm_engine.shutdown()   # idempotent
    del owner
    gc.collect()
    return engine() is None

print(dropped(False), dropped(True))
"""


def test_a_shut_down_engine_is_collected_even_from_a_frozen_cycle(tiny_llama):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", _OWNER_SCRIPT, str(tiny_llama)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["False", "True"], run.stdout


def test_a_huge_batch_limit_keeps_the_threshold_a_c_int():
    """20 young objects per sequence of max_num_seqs=2e8 is past gc.set_threshold's C int."""
    from vllm_spec.engine.gc_tuning import tune_gc_for_serving

    class Owner:
        pass

    threshold = gc.get_threshold()
    owner = Owner()
    unfreeze = tune_gc_for_serving(owner, 2 * 10**8)
    try:
        assert gc.get_threshold()[0] == 2**31 - 1
    finally:
        unfreeze()
        gc.set_threshold(*threshold)

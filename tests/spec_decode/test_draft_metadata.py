"""The draft's sampling metadata: rebuilt after a batch change from rows kept per sequence, which go
when their sequences finish, and equal to the metadata built from scratch."""

from __future__ import annotations

import torch

from conftest import FIXED, make_prompts
from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams


def test_rows_kept_per_sequence_build_what_fresh_rows_build(spec_pair):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    worker = llm.llm_engine.executor.worker
    built = []
    draft_metadata = worker._draft_metadata

    def recording(req, spec_idx):
        md = draft_metadata(req, spec_idx)
        if md is not None:
            built.append((md, worker.target.rows_metadata([req.seqs[i] for i in spec_idx], for_draft=True)))
        return md

    worker._draft_metadata = recording
    # Greedy, seeded and unseeded sampled requests with their own temperatures and truncations,
    # finishing at different lengths: the batch changes at many steps.
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(temperature=0.5 + 0.1 * i, top_k=5 + i, top_p=0.9, max_tokens=6 + 3 * i,
                             ignore_eos=True, seed=i if i % 3 == 1 else None) for i in range(9)]
    llm.generate(make_prompts(9, seed=3), params, use_tqdm=False)
    assert len(built) > 5
    for kept, fresh in built:
        assert kept.all_greedy == fresh.all_greedy and kept.plain_greedy == fresh.plain_greedy
        for name in ("temperature", "greedy", "top_k", "top_p", "min_p"):
            a, b = getattr(kept, name), getattr(fresh, name)
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert kept.generators.keys() == fresh.generators.keys()
        assert all(kept.generators[i] is fresh.generators[i] for i in kept.generators)


def test_rows_of_finished_sequences_are_dropped(spec_pair):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    worker = llm.llm_engine.executor.worker
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for seed in range(3):
        llm.generate(make_prompts(6, seed=seed), params, use_tqdm=False)
        # A finished sequence is released with the engine's next step: at most the last batch's rows.
        assert len(worker._draft_rows) <= 6
    llm.generate(make_prompts(1, seed=9), params, use_tqdm=False)
    assert len(worker._draft_rows) <= 1

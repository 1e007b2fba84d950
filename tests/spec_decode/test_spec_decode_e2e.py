"""End-to-end correctness of speculative decoding, greedy: outputs (and logprobs) equal plain decoding's
under every draft, k, batch, preemption, chunked prefill, penalty, bias and bad word; block bookkeeping.
Sampled outputs and seeds: test_spec_decode_sampling_e2e.py; speculative settings: test_spec_decode_settings.py.

The model pair comes from --target-model/--draft-model (or VLLM_SPEC_TEST_TARGET/_DRAFT); by
default a tiny random target and a noisy copy of it as draft (partial acceptance).
"""

from __future__ import annotations

import pytest
import torch

from conftest import FIXED, GREEDY, make_noisy_draft, make_prompts, make_tiny_model, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams, cpu_ops
from vllm_spec.model import cpu_linear


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equality_draft_model(spec_pair, greedy_reference, k):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=k, **FIXED, **KV)
    for batch in (1, 5, 16):
        out = output_ids(llm.generate(make_prompts(16)[:batch], GREEDY, use_tqdm=False))
        assert out == greedy_reference[:batch]
    m = metric_values(llm)
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    assert len(m["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_usable_blocks


@pytest.mark.parametrize("arch, options", [
    ("qwen3", dict(head_dim=32, attention_bias=True)),   # per-head q/k norms (the Python layers on the CPU)
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    ("mistral", dict(sliding_window=8)),
    ("gemma3", dict(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("gemma2", dict(head_dim=32, sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5)),
    ("phi3", dict(head_dim=32, partial_rotary_factor=0.5, sliding_window=8)),
    ("mixtral", dict(sliding_window=8)),
    ("qwen3_moe", dict(mlp_only_layers=[0], use_sliding_window=True, sliding_window=8)),
    ("qwen2_moe", dict(decoder_sparse_step=2)),
    ("gemma", dict(head_dim=32)),
    ("smollm3", dict(no_rope_layer_interval=2)),
    ("opt", {}),
    ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32, activation_function="gelu")),
    ("gpt_neox", {}),
    ("gpt_neox", dict(use_parallel_residual=False, rotary_pct=1.0)),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True)),
    ("gpt_bigcode", {}),
    ("phi", dict(qk_layernorm=True)),
])
def test_greedy_equality_on_each_architecture(tmp_path, arch, options):
    """Every supported family speculates losslessly: a noisy copy drafts for a tiny target of that family."""
    target = make_tiny_model(tmp_path / "target", arch, seed=12, **options)
    draft = make_noisy_draft(target, tmp_path / "draft", 0.04)
    prompts = make_prompts(8, seed=3)
    expected = output_ids(LLM(str(target), **KV).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    m = metric_values(llm)
    assert 0 < m["vllm:spec_decode_num_accepted_tokens"] < m["vllm:spec_decode_num_draft_tokens"]


def test_a_draft_of_another_family(tmp_path):
    """The draft need only share the target's vocabulary: an OPT draft for a Llama target, a GPT-NeoX one for an
    OPT target, a GPT-2 one for a GPT-NeoX target, a Llama one for a GPT-2 target speculate losslessly."""
    llama = make_tiny_model(tmp_path / "llama", "llama", seed=12)
    opt = make_tiny_model(tmp_path / "opt", "opt", seed=13, num_hidden_layers=1)
    neox = make_tiny_model(tmp_path / "neox", "gpt_neox", seed=14, num_hidden_layers=1)
    prompts = make_prompts(8, seed=4)
    gpt2 = make_tiny_model(tmp_path / "gpt2", "gpt2", seed=15, n_layer=1)
    for target, draft in ((llama, opt), (opt, neox), (neox, gpt2), (gpt2, llama)):
        expected = output_ids(LLM(str(target), **KV).generate(prompts, GREEDY, use_tqdm=False))
        llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3, **FIXED, **KV)
        assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert metric_values(llm)["vllm:spec_decode_num_draft_tokens"] > 0


@pytest.mark.skipif(not (cpu_ops.available() and torch.bfloat16 in cpu_linear.dtypes()),
                    reason="bfloat16 on the CPU kernels (an AVX2 CPU without bf16 arithmetic)")
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equality_in_bfloat16_on_the_cpu_kernels(spec_pair, k):
    """The CPU kernels give a position the same logits in a (k+1)-token verification as in a 1-token step,
    in bfloat16 too (tests/model/test_cpu_linear.py, tests/attention/test_cpu_backend.py): there greedy
    speculation equals plain decoding, logprobs and all (on GPUs rounding may differ: README)."""
    target, draft = spec_pair
    bf16 = dict(dtype="bfloat16", device="cpu", **KV)
    prompts = make_prompts(16, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)

    def run(llm: LLM) -> list:   # ids, and the logprobs: the logits' very bits show there
        return [(c.token_ids, c.logprobs) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]

    plain = run(LLM(target, **bf16))
    # 4 sequences at a time: prompts are prefilled in steps beside other sequences' verifications.
    llm = LLM(target, speculative_model=draft, num_speculative_tokens=k, max_num_seqs=4, **FIXED, **bf16)
    assert run(llm) == plain
    assert metric_values(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


def test_greedy_equality_with_preemption(spec_pair, greedy_reference):
    # 40 usable blocks of 4 tokens: 16 sequences of up to ~64 tokens cannot all fit.
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3,
              block_size=4, num_gpu_blocks_override=41, max_model_len=128, **FIXED)
    out = output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False))
    assert metric_values(llm)["vllm:num_preemptions"] > 0
    assert out == greedy_reference


def test_greedy_equality_chunked_prefill(spec_pair, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4,
              max_num_batched_tokens=16, **FIXED, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference


def test_greedy_equality_ngram(spec_pair, baseline):
    # Repetitive prompts so that prompt lookup finds matches.
    prompts = [{"prompt_token_ids": ([5, 6, 7, 8, 9] * 6)[: 10 + i]} for i in range(8)]
    ref = output_ids(baseline.generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(spec_pair[0], speculative_model="[ngram]", num_speculative_tokens=4,
              ngram_prompt_lookup_max=3, ngram_prompt_lookup_min=1, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
    assert metric_values(llm)["vllm:spec_decode_num_draft_tokens"] > 0


def test_cpu_verification_is_ragged_not_padded(spec_pair, monkeypatch):
    """Without CUDA graphs a verification pass holds each sequence's last token and its own drafts: padding
    every sequence to the longest draft (what a graph needs) would only add rows to compute."""
    from vllm_spec.spec_decode.mqa_scorer import MQAScorer

    passes = []   # (sequences, drafts proposed, tokens the target ran)
    score = MQAScorer.score_and_verify

    def recorded(self, req, *args, **kwargs):
        out = score(self, req, *args, **kwargs)
        passes.append((len(req.seqs), out.spec.num_draft_tokens, out.spec.num_verified_tokens))
        return out

    monkeypatch.setattr(MQAScorer, "score_and_verify", recorded)
    # Half the prompts repeat themselves (prompt lookup finds drafts), half do not.
    prompts = [{"prompt_token_ids": ([5, 6, 7, 8, 9] * 6)[: 10 + i] if i % 2 else [11 + 7 * i, 40 + i, 3, 90 - i]}
               for i in range(8)]
    llm = LLM(spec_pair[0], speculative_model="[ngram]", num_speculative_tokens=4, ngram_prompt_lookup_max=3,
              ngram_prompt_lookup_min=1, device="cpu", **FIXED, **KV)
    plain = LLM(spec_pair[0], device="cpu", **KV)   # (the CPU's greedy ids: another device may round otherwise)
    assert output_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        output_ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert passes and all(tokens == seqs + drafts for seqs, drafts, tokens in passes)
    assert any(drafts < 4 * seqs for seqs, drafts, _ in passes if seqs > 1)   # some sequences found fewer


def test_random_draft_accepts_almost_nothing(spec_pair, random_draft, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=str(random_draft), num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    assert metric_values(llm)["vllm:spec_decode_acceptance_rate"] < 0.2


def test_draft_equal_to_target_accepts_everything(spec_pair, greedy_reference):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
    m = metric_values(llm)
    assert m["vllm:spec_decode_acceptance_rate"] == 1.0
    assert m["vllm:spec_decode_mean_accepted_length"] == 5.0
    # vLLM V0's names: every draft accepted, each speculating step emitting k + 1.
    assert m["vllm:spec_decode_draft_acceptance_rate"] == m["vllm:spec_decode_efficiency"] == 1.0
    assert m["vllm:spec_decode_num_emitted_tokens"] == 5 * m["vllm:spec_decode_num_drafts"] > 0


def test_greedy_equality_with_penalties_and_min_tokens(spec_pair, baseline):
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.2, min_tokens=5, stop_token_ids=[7, 11])
    prompts = make_prompts(6, seed=3)
    ref = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == ref


def test_greedy_equality_with_logit_bias_and_allowed_token_ids(spec_pair, baseline):
    """The verifier scores drafts against the biased, masked distribution: drafts outside
    allowed_token_ids are rejected, and a biased token wins where the target's argmax would not."""
    allowed = list(range(0, 384, 5))
    rows = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={7: 6.0, 11: -100.0}),
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed,
                           logit_bias={10: 4.0})]
    prompts = make_prompts(6, seed=5)
    params = [rows[i % 3] for i in range(6)]
    ref = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    plain = output_ids(baseline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                         use_tqdm=False))
    assert ref != plain and all(set(ref[i]) <= set(allowed) for i in (0, 2, 3, 5))
    assert all(11 not in ref[i] for i in (1, 4))
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert metric_values(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_never_generated_with_or_without_speculation(spec_pair, baseline, async_scheduling):
    """Words cut out of the reference outputs: each is banned (its last token, where the output ends with
    the rest of it), so it never appears in the output; the verifier bans per verified position, after
    the drafts before it, so speculation leaves the output unchanged."""
    tok = baseline.get_tokenizer()
    prompts = make_prompts(4, seed=9)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = output_ids(baseline.generate(prompts, plain, use_tqdm=False))
    words = [tok.decode(ref[0][4:6]), tok.decode(ref[1][10:11]), tok.decode(ref[2][2:5])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    want = output_ids(baseline.generate(prompts, params, use_tqdm=False))
    banned = params.clone()
    banned.update_from_tokenizer(tok)
    assert want != ref and banned.bad_words_token_ids
    for out in want:
        assert not any(_contains(out, word) for word in banned.bad_words_token_ids)
    # Without speculation, async scheduling would overlap each step with the next: a step whose bans
    # follow the last token is read first.
    plain_engine = LLM(spec_pair[0], async_scheduling=async_scheduling, **KV)
    assert output_ids(plain_engine.generate(prompts, params, use_tqdm=False)) == want
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, async_scheduling=async_scheduling,
              **FIXED, **KV)
    assert output_ids(llm.generate(prompts, params, use_tqdm=False)) == want
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, bad_words=words)
    for out in output_ids(llm.generate(prompts, sampled, use_tqdm=False)):
        assert not any(_contains(out, word) for word in banned.bad_words_token_ids)


def test_logprobs_match_non_speculative(spec_pair, baseline):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = make_prompts(4, seed=4)
    ref = baseline.generate(prompts, params, use_tqdm=False)
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV)
    out = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(out, ref):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert len(ca.logprobs) == len(ca.token_ids)
        for la, lb in zip(ca.logprobs, cb.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
                assert la[t].rank == lb[t].rank
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)


def test_penalised_row_speculating_next_to_a_sampled_prefill(spec_pair, baseline):
    greedy = SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.5, ignore_eos=True)
    prompt = make_prompts(1, seed=13)[0]
    ref = output_ids(baseline.generate([prompt], greedy, use_tqdm=False))[0]
    engine = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3, **FIXED, **KV).llm_engine
    engine.add_request("a", prompt, greedy)
    engine.step()
    engine.step()
    engine.add_request("b", make_prompts(1, seed=14)[0], SamplingParams(temperature=0.5, max_tokens=8))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["a"].outputs[0].token_ids == ref
    assert len(done["b"].outputs[0].token_ids) == 8


def test_abort_mid_speculation_frees_blocks(spec_pair):
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **KV)
    engine = llm.llm_engine
    for i, p in enumerate(make_prompts(4, seed=5)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_usable_blocks
    engine.abort_request(["0", "1", "2", "3"])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    # The engine keeps working after the abort.
    assert len(llm.generate(make_prompts(2), GREEDY, use_tqdm=False)) == 2

"""The rejection sampler alone: exact greedy semantics and the target distribution when sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from vllm_spec.sample.metadata import SamplingMetadata, SamplingRow
from vllm_spec.sampling_params import SamplingParams
from vllm_spec.spec_decode.rejection_sampler import SyntheticDraws, rejection_sample

CPU = torch.device("cpu")


def _md(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    gens = generators or [None] * len(params)
    rows = [SamplingRow(p, [1], [], g) for p, g in zip(params, gens)]
    return SamplingMetadata.build(rows, 16, CPU, for_draft=True)


def _one_hot(tokens: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def test_greedy_accepts_matching_prefix_then_emits_target_token():
    V = 6
    # Target argmax per position: 1, 2, 3, 4 (the last is the bonus position).
    target = _one_hot([1, 2, 3, 4], V).unsqueeze(0).repeat(3, 1, 1)
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 2, 3]])
    out = rejection_sample(target, drafts, None, torch.tensor([3, 3, 3]), _md([SamplingParams(temperature=0)] * 3))
    assert out.tokens.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1]]
    assert out.num_accepted.tolist() == [3, 1, 0]


def test_greedy_from_precomputed_target_tokens():
    # The engine's greedy fast path passes the target's tokens, no [B, k+1, V] distributions.
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 2, 3]])
    greedy = _md([SamplingParams(temperature=0)] * 3)
    out = rejection_sample(None, drafts, None, torch.tensor([3, 2, 3]), greedy,
                           target_argmax=torch.tensor([[1, 2, 3, 4]] * 3))
    assert out.tokens.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1]]
    with pytest.raises(AssertionError, match="distributions"):
        rejection_sample(None, drafts, None, torch.tensor([3, 3, 3]), _md([SamplingParams(temperature=1)] * 3),
                         target_argmax=torch.tensor([[1, 2, 3, 4]] * 3))


def test_rows_with_fewer_drafts_take_their_bonus_early():
    V = 6
    target = _one_hot([1, 2, 3, 4], V).unsqueeze(0).repeat(3, 1, 1)
    drafts = torch.tensor([[1, 2, 0], [1, 0, 0], [5, 5, 5]])
    out = rejection_sample(target, drafts, None, torch.tensor([2, 1, 0]), _md([SamplingParams(temperature=0)] * 3))
    assert out.tokens.tolist() == [[1, 2, 3, -1], [1, 2, -1, -1], [1, -1, -1, -1]]


def _sample_many(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int):
    """n independent verifications of drafts drawn from q (or one fixed draft token when q is None)."""
    k, V = p.shape[0] - 1, p.shape[1]
    gen = torch.Generator().manual_seed(seed)
    if q is None:
        drafts = torch.randint(0, V, (n, k), generator=gen)
        draft_probs = None
    else:
        drafts = torch.multinomial(q.repeat(n, 1), 1, generator=gen).view(n, k)
        draft_probs = q.expand(n, k, V).contiguous()
    md = _md([SamplingParams(temperature=1.0)] * n)
    return rejection_sample(p.expand(n, k + 1, V).contiguous(), drafts, draft_probs, torch.full((n,), k), md, gen)


def _random_pq(V: int, k: int, seed: int, zero_q: bool):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=gen) * 2, dim=-1)
    q = torch.softmax(torch.randn(k, V, generator=gen) * 2, dim=-1)
    if zero_q:  # q has zeros where p has mass: only the recovery path can emit those tokens
        q[:, :3] = 0
        q = q / q.sum(-1, keepdim=True)
    return p, q


@pytest.mark.parametrize("zero_q", [False, True])
@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_emitted_tokens_follow_the_target_distribution(zero_q, deterministic_draft):
    """Each emitted position j is distributed as p_j (p does not depend on the prefix here).

    Bound: chi-square goodness of fit at every position, p-value > 1e-3 at a fixed seed
    with 40k samples; and the total-variation distance shrinks as samples grow.
    """
    V, k = 10, 3
    p, q = _random_pq(V, k, seed=7, zero_q=zero_q)
    q = None if deterministic_draft else q
    out = _sample_many(p, q, 40_000, seed=11)
    for j in range(k + 1):
        emitted = out.tokens[:, j][out.tokens[:, j] >= 0]
        counts = torch.bincount(emitted, minlength=V).double()
        expected = p[j].double() / p[j].double().sum() * counts.sum()
        keep = expected > 0
        assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
        exp_kept = expected[keep] * counts.sum() / expected[keep].sum()
        pvalue = stats.chisquare(counts[keep].numpy(), exp_kept.numpy()).pvalue
        assert pvalue > 1e-3, f"position {j}: chi-square p-value {pvalue:.2e}"

    tvs = []
    for n in (1_000, 8_000, 64_000):
        first = _sample_many(p, q, n, seed=3).tokens[:, 0]
        tvs.append(0.5 * (torch.bincount(first, minlength=V).double() / n - p[0].double()).abs().sum().item())
    assert tvs[2] < tvs[0] and tvs[2] < 0.015, tvs


def test_acceptance_rate_matches_theory():
    """P(accept draft at position 0) = sum_x min(p(x), q(x)); checked within 4 standard errors."""
    V, k, n = 10, 1, 40_000
    p, q = _random_pq(V, k, seed=5, zero_q=False)
    out = _sample_many(p, q, n, seed=9)
    expected = torch.minimum(p[0], q[0]).sum().item()
    rate = (out.num_accepted >= 1).double().mean().item()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / n) ** 0.5


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    V, k = 10, 3
    p, q = _random_pq(V, k, seed=1, zero_q=False)
    drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(0)).view(1, k)

    def run(batch: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, seed=42)] + [SamplingParams(temperature=1.0)] * (batch - 1)
        gens = [torch.Generator().manual_seed(42)] + [None] * (batch - 1)
        out = rejection_sample(p.expand(batch, k + 1, V).contiguous(), drafts.repeat(batch, 1),
                               q.expand(batch, k, V).contiguous(), torch.full((batch,), k), _md(params, gens),
                               torch.Generator().manual_seed(batch))
        return out.tokens[0].tolist()

    assert run(1) == run(5) == run(17)


def test_mixed_greedy_and_random_rows():
    V, k = 10, 2
    p, q = _random_pq(V, k, seed=2, zero_q=False)
    greedy_draft = p[:k].argmax(-1)
    drafts = torch.stack([greedy_draft, greedy_draft])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    out = rejection_sample(p.expand(2, k + 1, V).contiguous(), drafts, q.expand(2, k, V).contiguous(),
                           torch.tensor([k, k]), _md(params), torch.Generator().manual_seed(0))
    assert out.tokens[0].tolist() == greedy_draft.tolist() + [p[k].argmax().item()]


def test_synthetic_draws_keyed_by_request_and_position():
    """Each draft is accepted with the synthetic rate, from a draw that depends only on the request's key
    and the draft's position: shifting a row by one position shifts its draws; other rows change nothing."""
    V, k, B = 6, 4, 4000
    target = _one_hot([1, 2, 3, 4, 5], V).unsqueeze(0).expand(B, k + 1, V)
    drafts = torch.zeros(B, k, dtype=torch.long)
    keys = np.arange(B, dtype=np.int64) * 7919
    draws = SyntheticDraws(keys, np.full(B, 100, dtype=np.int64))

    def verify(d: SyntheticDraws, rows: int = B):
        return rejection_sample(target[:rows], drafts[:rows], None, torch.full((rows,), k),
                                _md([SamplingParams(temperature=0)] * rows), synthetic_acceptance_rate=0.7,
                                synthetic_uniforms=torch.from_numpy(d.uniforms(k)))

    out = verify(draws)
    # P(num_accepted >= 1) = 0.7 and the mean accepted length is 0.7 + 0.49 + 0.343 + 0.2401.
    assert abs((out.num_accepted >= 1).float().mean().item() - 0.7) < 0.03
    assert abs(out.num_accepted.float().mean().item() - 1.7731) < 0.06
    # Row 0 alone, and at the next position with one draft fewer: the same draws, shifted.
    assert verify(SyntheticDraws(keys[:1], draws.first_positions[:1]), rows=1).num_accepted.item() == \
        out.num_accepted[0].item()
    assert torch.equal(verify(draws).num_accepted, out.num_accepted)
    shifted = verify(SyntheticDraws(keys, draws.first_positions + 1))
    first_accepted = out.num_accepted >= 1   # rows whose first draft was accepted ...
    assert torch.equal(shifted.num_accepted[first_accepted].clamp(max=k - 1),
                       (out.num_accepted[first_accepted] - 1).clamp(max=k - 1))   # ... continue one position on


def test_synthetic_uniforms_are_splitmix64_of_key_and_position():
    """The host-side hash against splitmix64 in Python integers, negative keys (prompt hashes) included."""
    def splitmix64(x: int) -> float:
        m = (1 << 64) - 1
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return ((x ^ (x >> 31)) >> 40) / (1 << 24)

    keys, first = [-(2 ** 63), -1, 0, 12345, 2 ** 63 - 1], [0, 7, 100, 4096, 3]
    u = SyntheticDraws(np.asarray(keys, dtype=np.int64), np.asarray(first, dtype=np.int64)).uniforms(3)
    assert u.shape == (5, 3)
    for r, (key, pos) in enumerate(zip(keys, first)):
        for j in range(3):
            assert u[r, j] == splitmix64(key * 1000003 + pos + j), (r, j)


def test_per_row_synthetic_acceptance_overrides_the_engine_rate():
    V = 6
    target = _one_hot([1, 2, 3, 4], V).unsqueeze(0).repeat(4, 1, 1)
    drafts = torch.tensor([[5, 5, 5], [5, 5, 5], [5, 5, 5], [1, 2, 5]])   # the target would accept 0, 0, 0, 2
    rates = [1.0, 0.0, None, None]
    md = _md([SamplingParams(temperature=0, extra_args=None if r is None else {"synthetic_acceptance_rate": r})
              for r in rates])
    num_drafts = torch.tensor([3, 3, 3, 3])
    out = rejection_sample(target, drafts, None, num_drafts, md)
    assert out.num_accepted.tolist() == [3, 0, 0, 2]   # rows without a rate are verified for real
    assert out.tokens[0].tolist() == [5, 5, 5, 4]
    out = rejection_sample(target, drafts, None, num_drafts, md, synthetic_acceptance_rate=1.0)
    assert out.num_accepted.tolist() == [3, 0, 3, 3]   # the engine-wide rate fills in for them
    assert rejection_sample(target, drafts, None, num_drafts, _md([SamplingParams(temperature=0)] * 4),
                            synthetic_acceptance_rate=0.0).num_accepted.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("draft_probs", [True, False])
def test_a_zero_uniform_draw_never_accepts_a_token_the_target_rules_out(monkeypatch, draft_probs):
    """torch.rand can return exactly 0: the test u * q < p is strict, so a draft token with p = 0 (masked by
    allowed_token_ids, min_tokens, bad_words, top-k ...) is rejected even then, with and without q."""
    import vllm_spec.spec_decode.rejection_sampler as rs

    monkeypatch.setattr(rs, "_uniform", lambda shape, *args: torch.zeros(shape))
    target = torch.tensor([[[0.0, 0.5, 0.5, 0.0, 0.0]] * 2])       # [B=1, k+1=2, V]: token 0 ruled out
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.0]]]) if draft_probs else None
    out = rejection_sample(target, torch.tensor([[0]]), q, torch.tensor([1]), _md([SamplingParams(temperature=1)]),
                           generator=torch.Generator().manual_seed(0))
    assert out.num_accepted.tolist() == [0]
    assert out.tokens[0, 0].item() in (1, 2)

"""The one-kernel greedy verification against rejection_sample's torch ops: same tokens, same counts."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.sample.metadata import SamplingMetadata, SamplingRow
from vllm_spec.sampling_params import SamplingParams
from vllm_spec.spec_decode import greedy_verify
from vllm_spec.spec_decode.rejection_sampler import rejection_sample

pytestmark = pytest.mark.gpu


def _greedy_md(rates: list[float | None]) -> SamplingMetadata:
    params = [SamplingParams(temperature=0, extra_args=None if r is None else {"synthetic_acceptance_rate": r})
              for r in rates]
    return SamplingMetadata.build([SamplingRow(p, [1], [], None) for p in params], 64, torch.device("cuda"),
                                  for_draft=True)


def _both(monkeypatch, *args, **kwargs):
    fused = rejection_sample(*args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(greedy_verify, "available", lambda _t: False)
        ref = rejection_sample(*args, **kwargs)
    return fused, ref


@pytest.mark.parametrize("B, k", [(1, 0), (3, 0), (1, 1), (1, 4), (16, 4), (37, 3), (256, 8), (5, 7)])
@pytest.mark.parametrize("synthetic", ["none", "engine", "per_row"])
def test_greedy_verify_matches_the_torch_ops(monkeypatch, B, k, synthetic):
    g = torch.Generator(device="cuda").manual_seed(B * 10 + k)
    target = torch.randint(0, 5, (B, k + 1), device="cuda", generator=g)
    # Drafts: a wider tensor's view (the proposals' columns), equal to the target often enough to accept.
    wide = torch.randint(0, 5, (B, k + 3), device="cuda", generator=g)
    drafts = wide[:, 1:k + 1]
    match = torch.rand(B, k, device="cuda", generator=g) < 0.6
    drafts[match] = target[:, :k][match]
    num_drafts = torch.randint(0, k + 1, (B,), device="cuda", generator=g)
    if B > 1:   # the last row drafts the target's own tokens: every case has a fully accepted row
        num_drafts[-1] = k
        drafts[-1] = target[-1, :k]
    rates = [None] * B if synthetic != "per_row" else [None if i % 3 == 0 else 0.1 * (i % 10) for i in range(B)]
    engine_rate = 0.7 if synthetic == "engine" else None
    # As SyntheticDraws makes them: multiples of 2^-24 in float64 (exact in the kernel's float32).
    uniforms = torch.randint(0, 1 << 24, (B, k), device="cuda", generator=g).double() / (1 << 24)
    fused, ref = _both(monkeypatch, None, drafts, None, num_drafts, _greedy_md(rates),
                       synthetic_acceptance_rate=engine_rate, target_argmax=target,
                       synthetic_uniforms=uniforms if synthetic != "none" else None)
    assert torch.equal(fused.tokens, ref.tokens)
    assert torch.equal(fused.num_accepted.long(), ref.num_accepted.long())


def test_greedy_verify_stops_at_each_rows_drafts():
    """Rows of 0, 1 and all drafts; a draft past a row's count never counts even when it matches."""
    target = torch.tensor([[3, 4, 5], [3, 4, 5], [3, 4, 5]], device="cuda")
    drafts = torch.tensor([[3, 4], [3, 4], [3, 9]], device="cuda")
    out = rejection_sample(None, drafts, None, torch.tensor([0, 1, 2], device="cuda"), _greedy_md([None] * 3),
                           target_argmax=target)
    assert out.tokens.tolist() == [[3, -1, -1], [3, 4, -1], [3, 4, -1]]
    assert out.num_accepted.tolist() == [0, 1, 1]


def _compiled_variants() -> int:
    caches = getattr(greedy_verify._greedy_verify_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no device_caches to count compiled variants in")
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_warm_up_compiles_every_variant_serving_meets(batch):
    """After warm_up(k), verifying any k' <= k, any batch, with or without synthetic draws (float64,
    as the scorer sends them), compiles nothing more."""
    greedy_verify.warm_up(4, torch.device("cuda"))
    before = _compiled_variants()
    for k in range(1, 5):
        drafts = torch.randint(0, 9, (batch, 4), device="cuda")[:, :k]   # a view, as the scorer's
        argmax = torch.randint(0, 9, (batch, k + 1), device="cuda")
        num_drafts = torch.randint(0, k + 1, (batch,), device="cuda")
        rates = torch.rand(batch, device="cuda")
        greedy_verify.greedy_verify(argmax, drafts, num_drafts, None, None)
        greedy_verify.greedy_verify(argmax, drafts, num_drafts, rates, torch.rand(batch, k, device="cuda",
                                                                                   dtype=torch.float64))
    assert _compiled_variants() == before

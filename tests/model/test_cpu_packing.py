"""Linear weights packed for the CPU's oneDNN give the plain layout's results (the path where
cpu_linear's kernel is not available: it is switched off here)."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.model import cpu_linear
from vllm_spec.model.layers import linear, pack_for_cpu


@pytest.fixture(autouse=True)
def _no_cpu_kernel(monkeypatch):
    monkeypatch.setattr(cpu_linear, "dtypes", lambda: frozenset())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 300])
def test_packed_linear_matches_plain(dtype, tol, rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 40).to(dtype), torch.randn(96).to(dtype)
    x = torch.randn(rows * 2, 40).to(dtype)[::2]   # a strided view, as the draft's hidden[1::2]
    packed = pack_for_cpu(weight)
    if not torch.backends.mkldnn.is_available():
        assert packed is weight
    expected = torch.nn.functional.linear(x, weight, bias)
    got = linear(x, packed, bias)
    assert got.dtype == dtype and got.shape == expected.shape
    if rows:
        assert (got.float() - expected.float()).abs().max() <= tol * expected.float().abs().max()


def test_weights_that_cannot_be_packed_are_used_as_they_are():
    half = torch.randn(8, 4, dtype=torch.float16)
    assert pack_for_cpu(half) is half
    if torch.cuda.is_available():
        gpu = torch.randn(8, 4, device="cuda")
        assert pack_for_cpu(gpu) is gpu


def test_a_dtype_this_cpu_cannot_pack_stays_plain(monkeypatch):
    """oneDNN refuses bfloat16 on CPUs without its instructions: such weights keep the plain layout
    (asked once per dtype), others still pack."""
    from vllm_spec.model import layers

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(layers, "_UNPACKABLE", set())
    asked = []
    reorder = layers._reorder_linear_weight

    def refuse_bf16(weight):
        asked.append(weight.dtype)
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")
        return reorder(weight)

    monkeypatch.setattr(layers, "_reorder_linear_weight", refuse_bf16)
    bf16 = torch.randn(8, 4, dtype=torch.bfloat16)
    assert pack_for_cpu(bf16) is bf16 and pack_for_cpu(bf16) is bf16
    assert pack_for_cpu(torch.randn(8, 4)).is_mkldnn
    assert asked == [torch.bfloat16, torch.float32]
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(linear(x, pack_for_cpu(bf16)), torch.nn.functional.linear(x, bf16))


def test_engine_on_cpu_multiplies_by_packed_weights(tiny_llama):
    """Built on the CPU, every linear layer of the model multiplies by a packed copy."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    from vllm_spec import LLM, SamplingParams
    from vllm_spec.model.layers import LinearBase

    llm = LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu")
    model = llm.llm_engine.executor.worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.packed is not None and m.packed.is_mkldnn for m in linears)
    # The plain copies of unshared weights are released (one element each), shapes kept.
    released = [m for m in linears if not m.shares_weight]
    assert released and all(m.weight.untyped_storage().nbytes() == m.weight.element_size() for m in released)
    assert all(m.weight.numel() == m.packed.numel() for m in linears)
    assert model.embed_tokens.weight.isfinite().all()
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8

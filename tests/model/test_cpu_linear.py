"""The CPU's float32 linear kernel (csrc/cpu/rows_linear.cpp): against torch in float64, the same result
for a row whatever the batch, its place in the engine, and the fallback without it."""

from __future__ import annotations

import pytest
import torch

from vllm_spec.model import cpu_linear
from vllm_spec.model.layers import LinearBase, linear, pack_for_cpu

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX2 CPU kernel here (or not buildable)")


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 16, 17, 18, 19, 20, 21, 64, 300])
@pytest.mark.parametrize("n, k", [(1, 8), (3, 13), (37, 100), (256, 576), (130, 1536)])
def test_kernel_matches_float64(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for w in (weight, weight.bfloat16()):   # (bf16 weights: sums in float32 all the same)
        expected = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        got = cpu_linear.kernel().rows_linear(x, w) + bias
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        # float32 sums of k products: error bound ~ k * eps * sum |x_i w_i| (here well under it).
        scale = torch.nn.functional.linear(x.double().abs(), w.double().abs(), bias.double().abs())
        assert ((got.double() - expected).abs() <= 4 * k * 2 ** -24 * scale + 1e-30).all()


@needs_kernel
def test_bfloat16_rounds_the_float32_sum_once():
    """In bfloat16 the result is the float32 sum rounded to bf16 (as torch's own bf16 matmul)."""
    if torch.bfloat16 not in cpu_linear.dtypes():
        pytest.skip("this CPU has bf16 arithmetic: oneDNN serves bf16")
    gen = torch.Generator().manual_seed(3)
    x, weight, bias = (torch.randn(5, 100, generator=gen).bfloat16(), torch.randn(37, 100, generator=gen).bfloat16(),
                       torch.randn(37, generator=gen).bfloat16())
    got = linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and pack_for_cpu(weight) is weight
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    # Within float32's error of the exact sum before the one rounding: at most one bf16 step off.
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    # torch's bf16 result rounds the same sum in another order: equal, or one bf16 step apart.
    theirs = torch.nn.functional.linear(x, weight, bias)
    assert ((got.double() - theirs.double()).abs() <= exact.abs() * 2 ** -7 + 1e-6).all()


def test_bfloat16_is_left_to_onednn_on_cpus_with_bf16_arithmetic(monkeypatch):
    from vllm_spec.model import cpu_linear as module

    monkeypatch.setattr(module, "available", lambda: True)
    try:
        for native, expected in ((True, {torch.float32}), (False, {torch.float32, torch.bfloat16})):
            monkeypatch.setattr(module, "cpu_has_native_bf16", lambda native=native: native)
            module.dtypes.cache_clear()
            assert module.dtypes() == expected
    finally:
        monkeypatch.undo()
        module.dtypes.cache_clear()


@needs_kernel
@pytest.mark.parametrize("k", [576, 579])   # (579: the sums' scalar tail)
def test_a_row_gets_the_same_bits_in_any_batch(k):
    """A token scored in a (k+1)-row verification gets exactly the logits of a 1-row step."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(203, k, generator=gen)
    x = torch.randn(11, k, generator=gen)
    x = torch.cat([x, torch.randn(251, k, generator=gen)])   # 262 rows: past the 256-row sweep
    for w in (weight, weight.bfloat16()):
        alone = torch.cat([cpu_linear.kernel().rows_linear(x[i:i + 1], w) for i in range(len(x))])
        for rows in [*range(2, 25), *range(255, 263)]:
            assert torch.equal(cpu_linear.kernel().rows_linear(x[:rows], w), alone[:rows]), rows
        assert torch.equal(cpu_linear.kernel().rows_linear(x[4:9].contiguous(), w), alone[4:9])


@needs_kernel
def test_layers_use_it_for_float32_on_plain_weights():
    weight, bias = torch.randn(48, 32), torch.randn(48)
    assert pack_for_cpu(weight) is weight   # no oneDNN copy: the kernel reads the plain layout
    x = torch.randn(2, 3, 8, 32)[:, :, ::2]   # leading dims and a strided view
    got = linear(x, weight, bias)
    assert got.shape == (2, 3, 4, 48)
    assert torch.equal(got, cpu_linear.linear(x, weight, bias))   # the kernel's own bits
    assert torch.allclose(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert cpu_linear.handles(x, weight)
    assert cpu_linear.handles(x.bfloat16(), weight.bfloat16()) == (torch.bfloat16 in cpu_linear.dtypes())
    assert not cpu_linear.handles(x.half(), weight.half()) and not cpu_linear.handles(x, weight.bfloat16())
    assert not cpu_linear.handles(x, weight.T)   # (not contiguous)
    trained = weight.clone().requires_grad_()   # (no backward: autograd's path)
    assert not cpu_linear.handles(x, trained)
    linear(x, trained).sum().backward()
    assert trained.grad is not None


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    cpu_linear._module.cache_clear()
    cpu_linear.dtypes.cache_clear()
    try:
        assert not cpu_linear.available()
        weight = torch.randn(8, 4)
        assert not cpu_linear.handles(torch.randn(2, 4), weight)
        if torch.backends.mkldnn.is_available():
            assert pack_for_cpu(weight).is_mkldnn   # the oneDNN path as before
    finally:
        monkeypatch.undo()
        cpu_linear._module.cache_clear()
        cpu_linear.dtypes.cache_clear()


@needs_kernel
def test_engine_keeps_plain_weights_and_its_outputs(tiny_llama, monkeypatch):
    """With the kernel the model keeps no packed copies, and its greedy tokens and logprobs are those
    of the oneDNN path (within float32 rounding)."""
    from vllm_spec import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = ["hello world", "the quick brown fox jumps"]
    llm = LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu")
    model = llm.llm_engine.executor.worker.runner.model
    assert all(m.packed is None for m in model.modules() if isinstance(m, LinearBase))
    ours = llm.generate(prompts, params, use_tqdm=False)
    del llm
    monkeypatch.setattr(cpu_linear, "dtypes", lambda: frozenset())
    ref = LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu").generate(prompts, params,
                                                                                           use_tqdm=False)
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (ta, va), = [(t, v) for t, v in la.items() if v.rank == 1]
            assert abs(va.logprob - lb[ta].logprob) < 1e-4


def test_other_devices_never_ask_for_the_kernel(monkeypatch):
    """A GPU model's linear layers (here: tensors on the meta device) must not build the CPU kernel."""
    def no_build():
        raise AssertionError("the CPU kernel was asked for")

    monkeypatch.setattr(cpu_linear, "dtypes", no_build)
    x, weight = torch.empty(2, 4, device="meta"), torch.empty(3, 4, device="meta")
    assert not cpu_linear.handles(x, weight)
    assert pack_for_cpu(weight) is weight
    # Nor do CPU dtypes it never takes.
    for dtype in (torch.float16, torch.float64):
        assert not cpu_linear.handles(torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype))


@needs_kernel
def test_weights_the_kernel_cannot_take_are_still_packed():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    strided = torch.randn(8, 12)[:, ::2]   # (not contiguous)
    assert pack_for_cpu(strided).is_mkldnn
    plain = torch.randn(8, 6)
    assert pack_for_cpu(plain) is plain

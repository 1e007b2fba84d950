"""The CPU's float32 linear kernel (csrc/cpu/rows_linear.cpp): against torch in float64, the same result
for a row whatever the batch, its place in the engine, and the fallback without it."""

from __future__ import annotations

import pytest
import torch

from vllm_spec import cpu_ops
from vllm_spec.model import cpu_linear, fused
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


@pytest.mark.parametrize("served, cpu_property, cases", [
    ("dtypes", "cpu_has_native_bf16", [(True, {torch.float32}), (False, {torch.float32, torch.bfloat16})]),
    ("narrow_dtypes", "cpu_flags", [(frozenset({"avx2", "fma", "f16c"}), {torch.bfloat16, torch.float16}),
                                    (frozenset({"avx2", "fma"}), {torch.bfloat16})]),
], ids=["bfloat16_left_to_onednn_on_cpus_with_bf16_arithmetic", "float16_storage_needs_f16c"])
def test_served_dtypes_follow_the_cpu(monkeypatch, served, cpu_property, cases):
    cached = getattr(cpu_linear, served)
    monkeypatch.setattr(cpu_linear, "available", lambda: True)
    try:
        for value, expected in cases:
            monkeypatch.setattr(cpu_linear, cpu_property, lambda value=value: value)
            cached.cache_clear()
            assert cached() == expected
    finally:
        monkeypatch.undo()
        cached.cache_clear()


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
    assert not cpu_linear.handles(x.half(), weight.half())
    # float32 rows against a half-precision weight: a float32 weight stored narrowed (see below).
    assert cpu_linear.handles(x, weight.bfloat16()) == (torch.bfloat16 in cpu_linear.narrow_dtypes())
    assert cpu_linear.handles(x, weight.half()) == (torch.float16 in cpu_linear.narrow_dtypes())
    assert not cpu_linear.handles(x, weight.T)   # (not contiguous)
    trained = weight.clone().requires_grad_()   # (no backward: autograd's path)
    assert not cpu_linear.handles(x, trained)
    linear(x, trained).sum().backward()
    assert trained.grad is not None


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    caches = (cpu_ops, cpu_linear.dtypes, cpu_linear.narrow_dtypes)
    for cache in caches:
        cache.cache_clear()
    try:
        assert not cpu_linear.available()
        weight = torch.randn(8, 4)
        assert not cpu_linear.handles(torch.randn(2, 4), weight)
        if torch.backends.mkldnn.is_available():
            assert pack_for_cpu(weight).is_mkldnn   # the oneDNN path as before
        exact = weight.bfloat16().float()
        assert not cpu_linear.handles(torch.randn(2, 4), exact.bfloat16()) and pack_for_cpu(exact).dtype == torch.float32
    finally:
        monkeypatch.undo()
        for cache in caches:
            cache.cache_clear()


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
    monkeypatch.setattr(cpu_ops, "available", no_build)
    x, weight = torch.empty(2, 4, device="meta"), torch.empty(3, 4, device="meta")
    assert not cpu_linear.handles(x, weight)
    assert pack_for_cpu(weight) is weight
    assert not fused._cpu_ok(x, torch.empty(4, device="meta"))   # (the elementwise ops' check too)
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


@needs_kernel
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_exact_half_weights_are_stored_narrow_with_the_same_products(half):
    """A float32 weight that a half type holds exactly (a half-precision checkpoint run in float32) is
    stored in it: half the bytes read, the float32 products bit for bit, at any row count."""
    if half not in cpu_linear.narrow_dtypes():
        pytest.skip(f"{half} storage needs F16C")
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(67, 579, generator=gen).to(half).float()   # (579: the sums' scalar tail)
    if half == torch.float16:
        weight[0, 0] = 1 + 2 ** -10   # float16 holds it, bfloat16 does not
    stored = pack_for_cpu(weight)
    assert stored.dtype == half and torch.equal(stored.float(), weight)
    x = torch.randn(262, 579, generator=gen)
    for rows in (1, 2, 3, 5, 9, 17, 20, 262):
        assert torch.equal(linear(x[:rows], stored), linear(x[:rows], weight)), rows
    bias = torch.randn(67, generator=gen)
    assert torch.equal(linear(x[:5], stored, bias), linear(x[:5], weight, bias))
    assert pack_for_cpu(weight) is stored   # one copy per weight: layers that share it share the copy
    rows = x[:3].clone().requires_grad_()   # (autograd: not the kernel's; the copy widened, exactly)
    linear(rows, stored).sum().backward()
    torch.testing.assert_close(rows.grad, weight.sum(0).expand(3, -1))
    with pytest.raises(RuntimeError):   # (only float32 rows widen a half weight, as F.linear would not)
        linear(x[:3].double(), stored)
    weight.mul_(1 + 2 ** -9)   # written since: a new copy (float16 holds it; bfloat16 not)
    assert pack_for_cpu(weight) is not stored and torch.equal(pack_for_cpu(weight).float(), weight)


@needs_kernel
def test_weights_no_half_type_holds_stay_float32():
    gen = torch.Generator().manual_seed(6)
    full = torch.randn(8, 16, generator=gen)   # 24-bit mantissas
    assert pack_for_cpu(full) is full
    with_nan = torch.randn(8, 16, generator=gen).bfloat16().float()
    with_nan[3, 3] = float("nan")   # (NaN never equals itself: kept as it is)
    assert pack_for_cpu(with_nan) is with_nan
    tiny = torch.full((8, 16), 2.0 ** -30)   # bfloat16 holds it, float16 underflows
    assert pack_for_cpu(tiny).dtype == torch.bfloat16
    neither = torch.full((8, 16), 1 + 2 ** -10)
    neither[0, 0] = 2.0 ** -30
    assert pack_for_cpu(neither) is neither
    on_disk = torch.randn(8, 16, generator=gen).bfloat16()   # a bf16 model's own weight: not a copy
    assert cpu_linear.narrowed(on_disk) is on_disk


@needs_kernel
def test_engine_runs_a_half_precision_checkpoint_in_float32_from_narrow_weights(tiny_llama, tmp_path, monkeypatch):
    """A float16 checkpoint loaded as float32: every linear layer reads a float16 copy, and the greedy
    tokens and logprobs are bit for bit those of the float32 weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm_spec import LLM, SamplingParams

    if torch.float16 not in cpu_linear.narrow_dtypes():
        pytest.skip("float16 storage needs F16C")
    folder = tmp_path / "fp16"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v.half().contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["hello world", "the quick brown fox jumps"]

    def run():
        llm = LLM(model=str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22, device="cpu")
        model = llm.llm_engine.executor.worker.runner.model
        stored = {m.packed.dtype if m.packed is not None else m.weight.dtype
                  for m in model.modules() if isinstance(m, LinearBase)}
        return stored, [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                        for o in llm.generate(prompts, params, use_tqdm=False)]

    stored, ours = run()
    assert stored == {torch.float16}
    monkeypatch.setattr(cpu_linear, "narrowed", lambda weight: weight)
    stored, ref = run()
    assert stored == {torch.float32}
    assert ours == ref

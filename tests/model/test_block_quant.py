"""Float32 weights that are exactly llama.cpp blocks (a GGUF checkpoint's, dequantized) held as blocks (Q4_1,
Q8_0, or U8X16 for every other format): found bit for bit or not at all, multiplied by the CPU kernel to the
float32 products bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vllm_spec.model import block_quant, cpu_linear
from vllm_spec.model.block_quant import BlockWeight
from vllm_spec.model.layers import LinearBase, linear, pack_for_cpu

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX2 CPU kernel here (or not buildable)")
FORMATS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
T = gguf.GGMLQuantizationType
QTYPES = {**FORMATS, "q4_0": T.Q4_0, "q5_0": T.Q5_0, "q5_1": T.Q5_1,
          "q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
# Byte offsets of a k-quant block's float16 scales (gguf-py cannot quantize to k-quants: random blocks with
# sane scales stand in for a file's).
K_QUANT_SCALES = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
# 4-bit formats in the Q4_1 layout (Q4_K's d: a float16 times a 6-bit scale); every other one as U8X16
HELD_AS = {**{f: "u8x16" for f in QTYPES}, "q4_0": "q4_1", "q4_1": "q4_1", "q4_k": "q4_1", "q8_0": "q8_0"}


def gguf_values(n: int, k: int, fmt: str, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """What gguf_loader yields for a tensor llama.cpp stored in this format: its dequantized float32 values
    (n k a multiple of 256 for the k-quants: their blocks may span rows)."""
    rng = np.random.default_rng(seed)
    qtype = QTYPES[fmt]
    if fmt in K_QUANT_SCALES:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n * k // block_elems, block_bytes), dtype=np.uint8)
        for at in K_QUANT_SCALES[fmt]:
            d = (rng.standard_normal(len(raw)) * 0.02 * scale).astype(np.float16)
            if len(K_QUANT_SCALES[fmt]) == 2:   # d and dmin of w = d sc q - dmin m: llama.cpp's are >= 0
                d = np.abs(d)
            raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
        values = gguf.quants.dequantize(raw, qtype)
    else:
        data = rng.standard_normal((n, k)).astype(np.float32) * scale
        values = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(n, k).copy())


def width(fmt: str, k: int) -> int:
    """k rounded up to whole blocks of the format."""
    return -(-k // 256) * 256 if fmt in K_QUANT_SCALES else k


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (a zero's sign aside: it never reaches the kernel's sums, which start from +0.0)."""
    return a.shape == b.shape and torch.equal(a, b)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("fmt", QTYPES)
@pytest.mark.parametrize("n, k, chunk", [(1, 32, 4096), (37, 96, 4096), (10, 64, 3), (3, 4096, 4096)])
def test_gguf_blocks_are_found_and_give_back_every_bit(monkeypatch, fmt, n, k, chunk):
    monkeypatch.setattr(block_quant, "_CHUNK_ROWS", chunk)   # (several chunks of rows)
    k = width(fmt, k)
    weight = gguf_values(n, k, fmt, seed=n + k, scale=0.05)
    found = block_quant.find(weight)
    held = HELD_AS[fmt]
    assert found is not None and found.format == held and found.shape == weight.shape
    assert found.blocks.dtype == torch.uint8 and found.blocks.shape == (n, k // 32 * block_quant.BLOCK_BYTES[held])
    assert same_values(found.dequantize(), weight)


def test_q4_0_and_q4_1_blocks_mix_in_one_weight():
    weight = torch.cat([gguf_values(3, 64, "q4_0", seed=1), gguf_values(3, 64, "q4_1", seed=2)], 1)
    found = block_quant.find(weight)
    assert found is not None and found.format == "q4_1" and same_values(found.dequantize(), weight)


def test_rows_of_other_formats_mix_in_one_weight():
    """A fused projection of a Q4_K_M file (q and k in Q5_0, v in Q8_0 or Q6_K; gate and up in Q4_K)."""
    weight = torch.cat([gguf_values(4, 256, fmt, seed=i) for i, fmt in enumerate(("q5_0", "q8_0", "q6_k", "q4_k"))])
    found = block_quant.find(weight)
    assert found is not None and found.format == "u8x16" and same_values(found.dequantize(), weight)


def test_q4_k_blocks_mix_with_q4_1_blocks_of_rounded_values():
    """Q4_K's blocks are found by the general recovery, Q4_1's with |m| >> d (values rounded) by the float16
    candidates after it: both land in the Q4_1 layout, each block where it belongs."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (8, 2, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    rounded = q4_1_values(torch.full((8, 2), 715 * 2.0 ** -24), torch.full((8, 2), -49.40625), q)
    weight = torch.cat([gguf_values(8, 256, "q4_k", seed=2), rounded, gguf_values(8, 64, "q4_k", seed=3)], 1)
    found = block_quant.find(weight)
    assert found is not None and found.format == "q4_1" and same_values(found.dequantize(), weight)


def test_constant_and_zero_blocks_are_exact_too():
    weight = torch.zeros(4, 64)
    weight[1] = 0.5
    weight[2, 32:] = -3.0
    found = block_quant.find(weight)
    assert found is not None and same_values(found.dequantize(), weight)


@pytest.mark.parametrize("case", ["random", "k_not_blocks", "nan", "inf", "later_row",
                                  "float64", "bfloat16", "vector", "empty", "meta"])
def test_weights_that_are_not_blocks_are_left_alone(monkeypatch, case):
    monkeypatch.setattr(block_quant, "_CHUNK_ROWS", 2)
    weight = gguf_values(7, 64, "q4_1")
    if case == "random":
        weight = torch.randn(7, 64)
    elif case == "k_not_blocks":
        weight = weight[:, :48].contiguous()
    elif case in ("nan", "inf"):
        weight[5, 40] = float(case)
    elif case == "later_row":   # the first chunks are blocks, the last is not
        weight[6, 7] += 2 ** -20
    elif case in ("float64", "bfloat16"):
        weight = weight.to(getattr(torch, case))
    elif case == "vector":
        weight = weight[0]
    elif case == "empty":
        weight = weight[:0]
    else:
        weight = weight.to("meta")
    assert block_quant.find(weight) is None


@needs_kernel
@pytest.mark.parametrize("fmt", QTYPES)
@pytest.mark.parametrize("n, k", [(1, 32), (5, 96), (37, 608), (52, 64), (130, 1536)])
def test_kernel_gives_the_float32_products_bit_for_bit(fmt, n, k):
    """At every row count (one pass widening as it reads, or panels of 12 weight rows widened once for
    many rows, in passes of 3 and 4) and for rows of weights past the last panel (tiles of 4, single rows),
    the products and sums are the float32 weight's."""
    k = width(fmt, k)
    weight = gguf_values(n, k, fmt, seed=k, scale=0.1)
    stored = pack_for_cpu(weight)
    assert isinstance(stored, BlockWeight) and stored.format == HELD_AS[fmt]
    assert pack_for_cpu(weight) is stored   # one copy per weight: layers that share it share the copy
    gen = torch.Generator().manual_seed(n)
    x, bias = torch.randn(300, k, generator=gen), torch.randn(n, generator=gen)
    alone = torch.cat([linear(x[i:i + 1], stored) for i in range(300)])
    for rows in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 20, 257, 262, 300):
        assert same_bits(linear(x[:rows], stored), linear(x[:rows], weight)), rows
        assert same_bits(linear(x[:rows], stored), alone[:rows]), rows   # a row's bits whatever the batch
    assert same_bits(linear(x[:5], stored, bias), linear(x[:5], weight, bias))
    assert same_bits(linear(x[:2].view(2, 1, k), stored), linear(x[:2], weight).view(2, 1, n))


@pytest.mark.parametrize("fmt", FORMATS)
def test_autograd_multiplies_the_exact_weight_and_other_dtypes_fail_as_with_it(fmt):
    weight = gguf_values(9, 64, fmt, seed=3)
    stored = block_quant.find(weight)
    rows = torch.randn(3, 64, requires_grad=True)
    linear(rows, stored).sum().backward()
    torch.testing.assert_close(rows.grad, weight.sum(0).expand(3, -1), rtol=0, atol=0)
    for dtype in (torch.float64, torch.bfloat16):
        x = torch.randn(4, 64, dtype=dtype)
        assert not cpu_linear.handles(x, stored)
        with pytest.raises(RuntimeError):
            torch.nn.functional.linear(x, weight)
        with pytest.raises(RuntimeError):
            linear(x, stored)


def test_only_cpu_float32_rows_on_a_built_kernel_take_the_blocks(monkeypatch):
    weight = gguf_values(4, 32, "q8_0")
    stored = block_quant.find(weight)
    assert not cpu_linear.handles(torch.empty(2, 32, device="meta"), stored)
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    assert not cpu_linear.handles(torch.randn(2, 32), stored)
    x = torch.randn(2, 32)
    assert same_bits(linear(x, stored), linear(x, weight))   # (multiplied as the plain weight is)


def q4_1_values(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Blocks [rows, blocks] of float16-valued d and m and q [rows, blocks, 32] in 0..15 as llama.cpp
    dequantizes them: d * q + m in float32, one rounding."""
    return (d.half().float()[..., None] * q.float() + m.half().float()[..., None]).reshape(q.shape[0], -1)


@needs_kernel
@pytest.mark.parametrize("case", ["scale_far_from_the_nearest_guess", "subnormal_scale", "zero_scale",
                                  "tiny_q8_0_with_negative_zeros"])
def test_hard_blocks_are_found_and_multiplied_bit_for_bit(case):
    gen = torch.Generator().manual_seed(11)
    q = torch.randint(0, 16, (9, 3, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15   # (the block's minimum and maximum)
    if case == "scale_far_from_the_nearest_guess":   # |m| >> d: the maximum's rounding moves (max - m) / 15
        weight, fmt = q4_1_values(torch.full((9, 3), 715 * 2.0 ** -24), torch.full((9, 3), -49.40625), q), "q4_1"
    elif case == "subnormal_scale":
        weight, fmt = q4_1_values(torch.full((9, 3), 3 * 2.0 ** -24), torch.randn(9, 3, generator=gen) * 1e-3, q), "q4_1"
    elif case == "zero_scale":   # constant blocks
        weight, fmt = q4_1_values(torch.zeros(9, 3), torch.randn(9, 3, generator=gen), q), "q4_1"
    else:   # values too small for a float16 scale: 0 * q, -0.0 where q < 0
        weight, fmt = torch.cat([gguf_values(9, 64, "q8_0", scale=1e-9), gguf_values(9, 32, "q8_0")], 1), "q8_0"
        assert (weight.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()
    stored = block_quant.find(weight)
    assert stored is not None and stored.format == fmt and same_values(stored.dequantize(), weight)
    x = torch.randn(20, weight.shape[1], generator=gen)
    for rows in (1, 2, 5, 7, 20):
        assert same_bits(cpu_linear.linear(x[:rows], stored), cpu_linear.linear(x[:rows], weight)), rows


@needs_kernel
def test_a_weight_written_since_gets_new_blocks():
    weight = gguf_values(8, 64, "q4_1", scale=0.1)
    stored = pack_for_cpu(weight)
    weight.mul_(2)   # (still Q4_1 values: d and m doubled)
    again = pack_for_cpu(weight)
    assert again is not stored and isinstance(again, BlockWeight) and same_values(again.dequantize(), weight)


@needs_kernel
@pytest.mark.parametrize("mlp, attention, held", [
    (["q4_0"], ["q4_1"], {"q4_1"}),
    # a Q4_K_M-like mix (and the other k-quants): fused projections of rows in several formats
    (["q4_k"], ["q5_0", "q5_1", "q6_k", "q5_k", "q2_k", "q3_k"], {"q4_1", "u8x16"})])
def test_engine_runs_a_gguf_quantized_checkpoint_from_blocks(tiny_llama, tmp_path, monkeypatch, mlp, attention, held):
    """Weights that are llama.cpp blocks' values (linear layers; Q8_0: embedding, LM head), loaded as float32:
    every linear layer reads its blocks, the plain copies are freed, and the greedy tokens and logprobs are
    bit for bit those of the float32 weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm_spec import LLM, SamplingParams

    folder = tmp_path / "blocks"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(str(folder / "model.safetensors"))
    for i, (name, w) in enumerate(sorted(weights.items())):
        if w.dim() == 2:
            kinds = mlp if "mlp" in name else attention
            fmt = "q8_0" if "embed" in name or "lm_head" in name else kinds[i % len(kinds)]
            weights[name] = gguf_values(*w.shape, fmt, seed=i, scale=0.1)
    save_file(weights, str(folder / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["hello world", "the quick brown fox jumps"]

    def run():
        llm = LLM(model=str(folder), dtype="float32", kv_cache_memory_bytes=1 << 22, device="cpu")
        model = llm.llm_engine.executor.worker.runner.model
        # (format, plain weight kept): freed unless another module may share it (the LM head)
        stored = {(m.packed.format if isinstance(m.packed, BlockWeight) else str(m.weight.dtype),
                   m.weight.is_contiguous()) for m in model.modules() if isinstance(m, LinearBase)}
        return stored, [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                        for o in llm.generate(prompts, params, use_tqdm=False)]

    stored, ours = run()
    assert stored == {(f, False) for f in held} | {("q8_0", True)}   # (a freed weight: one NaN, expanded)
    monkeypatch.setattr(block_quant, "find", lambda weight: None)
    stored, ref = run()
    assert stored == {("torch.float32", True)}
    assert ours == ref


@pytest.mark.parametrize("n, k", [(5, 64), (33, 96)])
def test_quantize_q8_0_is_the_nearest_blocks_within_half_a_step(n, k):
    torch.manual_seed(n)
    w = torch.randn(n, k) * torch.logspace(-3, 1, n).unsqueeze(1)   # scales from tiny to large rows
    w[0, :32] = 0.0                                                  # an all-zero block
    blocks = block_quant.quantize_q8_0(w)
    assert blocks.format == "q8_0" and blocks.shape == w.shape
    d = (w.reshape(n, -1, 32).abs().amax(-1, keepdim=True) / 127).half().float()
    err = (blocks.dequantize() - w).reshape(n, -1, 32).abs()
    assert (err <= d * 0.5 * (1 + 1e-3) + 1e-12).all()              # the nearest q (up to d's rounding)
    assert (blocks.dequantize()[0, :32] == 0).all()


def test_quantize_q8_0_keeps_q8_0_values_exactly_and_turns_down_what_has_no_blocks():
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (4, 64)).float()
    q[:, ::32] = 127                                                 # each block's largest |q| is 127
    exact = q * torch.tensor([0.5, 0.25, 0.125, 2.0]).unsqueeze(1)   # float16 scales
    assert torch.equal(block_quant.quantize_q8_0(exact).blocks, block_quant.find(exact).blocks)
    assert block_quant.quantize_q8_0(torch.randn(4, 40)) is None     # K not a multiple of 32
    assert block_quant.quantize_q8_0(torch.randn(4, 64, dtype=torch.float64)) is None
    assert block_quant.quantize_q8_0(torch.full((2, 32), 1e9)) is None   # a scale past float16

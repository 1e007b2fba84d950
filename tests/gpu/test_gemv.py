"""Triton GEMVs (one row: plain, RMSNorm-fused, SiLU·mul-fused; several rows: plain, gate/up with SiLU·mul)
against float64 references of the unfused ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from vllm_spec.model import fused, gemv, gemv_kernels

pytestmark = pytest.mark.gpu
BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = [(4096, 4096), (6144, 4096), (2048, 14336), (1000, 768), (129, 200), (7, 33), (20000, 200), (66000, 96)]


def _poison_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Leave NaNs in the caching allocator's next block of this size, so an unwritten output shows."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _draw(seed: int, n: int, k: int, dtype: torch.dtype, rows: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g)
    return x, w, b, g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 20, gemv.MAX_ROWS])   # tiles of 16 and 32, full and partial
def test_linear(dtype, n, k, with_bias, rows):
    x, w, b, _ = _draw(n * 31 + k + rows, n, k, dtype, rows)
    b = b if with_bias else None
    assert gemv.eligible(x, w)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    _poison_allocator((rows, n), dtype)
    y = gemv.linear(x, w, b)
    assert y.shape == (rows, n)
    for row in range(rows):   # each row on its own: a row left unwritten or mixed up with another shows
        assert rel_err(y[row], ref[row]) < BOUND[dtype], row


@pytest.mark.parametrize("rows, block_m, block_m2",
                         [(80, 64, 16), (70, 64, 16), (20, 16, 16), (17, 16, 16), (5, 16, 0)])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("n, k", [(4096, 4096), (129, 200)])
def test_rows_kernel_tilings(rows, block_m, block_m2, swap, n, k):
    """Every tiling the sweeps may pick: two row tiles (the second full or partial) and the swapped product,
    with a bias and a K that does not divide into BLOCK_K."""
    x, w, b, _ = _draw(rows * 7 + n + k + swap, n, k, torch.bfloat16, rows)
    ref = F.linear(x.double(), w.double(), b.double())
    _poison_allocator((rows, n), torch.bfloat16)
    y = gemv.rows_linear(x, w, b, gemv.RowsBlocks(block_m, block_m2, 64, 128, 4, 3, swap))
    for row in range(rows):
        assert rel_err(y[row], ref[row]) < BOUND[torch.bfloat16], row


def test_rows_with_a_stride_read_their_own_elements():
    """Rows that are a slice of a wider tensor (the q/k/v split hands out such views)."""
    wide = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16)
    x, w = wide[:, 16:48], torch.randn(40, 32, device="cuda", dtype=torch.bfloat16)
    assert gemv.eligible(x, w)
    assert rel_err(gemv.linear(x, w), F.linear(x.double(), w.double())) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear(dtype, n, k, with_residual):
    x, w, b, g = _draw(n * 17 + k, n, k, dtype)
    res = torch.randn(1, k, device="cuda", dtype=dtype, generator=g) if with_residual else None
    norm_w = torch.rand(k, device="cuda", dtype=dtype, generator=g) + 0.5
    normed, ref_res = fused.add_rms_norm_torch(x, res, norm_w, 1e-5)
    ref = F.linear(normed.double(), w.double(), b.double())
    _poison_allocator((1, n), dtype)
    y, new_res = gemv.norm_linear(x, res, norm_w, 1e-5, w, b)
    assert rel_err(y, ref) < BOUND[dtype]
    assert torch.equal(new_res, ref_res)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_silu_mul_linear(dtype, n, k):
    _, w, _, g = _draw(n * 13 + k, n, k, dtype)
    x = torch.randn(1, 2 * k, device="cuda", dtype=dtype, generator=g) * 3
    ref = F.linear(fused.silu_mul(x).double(), w.double())
    _poison_allocator((1, n), dtype)
    assert rel_err(gemv.silu_mul_linear(x, w), ref) < BOUND[dtype]


@pytest.mark.parametrize("k", [33, 576, 1024])
def test_fused_inputs_round_like_the_unfused_ops(k):
    """With an identity weight the product is the fused input itself (float16 sums of one nonzero
    term are exact), so rounding that differs from add_rms_norm's or silu_mul's shows. The norm's
    statistic is summed in another order, which may move a rare element by one unit in the last place."""
    g = torch.Generator(device="cuda").manual_seed(k)
    x, res = (torch.randn(1, k, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    norm_w = torch.rand(k, device="cuda", dtype=torch.float16, generator=g) + 0.5
    eye = torch.eye(k, device="cuda", dtype=torch.float16)
    y, _ = gemv.norm_linear(x, res, norm_w, 1e-5, eye)
    ref = fused.add_rms_norm(x, res, norm_w, 1e-5)[0].float()
    diff = (y.float() - ref).abs()
    assert (diff <= ref.abs() * 2 ** -10).all() and (diff > 0).float().mean() <= 0.01
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.float16, generator=g) * 3
    assert torch.equal(gemv.silu_mul_linear(gate_up, eye), fused.silu_mul(gate_up))


def _silu_mul_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    gate_up = F.linear(x.double(), w.double(), None if b is None else b.double())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(2 * 4096, 4096), (2 * 1000, 768), (2 * 129, 200), (2 * 7, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [2, 5, 16, 20, 32, 48, 80, gemv.GATE_UP_MAX_ROWS])
def test_gate_up_silu(dtype, n, k, with_bias, rows):
    """Every row count the MLP sends here (one tile of 16 or 32 rows, or a power of two plus a tile for
    the rest), partial column blocks and K tails."""
    x, w, b, _ = _draw(n * 11 + k + rows, n, k, dtype, rows)
    x = x * 3   # products of a few units: SiLU's bend, not only its linear part
    b = b if with_bias else None
    ref = _silu_mul_ref(x, w, b)
    _poison_allocator((rows, n // 2), dtype)
    y = gemv.gate_up_silu(x, w, b)
    assert y.shape == (rows, n // 2)
    for row in range(rows):
        assert rel_err(y[row], ref[row]) < BOUND[dtype], row


@pytest.mark.parametrize("rows, block_m, block_m2", [(80, 64, 16), (70, 64, 16), (20, 32, 0), (5, 16, 0)])
@pytest.mark.parametrize("block_n, swap", [(32, True), (64, True), (16, False)])
def test_gate_up_silu_tilings(rows, block_m, block_m2, block_n, swap):
    x, w, b, _ = _draw(rows + block_n + swap, 2 * 300, 200, torch.bfloat16, rows)
    ref = _silu_mul_ref(x * 3, w, b)
    _poison_allocator((rows, 300), torch.bfloat16)
    y = gemv.gate_up_silu(x * 3, w, b, gemv.RowsBlocks(block_m, block_m2, block_n, 64, 4, 3, swap))
    for row in range(rows):
        assert rel_err(y[row], ref[row]) < BOUND[torch.bfloat16], row


@pytest.mark.parametrize("rows", [3, 80])
def test_gate_up_silu_rounds_like_the_unfused_ops(rows):
    """With W = [I; I] both products are x itself (float16 sums of one nonzero term are exact), so
    the epilogue's rounding must give fused.silu_mul([x | x]) bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 96, device="cuda", dtype=torch.float16, generator=g) * 3
    eye = torch.eye(96, device="cuda", dtype=torch.float16)
    assert torch.equal(gemv.gate_up_silu(x, torch.cat([eye, eye])), fused.silu_mul(torch.cat([x, x], dim=1)))


def test_gate_up_silu_eligibility_and_fallback(monkeypatch):
    """2..GATE_UP_MAX_ROWS half-precision rows of an even-rowed weight larger than FUSE_MAX_NUMEL on CUDA
    (a small one, as a 68M draft's, streamed slower fused: too few programs); a config that does not fit
    the device falls back to the product then fused.silu_mul, for that shape from then on."""
    import triton

    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    assert not gemv.gate_up_eligible(torch.randn(4, 32, device="cuda", dtype=torch.bfloat16), w)
    monkeypatch.setattr(gemv, "FUSE_MAX_NUMEL", w.numel() - 1)
    rows = lambda m: torch.randn(m, 32, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    assert gemv.gate_up_eligible(rows(2), w) and gemv.gate_up_eligible(rows(gemv.GATE_UP_MAX_ROWS), w)
    assert not gemv.gate_up_eligible(rows(1), w)
    assert not gemv.gate_up_eligible(rows(gemv.GATE_UP_MAX_ROWS + 1), w)
    assert not gemv.gate_up_eligible(rows(4), w[:63])
    assert not gemv.gate_up_eligible(rows(4).float(), w.float())
    assert not gemv.gate_up_eligible(rows(4).cpu(), w.cpu())

    def refuse(*args, **kwargs):
        raise triton.runtime.errors.OutOfResources(160 << 10, 100 << 10, "shared memory")

    monkeypatch.setattr(gemv_kernels, "rows_silu_kernel", type("Refusing", (), {"__getitem__": lambda self, grid: refuse})())
    monkeypatch.setattr(gemv, "_ROWS_UNFIT", set())
    x = rows(5)
    assert torch.equal(gemv.gate_up_silu(x, w), fused.silu_mul(F.linear(x, w)))
    assert gemv._ROWS_UNFIT == {(gemv._gate_up_blocks(5, 32, 32), 64, 32)}
    assert torch.equal(gemv.gate_up_silu(x, w), fused.silu_mul(F.linear(x, w)))


def test_warm_up_compiles_every_row_tiling():
    """After warm_up_gate_up, no row count gate_up_silu may meet (2..GATE_UP_MAX_ROWS) compiles a kernel
    (a compile mid-serving stalls a step)."""
    def compiled() -> int:
        return sum(len(cache[0]) for cache in gemv_kernels.rows_silu_kernel.device_caches.values())

    w = torch.randn(2 * 40, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2 * 40, device="cuda", dtype=torch.bfloat16)
    gemv.warm_up_gate_up(w, b)
    before = compiled()
    assert before >= len({gemv._gate_up_blocks(m, 40, 64) for m in range(2, gemv.GATE_UP_MAX_ROWS + 1)})
    for m in range(gemv.GATE_UP_MIN_ROWS, gemv.GATE_UP_MAX_ROWS + 1):
        gemv.gate_up_silu(torch.randn(m, 64, device="cuda", dtype=torch.bfloat16), w, b)
    assert compiled() == before


def test_a_row_of_the_wrong_width_is_refused():
    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="input of shape"):
        gemv.linear(torch.randn(1, 31, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="input of shape"):
        gemv.silu_mul_linear(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="input of shape"):
        gemv.linear(torch.randn(3, 33, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bias"):
        gemv.linear(torch.randn(3, 32, device="cuda", dtype=torch.bfloat16), w,
                    torch.randn(63, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="input of shape"):
        gemv.gate_up_silu(torch.randn(3, 31, device="cuda", dtype=torch.bfloat16), w)


def test_blocks_that_do_not_fit_the_device_fall_back_to_cublas(monkeypatch):
    """A GPU with less shared memory than the blocks were sized for refuses the launch: the product
    goes to cuBLAS, then and for that weight shape from then on."""
    import triton

    def refuse(grid):
        def launch(*args, **kwargs):
            raise triton.runtime.errors.OutOfResources(160 << 10, 100 << 10, "shared memory")
        return launch

    monkeypatch.setattr(gemv_kernels, "rows_kernel", type("Refusing", (), {"__getitem__": lambda self, grid: refuse(grid)})())
    monkeypatch.setattr(gemv, "_ROWS_UNFIT", set())
    x, w = torch.randn(3, 48, device="cuda", dtype=torch.bfloat16), torch.randn(24, 48, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    assert gemv._ROWS_UNFIT == {(gemv._rows_blocks(3, 24, 48), 24, 48)}


def test_only_a_few_half_precision_rows_are_eligible_and_one_is_fusable():
    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    assert gemv.eligible(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), w)
    assert gemv.eligible(torch.randn(gemv.MAX_ROWS, 32, device="cuda", dtype=torch.bfloat16), w)
    assert not gemv.eligible(torch.randn(gemv.MAX_ROWS + 1, 32, device="cuda", dtype=torch.bfloat16), w)
    assert not gemv.fusable(torch.randn(2, 32, device="cuda", dtype=torch.bfloat16), w)
    assert not gemv.eligible(torch.randn(1, 32, device="cuda"), w.float())
    assert not gemv.eligible(torch.randn(1, 32, dtype=torch.bfloat16), w.cpu())
    assert gemv.fusable(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), w)
    big = torch.empty(gemv.FUSE_MAX_NUMEL // 32 + 1, 32, device="cuda", dtype=torch.bfloat16)
    assert not gemv.fusable(torch.randn(1, 32, device="cuda", dtype=torch.bfloat16), big)


def test_deep_weights_past_max_rows_take_a_zero_bias(monkeypatch):
    """Past MAX_ROWS rows (up to LT_MAX_ROWS) a weight with K > N gets a zero bias (cuBLASLt's path), which
    a row-parallel linear multiplies with: same product; wide weights, fewer or more rows, float32 and CPU
    get none; a capture never makes the zeros."""
    from vllm_spec.distributed.parallel_state import GroupCoordinator
    from vllm_spec.model.layers import RowParallelLinear
    monkeypatch.setattr(gemv, "_ZERO_BIAS", {})
    layer = RowParallelLinear(640, 96, False, GroupCoordinator(), torch.bfloat16).cuda()
    deep = layer.weight.data
    deep.copy_(torch.randn(96, 640, device="cuda", dtype=torch.bfloat16) / 640 ** 0.5)
    x = torch.randn(80, 640, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert gemv.lt_bias(x, deep) is None
    zeros = gemv.lt_bias(x, deep)
    assert zeros.shape == (96,) and not zeros.any()
    assert gemv.lt_bias(x, deep) is zeros
    asked = []
    monkeypatch.setattr(gemv, "lt_bias", lambda *a: asked.append(a) or zeros)
    assert rel_err(layer(x), F.linear(x.double(), deep.double())) < BOUND[torch.bfloat16]
    assert len(asked) == 1 and asked[0][1] is layer.weight
    monkeypatch.undo()
    assert gemv.lt_bias(x[: gemv.MAX_ROWS], deep) is None
    assert gemv.lt_bias(torch.cat([x, x]), deep) is None
    assert gemv.lt_bias(x[:, :96], deep.t().contiguous()[:, :96]) is None
    assert gemv.lt_bias(x.float(), deep.float()) is None
    assert gemv.lt_bias(x.cpu(), deep.cpu()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])   # qwen2: q/k/v bias, untied LM head
@pytest.mark.parametrize("tokens", [1, 5])
def test_decoder_forward_matches_unfused(request, arch, dtype, tokens, monkeypatch):
    """One token (the one-row GEMVs with the norm and SiLU·mul fused in) or five (the several-rows
    kernel, SiLU·mul in the gate/up epilogue) through a whole model, against the unfused ops on the
    same device."""
    from vllm_spec import LLM
    from vllm_spec.attention.metadata import AttentionMetadata

    llm = LLM(str(request.getfixturevalue(arch)), dtype=str(dtype).removeprefix("torch."), enforce_eager=True,
              kv_cache_memory_bytes=1 << 26)
    model = llm.llm_engine.executor.worker.runner.model
    block_size = llm.llm_engine.config.cache.block_size
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], device="cuda"), seq_lens=torch.tensor([tokens], device="cuda"),
        block_tables=torch.tensor([[1]], device="cuda"),
        slot_mapping=torch.arange(tokens, device="cuda") + block_size,
        max_query_len=tokens, max_seq_len=tokens, block_size=block_size)
    ids, pos = torch.arange(5, 5 + tokens, device="cuda"), torch.arange(tokens, device="cuda")
    monkeypatch.setattr(gemv, "FUSE_MAX_NUMEL", 0 if tokens > 1 else gemv.FUSE_MAX_NUMEL)   # a tiny model's MLP
    calls = []
    launch, gate_up_silu = gemv._launch, gemv.gate_up_silu
    monkeypatch.setattr(gemv, "_launch", lambda *a, **k: (calls.append(a[0]), launch(*a, **k))[1])
    monkeypatch.setattr(gemv, "gate_up_silu", lambda *a, **k: (calls.append("gate_up"), gate_up_silu(*a, **k))[1])
    with torch.inference_mode():
        fused_logits = model.compute_logits(model(ids, pos, md))
    if tokens == 1:
        assert sorted(set(calls)) == [0, 1, 2], "every gemv variant should run on one row"
    else:
        assert calls == ["gate_up"] * model.config.num_hidden_layers
    monkeypatch.setattr(gemv, "ENABLED", False)
    with torch.inference_mode():
        ref = model.compute_logits(model(ids, pos, md))
    assert rel_err(fused_logits, ref.double()) < BOUND[dtype]

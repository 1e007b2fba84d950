"""Triton GEMVs (one row: plain, RMSNorm-fused, SiLU·mul-fused; several rows: plain) against float64 references of the unfused ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from vllm_spec.model import fused, gemv

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


def test_blocks_that_do_not_fit_the_device_fall_back_to_cublas(monkeypatch):
    """A GPU with less shared memory than the blocks were sized for refuses the launch: the product
    goes to cuBLAS, then and for that weight shape from then on."""
    import triton

    def refuse(grid):
        def launch(*args, **kwargs):
            raise triton.runtime.errors.OutOfResources(160 << 10, 100 << 10, "shared memory")
        return launch

    monkeypatch.setattr(gemv, "_rows_kernel", type("Refusing", (), {"__getitem__": lambda self, grid: refuse(grid)})())
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
def test_decoder_forward_matches_unfused(request, arch, dtype, monkeypatch):
    """One token through a whole model: the fused path against the unfused ops on the same device."""
    from vllm_spec import LLM
    from vllm_spec.attention.metadata import AttentionMetadata

    llm = LLM(str(request.getfixturevalue(arch)), dtype=str(dtype).removeprefix("torch."), enforce_eager=True,
              kv_cache_memory_bytes=1 << 26)
    model = llm.llm_engine.executor.worker.runner.model
    block_size = llm.llm_engine.config.cache.block_size
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], device="cuda"), seq_lens=torch.tensor([1], device="cuda"),
        block_tables=torch.tensor([[1]], device="cuda"), slot_mapping=torch.tensor([block_size], device="cuda"),
        max_query_len=1, max_seq_len=1, block_size=block_size)
    ids, pos = torch.tensor([5], device="cuda"), torch.tensor([0], device="cuda")
    calls = []
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **k: (calls.append(a[0]), launch(*a, **k))[1])
    with torch.inference_mode():
        fused_logits = model.compute_logits(model(ids, pos, md))
    assert sorted(set(calls)) == [0, 1, 2], "every gemv variant should run on one row"
    monkeypatch.setattr(gemv, "ENABLED", False)
    with torch.inference_mode():
        ref = model.compute_logits(model(ids, pos, md))
    assert rel_err(fused_logits, ref.double()) < BOUND[dtype]

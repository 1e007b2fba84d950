"""The Triton kernels behind gemv.py (its module doc says what each computes and why)."""

from __future__ import annotations

from vllm_spec.platform import import_triton

triton, tl = import_triton()

if triton is not None:
    @triton.jit
    def _residual_added(x_ptr, res_ptr, cols, mask, HAS_RES: tl.constexpr):
        """x (+ residual) at `cols`, rounded to x's dtype as torch's add rounds it."""
        x = tl.load(x_ptr + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _input(x_ptr, res_ptr, nw_ptr, cols, mask, K, inv, MODE: tl.constexpr, HAS_RES: tl.constexpr):
        """The matmul's input at `cols` in float32, rounded as the unfused ops round it."""
        x = _residual_added(x_ptr, res_ptr, cols, mask, HAS_RES)   # a residual comes only with the norm
        if MODE == 1:
            normed = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
            w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            x = (normed * w).to(x.dtype)
        elif MODE == 2:
            x = _silu_mul(x, tl.load(x_ptr + K + cols, mask=mask, other=0.0), x.dtype).to(x.dtype)
        return x.to(tl.float32)

    @triton.jit
    def gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, N, K, stride_w, eps,
                     MODE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        offs = tl.arange(0, BLOCK_K)
        inv = 0.0
        if MODE == 1:
            # RMSNorm's statistic over the whole (residual-added) row; program 0 also writes that row.
            sq = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + offs
                mask = cols < K
                x = _residual_added(x_ptr, res_ptr, cols, mask, HAS_RES)
                if HAS_RES and pid == 0:
                    tl.store(res_out_ptr + cols, x, mask=mask)
                x32 = x.to(tl.float32)
                sq += x32 * x32
            inv = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            col_mask = cols < K
            if EVEN_K:   # no mask along K: the loads stay 16-byte vectors
                w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None], other=0.0)
            else:
                w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            x = _input(x_ptr, res_ptr, nw_ptr, cols, col_mask, K, inv, MODE, HAS_RES)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _rows_acc(w_rows, row_mask, x_ptr, M, K, stride_x, BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr):
        """The float32 products of the weight rows at w_rows with x's M rows, padded to one or two
        tensor-core tiles (two let 80 rows be 64 + 16, not 128), each weight tile read once for all of
        them: (acc, acc2), [BLOCK_N, rows] when SWAP (W x^T: the weight rows on the tile's M side), else
        [rows, BLOCK_N]."""
        offs = tl.arange(0, BLOCK_K)
        m1 = tl.arange(0, BLOCK_M)
        m2 = BLOCK_M + tl.arange(0, BLOCK_M2 if BLOCK_M2 > 0 else 16)
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc2 = tl.zeros((BLOCK_N, BLOCK_M2 if BLOCK_M2 > 0 else 16), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M2 if BLOCK_M2 > 0 else 16, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            w = _load_tile(w_rows + cols[None, :], row_mask, cols, K, EVEN_K)
            x = _load_tile(x_ptr + m1[:, None] * stride_x + cols[None, :], m1 < M, cols, K, EVEN_K)
            acc = tl.dot(w, tl.trans(x), acc) if SWAP else tl.dot(x, tl.trans(w), acc)
            if BLOCK_M2 > 0:
                x2 = _load_tile(x_ptr + m2[:, None] * stride_x + cols[None, :], m2 < M, cols, K, EVEN_K)
                acc2 = tl.dot(w, tl.trans(x2), acc2) if SWAP else tl.dot(x2, tl.trans(w), acc2)
        return acc, acc2

    # M feeds only masks: one compiled variant for every row count of a tiling, not one more for
    # multiples of 16 (which Triton would otherwise specialize on).
    @triton.jit(do_not_specialize=["M"])
    def rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr):
        """y [M, N] = x [M, K] W^T (+ b) for M <= BLOCK_M + BLOCK_M2 (_rows_acc)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        acc, acc2 = _rows_acc(w_ptr + rows[:, None].to(tl.int64) * stride_w, row_mask, x_ptr, M, K, stride_x,
                              BLOCK_M, BLOCK_M2, BLOCK_N, BLOCK_K, EVEN_K, SWAP)
        m1 = tl.arange(0, BLOCK_M)
        _store_rows(_biased(acc, b_ptr, rows, N, HAS_BIAS, SWAP), y_ptr, m1, rows, M, N, SWAP)
        if BLOCK_M2 > 0:
            m2 = BLOCK_M + tl.arange(0, BLOCK_M2)
            _store_rows(_biased(acc2, b_ptr, rows, N, HAS_BIAS, SWAP), y_ptr, m2, rows, M, N, SWAP)

    @triton.jit(do_not_specialize=["M"])   # as rows_kernel
    def rows_silu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr):
        """y [M, N] = silu(x G^T (+ b_G)) * (x U^T (+ b_U)) for W = [G; U] of 2N rows: columns j of y
        read rows j of G and of U, so each program owns both halves of its columns."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        g, g2 = _rows_acc(w_ptr + rows[:, None].to(tl.int64) * stride_w, row_mask, x_ptr, M, K, stride_x,
                          BLOCK_M, BLOCK_M2, BLOCK_N, BLOCK_K, EVEN_K, SWAP)
        u, u2 = _rows_acc(w_ptr + (rows[:, None] + N).to(tl.int64) * stride_w, row_mask, x_ptr, M, K, stride_x,
                          BLOCK_M, BLOCK_M2, BLOCK_N, BLOCK_K, EVEN_K, SWAP)
        dtype = y_ptr.dtype.element_ty
        m1 = tl.arange(0, BLOCK_M)
        _store_rows(_silu_mul(_biased(g, b_ptr, rows, N, HAS_BIAS, SWAP),
                              _biased(u, b_ptr + N, rows, N, HAS_BIAS, SWAP), dtype), y_ptr, m1, rows, M, N, SWAP)
        if BLOCK_M2 > 0:
            m2 = BLOCK_M + tl.arange(0, BLOCK_M2)
            _store_rows(_silu_mul(_biased(g2, b_ptr, rows, N, HAS_BIAS, SWAP),
                                  _biased(u2, b_ptr + N, rows, N, HAS_BIAS, SWAP), dtype),
                        y_ptr, m2, rows, M, N, SWAP)

    @triton.jit
    def _silu_mul(gate, up, dtype: tl.constexpr):
        """silu(gate) * up in float32, rounded where the unfused ops round (gate and up to dtype, as a
        linear's output is: nothing for inputs already in dtype; then silu's), as fused.silu_mul."""
        g = gate.to(dtype).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return s * up.to(dtype).to(tl.float32)

    @triton.jit
    def _load_tile(ptrs, row_mask, cols, K, EVEN_K: tl.constexpr):
        """A [rows, BLOCK_K] tile; EVEN_K: no mask along K, so the loads stay 16-byte vectors."""
        if EVEN_K:
            return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        return tl.load(ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)

    @triton.jit
    def _biased(acc, b_ptr, rows, N, HAS_BIAS: tl.constexpr, SWAP: tl.constexpr):
        """acc (+ b[rows]); acc is [rows, ms] when SWAP, else [ms, rows]."""
        if HAS_BIAS:
            b = tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
            acc += b[:, None] if SWAP else b[None, :]
        return acc

    @triton.jit
    def _store_rows(acc, y_ptr, ms, rows, M, N, SWAP: tl.constexpr):
        """y[ms, rows] = acc (y's rows N wide); acc is [rows, ms] when SWAP, else [ms, rows]."""
        row_mask = rows < N
        if SWAP:
            tl.store(y_ptr + ms[None, :] * N + rows[:, None], acc.to(y_ptr.dtype.element_ty),
                     mask=(ms < M)[None, :] & row_mask[:, None])
        else:
            tl.store(y_ptr + ms[:, None] * N + rows[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(ms < M)[:, None] & row_mask[None, :])

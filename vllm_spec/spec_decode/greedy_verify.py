"""Greedy verification in one kernel: accept each row's drafts while they equal the target's
argmax (or, in benchmarks, while the row's synthetic draws say so), then emit the argmax at the
first rejection.

The torch code in rejection_sampler does this in some fifteen small ops, each a kernel launch
after the target pass; on CUDA this is one (a program per row over its k + 1 positions).
"""

from __future__ import annotations

import torch

from vllm_spec.platform import import_triton

triton, tl = import_triton()


def available(target_argmax: torch.Tensor) -> bool:
    return triton is not None and target_argmax.is_cuda


def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                  rates: torch.Tensor | None, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, k+1] with -1 past each row's end, num_accepted [B]) for `available` inputs.

    target_argmax [B, k+1], draft_tokens [B, k] (any strides), num_drafts [B]; rates [B] synthetic
    acceptance (NaN: verify for real) with uniforms [B, k], or both None. Draws are compared in float32:
    exact for SyntheticDraws' (multiples of 2^-24) and torch.rand's float32 ones."""
    B, k1 = target_argmax.shape
    tokens = torch.empty(B, k1, dtype=torch.long, device=target_argmax.device)
    num_accepted = torch.empty(B, dtype=torch.long, device=target_argmax.device)
    if B:
        synthetic = rates is not None
        _greedy_verify_kernel[(B,)](
            target_argmax, draft_tokens, num_drafts, rates if synthetic else num_drafts,
            uniforms if synthetic else num_drafts, tokens, num_accepted, k1 - 1,
            target_argmax.stride(0), target_argmax.stride(1), draft_tokens.stride(0), draft_tokens.stride(1),
            uniforms.stride(0) if synthetic else 0, uniforms.stride(1) if synthetic else 0,
            SYNTHETIC=synthetic, BLOCK=max(2, triton.next_power_of_2(k1)))
    return tokens, num_accepted


def warm_up(max_k: int, device: torch.device) -> None:
    """Compile the kernel for every k up to max_k, with and without synthetic draws, before serving:
    a policy that varies k met each new variant mid-serving (one compile stalled a verification
    step for 0.44 s on the H200)."""
    if triton is None or device.type != "cuda":
        return
    for k in range(1, max_k + 1):
        argmax = torch.zeros(1, k + 1, dtype=torch.long, device=device)
        drafts = torch.zeros(1, k, dtype=torch.long, device=device)
        num_drafts = torch.full((1,), k, dtype=torch.long, device=device)
        greedy_verify(argmax, drafts, num_drafts, None, None)
        greedy_verify(argmax, drafts, num_drafts, torch.full((1,), 0.5, device=device),
                      torch.zeros(1, k, dtype=torch.float64, device=device))


if triton is not None:
    # k and the strides vary with k: specialised (Triton does so on values 1 and multiples of 16),
    # each k would be a variant of its own; the block size alone tells the variants apart.
    @triton.jit(do_not_specialize=["k", "sa_r", "sa_j", "sd_r", "sd_j", "su_r", "su_j"])
    def _greedy_verify_kernel(argmax_ptr, drafts_ptr, num_drafts_ptr, rates_ptr, u_ptr, tokens_ptr, accepted_ptr,
                              k, sa_r, sa_j, sd_r, sd_j, su_r, su_j, SYNTHETIC: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        target = tl.load(argmax_ptr + r * sa_r + j * sa_j, mask=j <= k, other=-1)
        draft = tl.load(drafts_ptr + r * sd_r + j * sd_j, mask=j < k, other=-1)
        accept = (draft == target) & (draft >= 0)
        if SYNTHETIC:
            rate = tl.load(rates_ptr + r).to(tl.float32)
            u = tl.load(u_ptr + r * su_r + j * su_j, mask=j < k, other=2.0).to(tl.float32)
            accept = tl.where(rate != rate, accept, u < rate)
        accept = accept & (j < tl.load(num_drafts_ptr + r))
        # Accepted: the positions before the first rejection.
        n = tl.min(tl.where(accept, BLOCK, j), axis=0)
        final = tl.sum(tl.where(j == n, target, 0), axis=0)
        out = tl.where(j < n, draft, tl.where(j == n, final, -1))
        tl.store(tokens_ptr + r * (k + 1) + j, out, mask=j <= k)
        tl.store(accepted_ptr + r, n)

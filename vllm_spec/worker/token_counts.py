"""Query-token counts a forward pass runs well at.

On a GPU the matmul library picks its kernel by shape, and some row counts run much slower than a few
more rows would (H100, 8B shape, the linear layers of 32 layers: 448 rows 13.9 ms, 512 rows 9.7 ms;
384 rows 8.5 ms). The model's own linear layers are timed once at start-up at the counts its graphs may
run and on a grid above them, and a pass whose graph may run extra tokens (ragged_graph: a sink row takes
them) runs the fastest count a little above its own where that is clearly faster.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_spec.model import gemv
from vllm_spec.model.layers import LinearBase

GRID = 16          # candidate counts to pad to: multiples of this
MAX_PAD = 1.25     # a pass runs at most this factor of its own tokens
MIN_GAIN = 0.95    # and only where that takes at most this share of its own count's time
# Passes of at most this many tokens run the model's fused small-row kernels (gemv: the norm, SiLU·mul
# or bias in the matmul), not the matmuls profiled here: their counts are left as they are.
MIN_ROWS = max(gemv.LT_MAX_ROWS, gemv.GATE_UP_MAX_ROWS)
_REPEATS, _INNER = 3, 4


@dataclass
class TokenPadding:
    """Seconds of the model's linear layers per profiled token count (ascending, all past MIN_ROWS)."""

    counts: np.ndarray
    seconds: np.ndarray

    def covers(self, tokens: int) -> bool:
        """Whether the profile speaks for a pass of this many tokens."""
        return len(self.counts) > 0 and MIN_ROWS < tokens <= self.counts[-1]

    def seconds_at(self, tokens: int) -> float:
        """The profiled time of a pass of `tokens` (that of the next profiled count; it covers them)."""
        return float(self.seconds[int(np.searchsorted(self.counts, tokens))])

    def padded(self, tokens: int, limit: int) -> int:
        """The tokens to run a pass of `tokens` at (at most `limit`): the fastest profiled count up to
        MAX_PAD times them where it takes at most MIN_GAIN of their own time, else `tokens`."""
        if not self.covers(tokens):
            return tokens
        top = min(limit, int(tokens * MAX_PAD))
        lo, hi = np.searchsorted(self.counts, tokens), np.searchsorted(self.counts, top, side="right")
        if lo >= hi:
            return tokens
        best = lo + int(np.argmin(self.seconds[lo:hi]))
        return int(self.counts[best]) if self.seconds[best] <= MIN_GAIN * self.seconds_at(tokens) else tokens


@torch.inference_mode()
def profile_linear(layer: torch.nn.Module, counts: Iterable[int]) -> TokenPadding:
    """Time every linear layer of `layer` (one decoder layer: they all share its shapes) on rows of zeros,
    at each of `counts` past MIN_ROWS, on its device (CUDA): the minimum of a few runs of a few passes."""
    linears = [m for m in layer.modules() if isinstance(m, LinearBase)]
    weight = linears[0].weight
    counts = np.array(sorted({int(c) for c in counts if c > MIN_ROWS}), dtype=np.int64)
    # (Contiguous inputs per width: a strided view may get another kernel than the model's activations.)
    inputs = {m.weight.shape[1]: torch.zeros(int(counts[-1]) if len(counts) else 0, m.weight.shape[1],
                                             dtype=weight.dtype, device=weight.device) for m in linears}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = np.empty(len(counts))
    for i, rows in enumerate(counts.tolist()):
        runs = []
        for r in range(_REPEATS + 1):   # (the first loads each shape's kernel)
            start.record()
            for _ in range(_INNER):   # (several passes: launches queue ahead of the kernels)
                for m in linears:
                    m._matmul(inputs[m.weight.shape[1]][:rows])
            end.record()
            end.synchronize()
            if r:
                runs.append(start.elapsed_time(end) * 1e-3 / _INNER)
        seconds[i] = min(runs)
    return TokenPadding(counts, seconds)

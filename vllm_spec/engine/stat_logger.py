"""vLLM's periodic statistics lines (do_log_stats): throughput since the previous line, the queues, the
KV cache, the prefix cache and, while speculating, the drafts' acceptance."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from vllm_spec.metrics import Counter, Gauge, Metric, Vector

logger = logging.getLogger("vllm_spec.stats")

# Seconds between two lines (vLLM's).
LOG_STATS_INTERVAL = 10.0


@dataclass
class _Totals:
    """The counters a line reports the growth of, as of one moment."""

    at: float
    values: dict[str, float] = field(default_factory=dict)
    per_pos: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, metrics: list[Metric]) -> "_Totals":
        totals = cls(time.monotonic())
        for m in metrics:
            if isinstance(m, (Counter, Gauge)) and not m.labels:
                totals.values[m.name] = float(m.value)
            elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                totals.per_pos = list(m.values)
        return totals


class LoggingStatLogger:
    """Logs one line of engine statistics per call (and one of speculative decoding while drafts were
    proposed since the previous call), as vLLM's LoggingStatLogger; rates are over the interval."""

    def __init__(self) -> None:
        self._last = _Totals(time.monotonic())   # (the first line: since the engine was built)

    def log(self, metrics: list[Metric]) -> list[str]:
        """The lines logged (at INFO, on the "vllm_spec.stats" logger)."""
        now, last = _Totals.of(metrics), self._last
        self._last = now
        seconds = max(now.at - last.at, 1e-9)
        v = now.values

        def grew(name: str) -> float:
            return v.get(name, 0.0) - last.values.get(name, 0.0)

        queries = grew("vllm:prefix_cache_queries")
        lines = [
            f"Avg prompt throughput: {grew('vllm:prompt_tokens') / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {grew('vllm:generation_tokens') / seconds:.1f} tokens/s, "
            f"Running: {int(v.get('vllm:num_requests_running', 0))} reqs, "
            f"Waiting: {int(v.get('vllm:num_requests_waiting', 0))} reqs, "
            f"GPU KV cache usage: {100 * v.get('vllm:kv_cache_usage_perc', 0.0):.1f}%, "
            f"Prefix cache hit rate: {100 * grew('vllm:prefix_cache_hits') / queries if queries else 0.0:.1f}%"
        ]
        drafts, drafted = grew("vllm:spec_decode_num_drafts"), grew("vllm:spec_decode_num_draft_tokens")
        if drafted > 0:
            accepted = grew("vllm:spec_decode_num_accepted_tokens")
            old = last.per_pos + [0] * (len(now.per_pos) - len(last.per_pos))
            per_pos = ", ".join(f"{(n - o) / drafts:.3f}" for n, o in zip(now.per_pos, old))
            line = (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                    f"Accepted throughput: {accepted / seconds:.2f} tokens/s, "
                    f"Drafted throughput: {drafted / seconds:.2f} tokens/s, "
                    f"Accepted: {int(accepted)} tokens, Drafted: {int(drafted)} tokens, "
                    f"Per-position acceptance rate: {per_pos}, "
                    f"Avg Draft acceptance rate: {100 * accepted / drafted:.1f}%")
            estimate = v.get("vllm:spec_decode_policy_acceptance_estimate", math.nan)
            if math.isfinite(estimate):   # (the adaptive policy's: its mean k and acceptance estimate)
                line += (f", policy mean k: {v['vllm:spec_decode_policy_mean_k']:.2f}, acceptance estimate: "
                         f"{estimate:.3f}")
            lines.append(line)
        for line in lines:
            logger.info(line)
        return lines

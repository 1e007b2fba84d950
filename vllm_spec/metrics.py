"""Metric snapshots in the shape of vLLM's `LLM.get_metrics()` (vllm.v1.metrics.reader)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int | float = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """A counter per position, e.g. accepted draft tokens at each speculative position."""

    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)  # cumulative, keyed by upper bound ("+Inf" last)


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's buckets of token counts)."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(bounds)
            bounds.append(float(m * scale))
        scale *= 10


class HistogramRecorder:
    """Accumulates observations into fixed buckets."""

    def __init__(self, name: str, bounds: tuple[float, ...] = _LATENCY_BUCKETS):
        self.name = name
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def snapshot(self) -> Histogram:
        cumulative, running = {}, 0
        for bound, c in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += c
            cumulative[bound] = running
        return Histogram(self.name, count=running, sum=self.total, buckets=cumulative)

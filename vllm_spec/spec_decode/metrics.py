"""Speculative-decoding counters with vLLM's metric names."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_spec.metrics import Counter, Gauge, Metric, Vector
from vllm_spec.worker.batch import PolicyEstimates, SpecStepStats


@dataclass
class SpecDecodeMetrics:
    """Running totals over all speculative steps; accepted_per_pos has an entry per draft position up
    to num_speculative_tokens (as vLLM's), also for positions the policy has not drafted yet."""

    num_speculative_tokens: int
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(init=False)
    draft_time: float = 0.0
    verify_time: float = 0.0
    policy: PolicyEstimates | None = None

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def add(self, s: SpecStepStats) -> None:
        if s.policy is not None:
            self.policy = s.policy
        self.num_steps += 1
        self.num_drafts += s.num_drafts
        self.num_draft_tokens += s.num_draft_tokens
        self.num_accepted_tokens += s.num_accepted_tokens
        for j, n in enumerate(s.accepted_per_pos):
            self.accepted_per_pos[j] += n
        self.draft_time += s.draft_time
        self.verify_time += s.verify_time

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def num_emitted_tokens(self) -> int:
        """Tokens the speculative steps emitted: the accepted drafts and one more per speculating sequence."""
        return self.num_accepted_tokens + self.num_drafts

    @property
    def efficiency(self) -> float:
        """vLLM V0's system efficiency: emitted tokens over the most the drafts could have emitted (all
        accepted, plus the bonus token)."""
        most = self.num_draft_tokens + self.num_drafts
        return self.num_emitted_tokens / most if most else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculating sequence and step: accepted drafts + the bonus/recovered one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> list[Metric]:
        steps = max(self.num_steps, 1)
        return [
            Counter("vllm:spec_decode_num_drafts", value=self.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", value=self.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", value=self.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(self.accepted_per_pos)),
            Gauge("vllm:spec_decode_acceptance_rate", value=self.acceptance_rate),
            Gauge("vllm:spec_decode_mean_accepted_length", value=self.mean_accepted_length),
            # vLLM V0's names.
            Gauge("vllm:spec_decode_draft_acceptance_rate", value=self.acceptance_rate),
            Gauge("vllm:spec_decode_efficiency", value=self.efficiency),
            Counter("vllm:spec_decode_num_emitted_tokens", value=self.num_emitted_tokens),
            Gauge("vllm:spec_decode_draft_time_per_step_seconds", value=self.draft_time / steps),
            Gauge("vllm:spec_decode_verify_time_per_step_seconds", value=self.verify_time / steps),
        ] + self._policy_metrics()

    def _policy_metrics(self) -> list[Metric]:
        if self.policy is None:
            return []
        return [
            Gauge("vllm:spec_decode_policy_mean_k", value=self.policy.mean_k),
            Gauge("vllm:spec_decode_policy_acceptance_estimate", value=self.policy.acceptance),
            Gauge("vllm:spec_decode_policy_draft_cost_ratio", value=self.policy.draft_cost_ratio),
        ]

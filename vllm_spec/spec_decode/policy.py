"""How many tokens each sequence drafts this step: the policies and what they see.

"fixed" always drafts num_speculative_tokens; "adaptive" (adaptive_policy.py) maximises
expected goodput on online acceptance estimates and measured step costs.
BatchSizeTablePolicy (a static table of k per batch size, the usual hand-tuned
heuristic) is what benchmarks compare it with; its from_schedule reads vLLM's
num_speculative_tokens_per_batch_size, which the worker applies as a cap on every row's drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from vllm_spec.spec_decode.step_cost import Charge
from vllm_spec.worker.batch import PolicyEstimates, SpecStepStats
from vllm_spec.worker.cuda_graph import bucket_for
from vllm_spec.worker.ragged_graph import token_bucket

# Verification of decoding sequences is padded to the longest draft (one query length, so a
# CUDA graph replays) for batches this small, or when padding adds at most this factor of tokens,
# where no ragged graph replays a pass of k per sequence. Measured on an H200 (8B shape, batch 32):
# the ragged pass runs eagerly at 13-24 ms where the padded graph takes 8 ms for 25% more tokens.
ALWAYS_PAD_BATCH = 16
MAX_PAD_RATIO = 2.0


def pads_verification(num_seqs: int, max_k: int, real_tokens: int, graphs: bool,
                      ragged_tokens: int | None = None) -> bool:
    """Whether a verification pass of all-decoding sequences is padded to num_seqs * (max_k + 1) tokens.
    Only a target that replays CUDA graphs pads: without them (the CPU, enforce_eager) padding only adds
    work, a CPU pass's time growing with its rows (batch 16 with n-gram drafts on 2 cores: padded passes
    made speculation 0.87x plain decoding's tokens/s). ragged_tokens: the tokens a ragged graph would run
    for the pass (None: it would run eagerly); padding then runs no more tokens than it (the padded
    graph runs its batch-size bucket's rows)."""
    if ragged_tokens is not None:
        return graphs and (bucket_for(num_seqs) or num_seqs) * (max_k + 1) <= ragged_tokens
    return graphs and (num_seqs <= ALWAYS_PAD_BATCH or num_seqs * (max_k + 1) <= MAX_PAD_RATIO * real_tokens)


def ragged_verification_tokens(num_seqs: int, max_k: int, real_tokens: int, max_q: int) -> int:
    """The query tokens a verification of all-decoding sequences counts where ragged graphs (of at most
    max_q tokens a sequence) replay it: padded to num_seqs * (max_k + 1) where pads_verification says so,
    else the ragged graph's token bucket."""
    ragged = token_bucket(real_tokens, bucket_for(num_seqs), max_q)
    return num_seqs * (max_k + 1) if pads_verification(num_seqs, max_k, real_tokens, True, ragged) else ragged


@dataclass
class StepShape:
    """What the policy knows about the coming step."""

    seq_ids: list[int]        # decoding sequences that may speculate
    caps: list[int]           # most drafts each may take (num_speculative_tokens, the draft's limit)
    num_other_tokens: int     # query tokens the policy does not choose (prefill chunks, seeded rows)
    # Whether an all-decoding verification with k per sequence replays a graph (ragged_graph.py); else
    # it runs eagerly, slower than one padded to the longest draft.
    ragged_graphs: bool = False


class SpeculationPolicy(Protocol):
    def choose(self, shape: StepShape) -> list[int]: ...

    def observe(self, shape: StepShape, chosen: list[int], accepted: list[int],
                stats: SpecStepStats, charge: Charge, found: list[int] | None = None) -> None:
        """Learn from a finished step: `chosen` the drafts asked per sequence, `found` those the
        proposer found (None: all asked), `stats` the device time of its phases (a step without
        speculation: no drafts, the target pass as verify_time), `charge` the seconds the step
        cost end to end, host work included, catching the draft up on earlier steps excluded, and
        whether it was a plain step that could not overlap the speculative one before it."""
        ...

    def prepare(self, shape: StepShape) -> None:
        """Called while the device runs a step of this shape, after the steps read so far were
        observed: work towards choosing for the next step (likely of the same shape) may be done
        now, off the host's critical path; `choose` then decides what of it applies."""
        ...

    def release(self, seq_ids: list[int]) -> None: ...

    def estimates(self) -> PolicyEstimates: ...


class _StaticPolicy:
    """A k that depends on the step's shape alone, capped per sequence; nothing is learned."""

    def k_for(self, shape: StepShape) -> int:
        raise NotImplementedError

    def choose(self, shape: StepShape) -> list[int]:
        k = self.k_for(shape)
        if min(shape.caps, default=k) >= k:   # no sequence near the draft's limit (most steps)
            return [k] * len(shape.caps)
        return [min(k, cap) for cap in shape.caps]

    def observe(self, shape, chosen, accepted, stats, charge, found=None) -> None:
        pass

    def prepare(self, shape: StepShape) -> None:
        pass

    def release(self, seq_ids: list[int]) -> None:
        pass

    def estimates(self) -> PolicyEstimates:
        return PolicyEstimates()


class FixedPolicy(_StaticPolicy):
    """k = num_speculative_tokens for every decoding sequence (vLLM's behaviour)."""

    def __init__(self, k: int):
        self.k = k

    def k_for(self, shape: StepShape) -> int:
        return self.k


class BatchSizeTablePolicy(_StaticPolicy):
    """k from a static table of batch-size bounds: the hand-tuned alternative to AdaptivePolicy.

    table: (max_batch, k) pairs; a step whose speculating decoding sequences number at most
    max_batch drafts k (the smallest such bound wins), and k = 0 above the largest bound,
    e.g. [(4, 4), (16, 3), (64, 2), (128, 1)].
    """

    def __init__(self, table: list[tuple[int, int]]):
        bounds = [n for n, _ in table]
        if not table or len(set(bounds)) != len(bounds) or any(n < 1 or k < 0 for n, k in table):
            raise ValueError(f"table must be (max_batch >= 1, k >= 0) pairs with distinct bounds, got {table!r}.")
        self.table = sorted(table)

    @classmethod
    def from_schedule(cls, ranges: list[tuple[int, int, int]], max_k: int) -> "BatchSizeTablePolicy":
        """vLLM's num_speculative_tokens_per_batch_size (checked [first, last, k] ranges from 1): a batch
        size between two ranges takes the earlier's k, one past the last range the last's; k <= max_k."""
        table, last_k, next_size = [], 0, 1
        for first, last, k in ranges:
            if first > next_size:
                table.append((first - 1, last_k))
            last_k, next_size = min(k, max_k), last + 1
            table.append((last, last_k))
        return cls([*table, (math.inf, last_k)])   # (past the last range)

    def k_for(self, shape: StepShape) -> int:
        return self.k_for_batch(len(shape.seq_ids))

    def k_for_batch(self, n: int) -> int:
        return next((k for bound, k in self.table if n <= bound), 0)

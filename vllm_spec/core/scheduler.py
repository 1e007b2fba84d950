"""Continuous batching with chunked prefill and preemption by recompute.

Each step feeds every scheduled sequence tokens[num_computed:num_computed+n].
Sequences in decode go first (one token, plus lookahead slots for drafts), so a
long prompt never stalls them; prompts then take what is left of the token
budget, in chunks. When blocks run out the newest running sequence is
preempted: its blocks are freed and it is recomputed later from its tokens.
With chunked prefill off, a prompt waits (in its queue's order) for a step whose
budget left holds all of its tokens (so no running sequence is ever part-prefilled).
With the "priority" policy the waiting queue is kept in (priority, arrival)
order and preemption takes the running sequence last in that order.
With async scheduling a decoding sequence may have a token in flight (sampled by
a step whose outputs are not read yet): it counts as uncomputed, the next step
feeds it from the device, and a sequence whose tokens in flight already reach
its length limit is not scheduled again.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from vllm_spec.config import SchedulerConfig
from vllm_spec.core.block_manager import BlockManager
from vllm_spec.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)   # built per sequence per step: slots make it cheaper to build and read
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    samples: bool   # the chunk reaches the end of the sequence, so the step produces a token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_lookahead_slots: int = 0
    # The scheduled sequences computing prompt tokens (or recomputing after preemption), and how many.
    prefilling: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Picks the sequences of each engine step under max_num_seqs and max_num_batched_tokens."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, num_lookahead_slots: int = 0):
        self.config = config
        self.block_manager = block_manager
        self.num_lookahead_slots = num_lookahead_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._returned_budget = 0

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Queue a new sequence (at the back) or a preempted one (at the front): first come, first
        served; by priority, in (priority, arrival) order (ties keep the same rule)."""
        if self.config.policy == "priority":
            key = _priority_key(seq)
            find = bisect.bisect_left if front else bisect.bisect_right
            self.waiting.insert(find(self.waiting, key, key=_priority_key), seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark a sequence finished (or aborted) and return its blocks, wherever it is."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)
        out.preempted.append(seq)

    def _preempt_for(self, seq: Sequence, num_new_tokens: int, num_lookahead: int, out: SchedulerOutput) -> bool:
        """Preempt until seq's slots fit. First come, first served: the newest first, never one already
        scheduled this step, as a last resort seq itself. By priority (as vLLM V1): the last in priority
        order, seq itself or one scheduled this step included (taken out of the step, its tokens back in
        the budget: _returned_budget). True when seq got its slots, False when it was preempted."""
        scheduled = {id(s.seq) for s in out.scheduled}
        while True:
            if self.config.policy == "priority":
                victim = max(self.running, key=_priority_key)
                if id(victim) in scheduled:
                    self._unschedule(victim, out)
                    scheduled.discard(id(victim))
            else:
                victim = next((s for s in reversed(self.running) if id(s) not in scheduled and s is not seq), seq)
            self._preempt(victim, out)
            if victim is seq:
                return False
            if self.block_manager.try_append_slots(seq, num_new_tokens, num_lookahead):
                return True

    def _unschedule(self, seq: Sequence, out: SchedulerOutput) -> None:
        item = next(item for item in out.scheduled if item.seq is seq)
        out.scheduled.remove(item)
        if seq in out.prefilling:
            out.prefilling.remove(seq)
            out.num_prefill_tokens -= item.num_new_tokens
        self._returned_budget += item.num_new_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(num_lookahead_slots=self.num_lookahead_slots)
        budget = self.config.max_num_batched_tokens
        self._returned_budget = 0   # tokens of sequences taken out of this step by preemption (priority)
        bm = self.block_manager
        max_model_len = self.config.max_model_len
        lookahead = self.num_lookahead_slots
        block_size = bm.block_size
        # Decodes first, then partially prefilled sequences, oldest first within each. Decodes are
        # scheduled where the one pass over the running list meets them (it visits every sequence at
        # every step): all of their tokens (<= 1) fit the budget left (> 0), so each samples.
        prefills = []
        for seq in self.running.copy():   # a copy: preemption removes from the list
            if out.preempted:   # (asked only once something was: all are RUNNING and scheduled until then)
                budget, self._returned_budget = budget + self._returned_budget, 0
                if seq.status is not SequenceStatus.RUNNING:   # preempted earlier in this loop
                    continue
            if budget <= 0:
                break
            uncomputed = seq.num_tokens_to_schedule(max_model_len)
            if uncomputed is None:
                continue   # its last token is already being sampled
            if uncomputed > 1:
                prefills.append((seq, uncomputed))
            # The table covering the step already (most steps) is try_append_slots's own first check,
            # made here: the call costs more than the check, for every sequence at every step.
            elif (seq.num_computed_tokens + uncomputed + lookahead <= len(seq.block_table) * block_size
                  or bm.try_append_slots(seq, uncomputed, lookahead)
                  or self._preempt_for(seq, uncomputed, lookahead, out)):
                out.scheduled.append(ScheduledSeq(seq, uncomputed, True))
                budget -= uncomputed
        if self.config.policy == "priority":   # the token budget goes to prompts in priority order
            prefills.sort(key=lambda item: _priority_key(item[0]))
        for seq, uncomputed in prefills:
            if out.preempted:
                budget, self._returned_budget = budget + self._returned_budget, 0
                if seq.status is not SequenceStatus.RUNNING:
                    continue
            if budget <= 0:
                break
            n = min(uncomputed, budget)
            slots = lookahead if n == uncomputed else 0
            if bm.try_append_slots(seq, n, slots) or self._preempt_for(seq, n, slots, out):
                out.scheduled.append(ScheduledSeq(seq, n, n == uncomputed))
                out.prefilling.append(seq)
                out.num_prefill_tokens += n
                budget -= n
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_in_flight:   # preempted while a step sampled for it: recompute once it is known
                break
            cached = bm.cached_prefix(seq)
            uncomputed = seq.num_uncomputed_tokens - len(cached) * block_size
            if uncomputed > budget and not self.config.chunked_prefill:
                break
            n = min(uncomputed, budget)
            slots = lookahead if n == uncomputed else 0
            if not bm.can_allocate(seq, n, slots, cached):
                break
            self.waiting.popleft()
            bm.allocate(seq, n, slots, cached)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, n == uncomputed))
            out.prefilling.append(seq)
            out.num_prefill_tokens += n
            budget -= n
        return out


def _priority_key(seq: Sequence) -> tuple[int, float]:
    return seq.priority, seq.arrival_time

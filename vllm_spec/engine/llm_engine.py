"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_spec.config import EngineConfig
from vllm_spec.core.block_manager import BlockManager
from vllm_spec.core.scheduler import Scheduler, SchedulerOutput
from vllm_spec.core.sequence import Request, Sequence, SequenceStatus
from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.engine.gc_tuning import tune_gc_for_serving
from vllm_spec.engine.output_processor import OutputProcessor
from vllm_spec.engine.request_builder import new_request
from vllm_spec.engine.request_input import check_neutral, check_request_id, check_request_options
from vllm_spec.engine.request_output import make_request_output
from vllm_spec.engine.stat_logger import LOG_STATS_INTERVAL, LoggingStatLogger
from vllm_spec.engine.stats import EngineStats
from vllm_spec.executor import create_executor
from vllm_spec.executor.base import apply_to_model, rpc_call
from vllm_spec.generation_config import model_eos_token_ids
from vllm_spec.inputs import PromptType
from vllm_spec.metrics import Metric
from vllm_spec.outputs import RequestOutput
from vllm_spec.profiler import EngineProfiler
from vllm_spec.sampling_params import RequestOutputKind, SamplingParams
from vllm_spec.spec_decode.metrics import SpecDecodeMetrics
from vllm_spec.tokenizer import get_tokenizer
from vllm_spec.worker.batch import PLACEHOLDER_TOKEN, ExecuteModelRequest, SeqInput
from vllm_spec.worker.step_handle import StepHandle

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over one executor. Not thread-safe: drive it from one thread.

    Building one tunes Python's garbage collector for the whole process, as vLLM does: what exists
    then is frozen out of collections (gc.freeze) until the engine is collected, and the young
    generation's threshold is raised to about what a full batch's step allocates (never lowered), so
    cyclic garbage of the host application is also collected less often."""

    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False):
        self.config = config
        self.tokenizer = None if skip_tokenizer_init else get_tokenizer(config.model)
        self.executor = create_executor(config)
        self.block_manager = BlockManager(self.executor.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.num_lookahead_slots)
        self.output_processor = OutputProcessor(self.tokenizer, config.model.max_model_len)
        self.update_eos_token_ids()
        self.profiler = EngineProfiler()
        if config.model.sampling_defaults:
            logger.info("Default sampling parameters have been overridden by the model's generation config: %s "
                        "(generation_config='vllm' keeps vLLM's own).", config.model.sampling_defaults)
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._released: list[int] = []
        # Seconds the engine held no request (waiting for some) or ran nothing (requests waiting for KV
        # blocks) since its last request to the worker: no step's cost. The caller's time between steps
        # while steps run (a server's dispatch of outputs) is part of serving them. _idle_since: when
        # the engine last began to wait (None: steps run).
        self._idle_time = 0.0
        self._idle_since: float | None = None
        self.async_scheduling = config.uses_async_scheduling
        self._in_flight: _Launched | None = None   # a step launched and not read yet (async scheduling)
        self._last_read: float | None = None   # when the last step's outputs were applied (sequences' token times)
        self.stats = EngineStats(config.model.max_model_len, config.scheduler.max_num_batched_tokens)
        self.spec_metrics = SpecDecodeMetrics(config.speculative.num_speculative_tokens) if config.speculative else None
        self._unfreeze_gc = tune_gc_for_serving(self, config.scheduler.max_num_seqs)
        self.stat_logger = LoggingStatLogger()
        self._next_stats_log = time.monotonic() + LOG_STATS_INTERVAL if config.log_stats else math.inf

    @classmethod
    def from_engine_args(cls, args: EngineArgs, usage_context: object = None,
                         stat_loggers: dict | None = None, enable_multiprocessing: bool = False) -> "LLMEngine":
        """As vLLM's (usage_context is only a usage-statistics label; custom stat loggers are not
        supported: get_metrics() gives the metrics; enable_multiprocessing, vLLM's engine core in a
        process of its own, changes nothing here: the engine's work is the same either way)."""
        check_neutral(stat_loggers=stat_loggers)
        return cls(args.create_engine_config(), skip_tokenizer_init=args.skip_tokenizer_init)

    def get_tokenizer(self):
        """The tokenizer; None with skip_tokenizer_init."""
        return self.tokenizer

    def get_model_config(self):
        """The target's ModelConfig."""
        return self.model_config

    # vLLM's names for the parts of the configuration (scripts read llm.llm_engine.model_config.max_model_len).
    vllm_config = property(lambda self: self.config)
    model_config = property(lambda self: self.config.model_config)
    cache_config = property(lambda self: self.config.cache_config)
    scheduler_config = property(lambda self: self.config.scheduler_config)
    parallel_config = property(lambda self: self.config.parallel_config)
    speculative_config = property(lambda self: self.config.speculative_config)

    def update_eos_token_ids(self) -> None:
        """The ids that end a request (the model's config, its generation config, the tokenizer's) and
        the primary one (the tokenizer's, else the config's first): as vLLM, ending at another reports
        it as the stop_reason (vLLM adds a generation config's other EOS ids to stop_token_ids)."""
        self.output_processor.eos_token_ids, self.output_processor.primary_eos_token_id = model_eos_token_ids(
            self.config.model, self.tokenizer)

    # Requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: None = None,
                    tokenization_kwargs: dict | None = None, trace_headers: dict | None = None,
                    priority: int = 0) -> str:
        """Validate and queue a request, returning its id (as vLLM's); a bad request raises ValueError
        (TypeError: a request_id that is not a string) and changes nothing. arrival_time: when it arrived (time.time(), as vLLM's; now by
        default; RequestOutput.metrics are on the monotonic clock); priority: lower runs first, with
        scheduling_policy="priority" (0 otherwise); lora_request, tokenization_kwargs and trace_headers:
        vLLM's, accepted at their neutral values (no LoRA, no tracing)."""
        check_request_id(request_id)
        check_request_options(self.config.scheduler.policy, lora_request, tokenization_kwargs, trace_headers,
                              priority)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        request, max_tokens = new_request(request_id, prompt, params, self.config, self.tokenizer,
                                          self.output_processor.eos_token_ids, arrival_time, priority)
        self.requests[request_id] = request
        for seq in request.seqs:
            self.output_processor.start(seq)
            self._seqs[seq.seq_id] = seq
            self.scheduler.add(seq)
        self.stats.on_new_request(len(request.prompt_token_ids), request.sampling_params.n, max_tokens)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop request(s) and free their KV blocks; unknown or finished ids are ignored."""
        self.abort_with_outputs(request_ids)

    def abort_with_outputs(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """abort_request, returning each aborted request's last output (finished; its unfinished
        completions' finish_reason "abort"), as vLLM's output processor gives its streams."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
            now = time.monotonic()
            self.stats.on_finished(request, now)
            outputs.append(make_request_output(request, True, now))
        if not self.requests and self._in_flight is not None:
            # An idle engine holds no step (its outputs are all void now). Aborts run in error
            # paths too: a failed read is logged here, not raised over the error being handled.
            try:
                self._drain(0.0)
            except Exception:
                self.block_manager.reset_prefix_cache()   # as in step(): that step's blocks may lack their K/V
                logger.exception("reading the step in flight failed while aborting the last requests")
        if not self.requests and self._idle_since is None:
            self._idle_since = time.perf_counter()
        return outputs

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        self._seqs.pop(seq.seq_id, None)
        self._released.append(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """As vLLM V1's: a request of n > 1 counts each of its unfinished completions (vLLM's child requests)."""
        return sum(not seq.is_finished for request in self.requests.values() for seq in request.seqs)

    # Steps --------------------------------------------------------------------------
    def _model_request(self, sched: SchedulerOutput) -> ExecuteModelRequest:
        seqs = []
        for item in sched.scheduled:
            seq, start, sample, n = item.seq, item.seq.num_computed_tokens, item.samples, item.num_new_tokens
            params, prompt, output = seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids
            num_prompt = len(prompt)
            if n == 1 and start >= num_prompt:   # a decode: token_slice's answer without its calls
                tokens = [output[start - num_prompt]] if start - num_prompt < len(output) else [PLACEHOLDER_TOKEN]
            else:
                tokens = seq.token_slice(start, start + n)
            prompt_logprobs = params.prompt_logprobs if seq.prompt_logprobs is not None and start < num_prompt else None
            # Positional: keyword arguments cost twice as much, and this runs per sequence per step.
            seqs.append(SeqInput(seq.seq_id, tokens, start, seq.block_table, sample, params if sample else None,
                                 prompt, output, prompt_logprobs, seq.num_draft_cached_tokens))
        released, self._released = self._released, []
        idle, self._idle_time = self._idle_time, 0.0
        return ExecuteModelRequest(seqs, released, sched.num_lookahead_slots, idle)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of every request that advanced.

        With async scheduling, a step that emits one token per sequence is left running on the
        device and read at the next call, after that call has scheduled and launched its own step:
        the host's work then overlaps the device's, and outputs arrive one call later.
        """
        t0 = time.perf_counter()
        if self._idle_since is not None:
            self._idle_time += t0 - self._idle_since
            self._idle_since = None
        try:
            outputs = self._step(t0)
        except BaseException:
            # A failed step may have left registered blocks without their K/V.
            self.block_manager.reset_prefix_cache()
            raise
        finally:
            if not self.requests:
                self._idle_since = time.perf_counter()
        if time.monotonic() >= self._next_stats_log:
            self._next_stats_log = time.monotonic() + LOG_STATS_INTERVAL
            self.do_log_stats()
        return outputs

    def do_log_stats(self, scheduler_outputs: None = None, model_output: None = None) -> None:
        """vLLM's: log the statistics lines now (vllm_spec.engine.stat_logger). A failure is logged, never
        raised: statistics must not fail the step that logs them."""
        try:
            self.stat_logger.log(self.get_metrics())
        except Exception:
            logger.exception("logging the statistics failed")

    def _step(self, t0: float) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            outputs = self._drain(time.perf_counter() - t0)
            self._idle_since = time.perf_counter()   # nothing runs: the engine waits (for requests, KV blocks)
            return outputs
        request = self._model_request(sched)
        t1 = time.perf_counter()
        try:
            handle = self.executor.launch(request)
        except BaseException:
            # The worker never saw these releases (nor this idle time): hand them over with the next step.
            self._released = request.finished_seq_ids + self._released
            self._idle_time += request.engine_idle_time
            raise
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if item.samples:
                seq.num_in_flight += 1
        if self.block_manager.enable_caching:
            for seq in sched.prefilling:   # launched: any step that can read these blocks runs after this one
                self.block_manager.register_computed(seq)
        launched = _Launched(handle, schedule_time=t1 - t0, launch_time=time.perf_counter() - t1,
                             num_prompt_tokens=sched.num_prefill_tokens)
        # The new step is in flight before the previous one is read (kept, should that read raise).
        previous, self._in_flight = self._in_flight, launched
        outputs = []
        if previous is not None:   # this call's scheduling is reported with the step it overlapped
            outputs = self._read(previous, launched.schedule_time, launched.launch_time)
            launched.schedule_time = launched.launch_time = 0.0
        if not (self.async_scheduling and handle.one_token_per_seq) or not self.requests:
            # Read now: its outputs decide the next step, or nothing is left to overlap it with (an
            # idle engine holds no step).
            outputs += self._drain(launched.schedule_time, launched.launch_time)
        return outputs

    @property
    def has_step_in_flight(self) -> bool:
        """A launched step waits to be read (async scheduling): step() has work even with no request."""
        return self._in_flight is not None

    def _drain(self, schedule_time: float, launch_time: float = 0.0) -> list[RequestOutput]:
        """Read the step in flight, if any."""
        launched, self._in_flight = self._in_flight, None
        return [] if launched is None else self._read(launched, schedule_time, launch_time)

    def _read(self, launched: "_Launched", schedule_time: float, launch_time: float = 0.0) -> list[RequestOutput]:
        """Wait for a launched step's outputs and apply them; the times are this call's own host work."""
        t2 = time.perf_counter()
        result = launched.handle.result()
        t3 = time.perf_counter()
        if result.spec is not None:
            self.spec_metrics.add(result.spec)
        for scored in result.prompt_logprobs:
            seq = self._seqs.get(scored.seq_id)
            if seq is not None:   # a recomputed prefill (after preemption) rewrites the same entries
                if seq.sampling_params.detokenize:
                    for entry in scored.entries:
                        self.output_processor.decode_logprobs(entry)
                seq.prompt_logprobs[scored.start: scored.start + len(scored.entries)] = scored.entries
        # Requests to report on: every one that advanced, except FINAL_ONLY ones still running.
        touched: dict[str, Request] = {}
        now = time.monotonic()
        generated = 0
        # Bound once: this loop runs per sequence per step (and enum members read off their class
        # run Python code in 3.11).
        seqs, requests, append = self._seqs, self.requests, self.output_processor.append
        itl = self.stats.inter_token_latency.observe
        caching, register = self.block_manager.enable_caching, self.block_manager.register_computed
        last_read, self._last_read = self._last_read, now
        num_since_last_read = 0
        running, final_only = SequenceStatus.RUNNING, RequestOutputKind.FINAL_ONLY
        logprobs = result.logprobs or [None] * len(result.seq_ids)
        for seq_id, token_ids, lps in zip(result.seq_ids, result.token_ids, logprobs, strict=True):
            seq = seqs.get(seq_id)
            if seq is None:   # finished or aborted while this step was in flight: its token is void
                continue
            last = seq.last_token_time
            if last is None:
                seq.first_token_time = now
                self.stats.on_first_token(now - seq.arrival_time)
            elif last is last_read:   # most sequences: tokens at the last read too (counted at once below)
                num_since_last_read += 1
            else:
                itl(now - last)
            seq.last_token_time = now
            generated += append(seq, token_ids, lps)
            seq.num_in_flight -= 1
            status = seq.status
            if not seq.num_in_flight and (status is running or caching and status.finished):
                # Every token but the newest now has its K/V in the cache (a finished sequence's last
                # blocks are registered for the prefix cache with it).
                seq.num_computed_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids) - 1
            if caching:   # its full blocks below num_computed_tokens (launched steps included: any reader runs
                register(seq)   # after them on the device; a sequence preempted meanwhile holds none)
            if status is not running and status.finished:   # the property runs Python code: asked last
                self._finish(seq, status)
            elif seq.sampling_params.output_kind is final_only:
                continue
            touched[seq.request_id] = requests[seq.request_id]
        if num_since_last_read:
            itl(now - last_read, num_since_last_read)
        self.stats.on_generated(generated, launched.num_prompt_tokens)
        outputs = []
        for request in touched.values():
            finished = request.is_finished
            if finished or request.sampling_params.output_kind is not final_only:
                outputs.append(make_request_output(request, finished, now))
            if finished:
                self.stats.on_finished(self.requests.pop(request.request_id), now)
        t4 = time.perf_counter()
        worker_host = launch_time + (t3 - t2) - result.device_wait_time
        self.stats.on_step(schedule_time + launch_time + (t4 - t2), schedule_time, worker_host, t4 - t3,
                           result.device_time)
        return outputs

    def start_profile(self) -> None:
        """Start a torch profiler trace of this process (vllm_spec.profiler; vLLM's)."""
        self.profiler.start()

    def stop_profile(self) -> None:
        """Stop the trace and write it to $VLLM_TORCH_PROFILER_DIR."""
        self.profiler.stop()

    def shutdown(self) -> None:
        """Stop the executor's worker processes (tensor-parallel ranks, and their memory; steps fail
        afterwards) and give what was frozen at build back to the collector. Idempotent; dropping the
        engine does the same, once it is collected. (Without worker processes the engine's model lives in
        this process, freed when the engine is.)"""
        self.executor.shutdown()
        self._unfreeze_gc()

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: every worker (one per tensor-parallel rank) runs `method` (its own method of that name, or a
        callable given the worker first, then args and kwargs); their results by rank. Between steps."""
        return self.executor.collective_rpc(*rpc_call(method, timeout, args, kwargs))

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list:
        """vLLM's: func(model) on every rank's (target) model; the results by rank."""
        if not callable(func):
            raise ValueError(f"apply_model: func must be a callable taking the model, got {type(func).__name__}.")
        return self.collective_rpc(functools.partial(apply_to_model, func))

    def reset_prefix_cache(self, device: object = None, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache's registrations: later prompts compute every token again (blocks
        in use keep their contents, so running requests need no reset either way). True, as vLLM's when
        it succeeds. (device: vLLM V0's, ignored.)"""
        self.block_manager.reset_prefix_cache()
        return True

    # Metrics ------------------------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        bm = self.block_manager
        metrics = self.stats.snapshot(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.num_queried_tokens, prefix_cache_hits=bm.num_hit_tokens,
        )
        return metrics + (self.spec_metrics.snapshot() if self.spec_metrics else [])



@dataclass
class _Launched:
    """A step on its way: the handle its outputs come from, and the host time it took to get there."""

    handle: StepHandle
    schedule_time: float
    launch_time: float
    num_prompt_tokens: int

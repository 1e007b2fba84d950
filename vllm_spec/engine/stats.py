"""Engine counters and latency histograms, reported with vLLM's metric names."""

from __future__ import annotations

from collections import Counter as TallyCounter

from vllm_spec.core.sequence import Request, SequenceStatus
from vllm_spec.metrics import Counter, Gauge, HistogramRecorder, Metric, one_two_five_buckets


class EngineStats:
    """Accumulates what the engine observes; snapshot() renders vLLM-style metric objects."""

    def __init__(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.step_time = 0.0
        # Host-side phases of a step: scheduling + building the batch, the worker's host work
        # (input preparation, launches; on a CPU device also the model itself), output processing.
        self.schedule_time = 0.0
        self.worker_host_time = 0.0
        self.output_time = 0.0
        self.device_time = 0.0   # the steps' spans on the device's clock (0 on CPU)
        # Every finish reason from the start, at 0 until one is seen (as vLLM's labelled counter).
        self.finished: TallyCounter[str] = TallyCounter({"stop": 0, "length": 0, "abort": 0})
        self.ttft = HistogramRecorder("vllm:time_to_first_token_seconds")
        self.e2e = HistogramRecorder("vllm:e2e_request_latency_seconds")
        self.tpot = HistogramRecorder("vllm:request_time_per_output_token_seconds")
        # Between a sequence's steps that emit tokens (a speculative step may emit several at once).
        self.inter_token_latency = HistogramRecorder("vllm:inter_token_latency_seconds")
        # vLLM's phases of a request: waiting, then prefill (to its first token), then decode.
        self.phases = {name: HistogramRecorder(f"vllm:request_{name}_time_seconds")
                       for name in ("queue", "prefill", "decode", "inference")}
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = HistogramRecorder("vllm:request_prompt_tokens", token_buckets)
        self.request_generation_tokens = HistogramRecorder("vllm:request_generation_tokens", token_buckets)
        self.request_max_generation_tokens = HistogramRecorder("vllm:request_max_num_generation_tokens",
                                                               token_buckets)
        self.params_n = HistogramRecorder("vllm:request_params_n", (1.0, 2.0, 5.0, 10.0, 20.0))
        self.params_max_tokens = HistogramRecorder("vllm:request_params_max_tokens", token_buckets)
        self.iteration_tokens = HistogramRecorder("vllm:iteration_tokens_total",
                                                  one_two_five_buckets(max_num_batched_tokens))

    def on_new_request(self, num_prompt_tokens: int, n: int, max_tokens: int) -> None:
        # Each of n parallel samples prefills the prompt (as vLLM's n > 1 child requests count it).
        self.prompt_tokens += num_prompt_tokens * n
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_generated(self, num_tokens: int, num_prompt_tokens: int) -> None:
        """A step's tokens: those it emitted, and the prompt tokens it computed."""
        self.generation_tokens += num_tokens
        self.iteration_tokens.observe(num_tokens + num_prompt_tokens)

    def on_finished(self, request: Request, now: float) -> None:
        """A request's end: per sequence (as vLLM's n > 1 child requests), its latency, the finish
        reason, the prompt and generated tokens and the time per output token after the first."""
        for seq in request.seqs:
            # An aborted sequence ends when it is aborted, not at its last token.
            aborted = seq.status is SequenceStatus.FINISHED_ABORTED
            end = now if aborted or seq.last_token_time is None else seq.last_token_time
            self.e2e.observe(end - request.arrival_time)
            if seq.first_scheduled_time is not None:
                self.phases["queue"].observe(seq.first_scheduled_time - request.arrival_time)
                self.phases["inference"].observe(end - seq.first_scheduled_time)
                if seq.first_token_time is not None:
                    self.phases["prefill"].observe(seq.first_token_time - seq.first_scheduled_time)
                    self.phases["decode"].observe(end - seq.first_token_time)
            self.finished[seq.status.finish_reason or "abort"] += 1
            n = len(seq.output_token_ids)
            self.request_prompt_tokens.observe(len(request.prompt_token_ids))
            self.request_generation_tokens.observe(n)
            if n > 1 and seq.first_token_time is not None:
                self.tpot.observe(((seq.last_token_time or now) - seq.first_token_time) / (n - 1))
        self.request_max_generation_tokens.observe(max(len(seq.output_token_ids) for seq in request.seqs))

    def on_step(self, total: float, schedule: float, worker_host: float, output: float, device: float) -> None:
        self.num_steps += 1
        self.device_time += device
        self.step_time += total
        self.schedule_time += schedule
        self.worker_host_time += worker_host
        self.output_time += output

    def snapshot(self, running: int, waiting: int, kv_usage: float, num_preemptions: int,
                 prefix_cache_queries: int, prefix_cache_hits: int) -> list[Metric]:
        metrics: list[Metric] = [
            Gauge("vllm:num_requests_running", value=running),
            Gauge("vllm:num_requests_waiting", value=waiting),
            Gauge("vllm:kv_cache_usage_perc", value=kv_usage),
            Counter("vllm:num_preemptions", value=num_preemptions),
            # Prompt tokens looked up in the prefix cache, and those found there.
            Counter("vllm:prefix_cache_queries", value=prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", value=prefix_cache_hits),
            Counter("vllm:prompt_tokens", value=self.prompt_tokens),
            Counter("vllm:generation_tokens", value=self.generation_tokens),
            Counter("vllm:engine_steps", value=self.num_steps),
            Counter("vllm:engine_step_seconds", value=self.step_time),
            Counter("vllm:engine_host_schedule_seconds", value=self.schedule_time),
            Counter("vllm:engine_host_worker_seconds", value=self.worker_host_time),
            Counter("vllm:engine_host_output_seconds", value=self.output_time),
            Counter("vllm:engine_device_seconds", value=self.device_time),
        ]
        metrics += [Counter("vllm:request_success", {"finished_reason": r}, v) for r, v in sorted(self.finished.items())]
        metrics += [h.snapshot() for h in (self.ttft, self.e2e, self.tpot, self.inter_token_latency,
                                           self.request_prompt_tokens, self.request_generation_tokens,
                                           self.request_max_generation_tokens, self.params_n,
                                           self.params_max_tokens, self.iteration_tokens,
                                           *self.phases.values())]
        return metrics

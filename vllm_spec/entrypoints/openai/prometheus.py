"""The Prometheus collector behind GET /metrics: renders the engine's latest metric snapshot (plus
the server's own gauges) with vLLM's metric names, each labelled with the served model name."""

from __future__ import annotations

from typing import Any

from vllm_spec.engine.async_llm_engine import AsyncLLMEngine
from vllm_spec.metrics import Counter, Gauge, Histogram, Vector

_METRIC_HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:num_preemptions": "Cumulative number of preemptions.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:engine_steps": "Number of engine steps run.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of end-to-end request latency in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:request_queue_time_seconds": "Seconds from a request's arrival to its first scheduling.",
    "vllm:request_prefill_time_seconds": "Seconds from a request's first scheduling to its first token.",
    "vllm:request_decode_time_seconds": "Seconds from a request's first token to its last.",
    "vllm:request_inference_time_seconds": "Seconds from a request's first scheduling to its last token.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
    "vllm:spec_decode_acceptance_rate": "Speculative token acceptance rate (accepted / draft tokens).",
    "vllm:spec_decode_mean_accepted_length": "Mean tokens emitted per speculating sequence and step.",
    "vllm:spec_decode_draft_acceptance_rate": "Speculative token acceptance rate (vLLM V0's name).",
    "vllm:spec_decode_efficiency": "Speculative decoding system efficiency: emitted tokens over the most possible.",
    "vllm:spec_decode_num_emitted_tokens": "Number of emitted tokens in speculative steps.",
    "vllm:kv_cache_free_blocks": "Free KV-cache blocks.",
    "vllm:kv_cache_total_blocks": "Usable KV-cache blocks (free when idle).",
    "vllm:num_requests_in_flight": "Requests with an open output stream in the server.",
    "vllm:engine_step_errors": "Engine steps that raised (their in-flight requests failed).",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig (its labels; the value is 1).",
}


class EngineCollector:
    """Prometheus collector: renders the engine's latest metric snapshot at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []

    def _cache_labels(self) -> dict[str, str]:
        """vLLM's cache_config_info labels (as strings, its spelling of values)."""
        cache, model = self.engine.config.cache, self.engine.config.model
        return {"block_size": str(cache.block_size), "cache_dtype": "auto",
                "enable_prefix_caching": str(cache.enable_prefix_caching),
                "gpu_memory_utilization": str(cache.gpu_memory_utilization),
                "num_gpu_blocks": str(self.engine.num_usable_blocks), "dtype": str(model.dtype).removeprefix("torch.")}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        metrics, free_blocks = self.engine.get_metrics_nowait()
        metrics = list(metrics) + [
            Gauge("vllm:kv_cache_free_blocks", value=free_blocks),
            Gauge("vllm:kv_cache_total_blocks", value=self.engine.num_usable_blocks),
            Gauge("vllm:num_requests_in_flight", value=self.engine.num_in_flight),
            Counter("vllm:engine_step_errors", value=self.engine.num_step_errors),
            Gauge("vllm:cache_config_info", value=1, labels=self._cache_labels()),
        ]
        families: dict[str, Any] = {}
        label_names: dict[str, list[str]] = {}
        for m in metrics:
            extra = sorted(m.labels)
            if isinstance(m, Vector):
                extra = ["position"]
            names = ["model_name", "engine", *extra]   # (vLLM V1's labels: engine is the engine's index)
            fam = families.get(m.name)
            if fam is None:
                doc = _METRIC_HELP.get(m.name, m.name)
                if isinstance(m, (Counter, Vector)):
                    fam = CounterMetricFamily(m.name, doc, labels=names)
                elif isinstance(m, Gauge):
                    fam = GaugeMetricFamily(m.name, doc, labels=names)
                elif isinstance(m, Histogram):
                    fam = HistogramMetricFamily(m.name, doc, labels=names)
                else:
                    continue
                families[m.name] = fam
                label_names[m.name] = names
            if label_names[m.name] != names:
                continue  # inconsistent labels for one name: keep the first form
            values = [self.model_name, "0", *(m.labels[k] for k in sorted(m.labels))]
            if isinstance(m, Vector):
                for pos, v in enumerate(m.values):
                    fam.add_metric([self.model_name, "0", str(pos)], v)
            elif isinstance(m, Histogram):
                buckets = [(b, v) for b, v in m.buckets.items()]
                if not buckets or buckets[-1][0] != "+Inf":
                    buckets.append(("+Inf", m.count))
                fam.add_metric(values, buckets, m.sum)
            else:
                fam.add_metric(values, float(m.value))
        yield from families.values()

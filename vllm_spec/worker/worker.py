"""A worker: one model on one device, its KV cache, and sampling state per sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_spec.config import EngineConfig
from vllm_spec.distributed.parallel_state import GroupCoordinator, get_tp_group
from vllm_spec.model.loader import load_model
from vllm_spec.outputs import Logprob
from vllm_spec.sample.metadata import SamplingMetadata, SamplingRow
from vllm_spec.sample.sampler import Sampler, SamplerOutput, gather_logprobs
from vllm_spec.utils import to_device
from vllm_spec.worker.batch import ExecuteModelRequest, PromptLogprobs, SeqInput, SeqOutput, StepOutput
from vllm_spec.worker.model_runner import ModelRunner

_CPU_KV_CACHE_BYTES = 2 << 30


class Worker:
    """Runs the target model for plain (non-speculative) steps and samples one token per sequence."""

    def __init__(self, config: EngineConfig, tp: GroupCoordinator | None = None):
        self.config = config
        self.device = config.model.device
        self.tp = tp or get_tp_group()
        self.runner = ModelRunner(load_model(config.model, self.tp), self.device, config.cache.block_size,
                                  config.model.max_model_len, cuda_graphs=not config.enforce_eager)
        self.vocab_size = config.model.arch.vocab_size
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.model.seed))
        self._generators: dict[int, torch.Generator] = {}

    # KV cache -----------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block(self.config.model.dtype)

    def available_kv_bytes(self) -> int:
        """Memory the KV caches may take: the explicit setting, else what the device can spare."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return _CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        # Headroom for activations of the largest batch: hidden states plus fp32 logits per token.
        arch = self.config.model.arch
        tokens = self.config.scheduler.max_num_batched_tokens
        activations = tokens * (arch.hidden_size * 16 + arch.intermediate_size * 4) * 4 + (1 << 30)
        return int(total * cache.gpu_memory_utilization - used - activations)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, self.config.model.dtype)
        if self.config.speculative is None:
            self.runner.capture_graphs([1], self.config.scheduler.max_num_seqs)

    # Steps ----------------------------------------------------------------------
    def generator_for(self, seq: SeqInput) -> torch.Generator | None:
        """The per-sequence generator of a seeded request, created on first use and kept across preemption."""
        params = seq.sampling_params
        if params is None or params.seed is None or params.is_greedy:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._generators.pop(sid, None)

    def sampling_row(self, seq: SeqInput) -> SamplingRow:
        return SamplingRow(seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids, self.generator_for(seq))

    @torch.inference_mode()
    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        self.release(req.finished_seq_ids)
        if not req.seqs:
            return StepOutput([])
        batch = self.runner.prepare(req.seqs)
        sampled = [i for i, s in enumerate(req.seqs) if s.sample]
        starts = batch.token_starts
        prompt_rows = PromptLogprobRows.of(req.seqs, starts)
        if not sampled and not prompt_rows.rows:
            self.runner.forward(batch)
            return StepOutput([])
        ends = [starts[i] + len(req.seqs[i].token_ids) - 1 for i in sampled]
        all_logits = self.runner.run(batch, to_device(ends + prompt_rows.rows, self.device))
        logits = all_logits[: len(ends)]
        prompt_logprobs = prompt_rows.results(all_logits[len(ends):], req.seqs)
        if not sampled:
            return StepOutput([], prompt_logprobs=prompt_logprobs)
        seqs = [req.seqs[i] for i in sampled]
        md = SamplingMetadata.build([self.sampling_row(s) for s in seqs], self.vocab_size, self.device)
        out = self.sampler(logits, md)
        tokens, wait = to_host(out.sampled)
        logprobs = logprob_dicts(out, [s.sampling_params.logprobs for s in seqs])
        return StepOutput([SeqOutput(s.seq_id, [t], None if lp is None else [lp])
                           for s, t, lp in zip(seqs, tokens, logprobs)], device_wait_time=wait,
                          prompt_logprobs=prompt_logprobs)


def logprob_dicts(out: SamplerOutput, num_logprobs: list[int | None]) -> list[dict[int, Logprob] | None]:
    """Per row: {token: Logprob} for the sampled token and the row's own top-k, or None when not asked."""
    if out.logprobs is None:
        return [None] * len(num_logprobs)
    ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
    result: list[dict[int, Logprob] | None] = []
    for row, k in enumerate(num_logprobs):
        if k is None:
            result.append(None)
            continue
        entry = {ids[row][0]: Logprob(lps[row][0], ranks[row])}
        for j in range(1, k + 1):
            entry.setdefault(ids[row][j], Logprob(lps[row][j], j))
        result.append(entry)
    return result


def to_host(t: torch.Tensor) -> tuple[list, float]:
    """The step's device->host copy, and the seconds the host waited for the device to get there."""
    start = time.perf_counter()
    values = t.tolist()
    return values, time.perf_counter() - start


@dataclass
class PromptLogprobRows:
    """The batch rows whose logits score a next prompt token, for chunks that asked for prompt logprobs.

    Row of position p predicts prompt token p+1; spans: (sequence index, first row in `rows`, count).
    """

    rows: list[int]
    targets: list[int]
    spans: list[tuple[int, int, int]]

    @classmethod
    def of(cls, seqs: list[SeqInput], starts: list[int]) -> "PromptLogprobRows":
        rows, targets, spans = [], [], []
        for i, s in enumerate(seqs):
            if s.prompt_logprobs is None:
                continue
            last = min(s.seq_len, len(s.prompt_token_ids) - 1)   # positions [start_pos, last) score tokens
            if last <= s.start_pos:
                continue
            n = last - s.start_pos
            spans.append((i, len(rows), n))
            rows += range(starts[i], starts[i] + n)
            targets += s.prompt_token_ids[s.start_pos + 1: last + 1]
        return cls(rows, targets, spans)

    def results(self, logits: torch.Tensor, seqs: list[SeqInput]) -> list[PromptLogprobs]:
        """Per chunk: {token: Logprob} for each scored prompt token and the top prompt_logprobs others."""
        if not self.spans:
            return []
        k = max(seqs[i].prompt_logprobs for i, _, _ in self.spans)
        tokens = to_device(self.targets, logits.device)
        ids, lps, ranks = gather_logprobs(logits.float(), tokens, k)
        dicts = logprob_dicts(SamplerOutput(tokens, ids, lps, ranks),
                              [seqs[i].prompt_logprobs for i, _, n in self.spans for _ in range(n)])
        return [PromptLogprobs(seqs[i].seq_id, seqs[i].start_pos + 1, dicts[first: first + n])
                for i, first, n in self.spans]

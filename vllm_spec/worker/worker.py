"""A worker: one model on one device, its KV cache, and sampling state per sequence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_spec.config import EngineConfig
from vllm_spec.distributed.parallel_state import GroupCoordinator, get_tp_group
from vllm_spec.model.loader import load_model
from vllm_spec.outputs import Logprob
from vllm_spec.sample.metadata import ReusedMetadata, SamplingMetadata, SamplingRow
from vllm_spec.sample.sampler import Sampler, SamplerOutput, gather_logprobs
from vllm_spec.structured_output.grammar import StructuredOutputs
from vllm_spec.utils import to_device
from vllm_spec.worker.batch import PLACEHOLDER_TOKEN, ExecuteModelRequest, PromptLogprobs, SeqInput, StepOutput
from vllm_spec.worker.cuda_graph import buckets_up_to
from vllm_spec.worker.model_runner import ModelRunner, PreparedBatch, to_device_aligned
from vllm_spec.worker.step_handle import DeviceSpan, DoneStep, HostCopy, StepHandle

_CPU_KV_CACHE_BYTES = 2 << 30


class Worker:
    """Runs the target model for plain (non-speculative) steps and samples one token per sequence."""

    def __init__(self, config: EngineConfig, tp: GroupCoordinator | None = None):
        self.config = config
        self.device = config.model.device
        self.tp = tp or get_tp_group()
        self.runner = ModelRunner(load_model(config.model, self.tp), self.device, config.cache.block_size,
                                  config.model.max_model_len, cuda_graphs=not config.enforce_eager,
                                  # A sharded LM head all-gathers: collectives stay out of graphs (as the draft loop's).
                                  graph_logits=self.tp.world_size == 1)
        self.vocab_size = config.model.arch.vocab_size
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.model.seed),
                               config.model.logprobs_mode)
        self._generators: dict[int, torch.Generator] = {}
        self._last: SampledStep | None = None   # the latest step that sampled: in-flight tokens come from it
        self._reused_md = ReusedMetadata()
        self.structured = StructuredOutputs(config.model)

    # KV cache -----------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block(self.config.model.dtype)

    def get_model(self) -> torch.nn.Module:
        """The model (vLLM's worker method: collective_rpc and apply_model reach it through this)."""
        return self.runner.model

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
        return int(total * cache.gpu_memory_utilization - used - activations - self._graph_logits_bytes())

    def _graph_logits_bytes(self) -> int:
        """What the logits outputs of the one-token graphs (every bucket's, kept by its graph) will take."""
        if not (self.runner.cuda_graphs and self.runner.graph_logits):
            return 0
        rows = sum(buckets_up_to(self.config.scheduler.max_num_seqs))
        return rows * self.vocab_size * torch.empty(0, dtype=self.config.model.dtype).element_size()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, self.config.model.dtype)
        if self.config.speculative is None:
            self.runner.capture_graphs([1], self.config.scheduler.max_num_seqs)
            self.runner.warm_logits(self.config.scheduler.max_num_seqs)   # the rows a prefill samples

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
        self.structured.release(seq_ids)

    def grammar_bitmasks(self, seq: SeqInput, drafts: list[int]) -> torch.Tensor | None:
        """[len(drafts) + 1, W] bitmasks of what the sequence's grammar allows after its output and the
        first j drafts; None without structured outputs."""
        params = seq.sampling_params
        if params is None or params.structured_outputs is None:
            return None
        return self.structured.bitmasks(seq.seq_id, params.structured_outputs, seq.output_token_ids, drafts)

    def sampling_row(self, seq: SeqInput, num_pending: int = 0, for_draft: bool = False) -> SamplingRow:
        """num_pending: output tokens in flight (on the device, not in seq.output_token_ids)."""
        bitmask = None if for_draft else self.grammar_bitmasks(seq, [])
        if bitmask is not None and num_pending:
            raise RuntimeError("a sequence with structured outputs has a token in flight: its grammar cannot "
                               "follow it (steps with such sequences are read before the next is scheduled).")
        return SamplingRow(seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids, self.generator_for(seq),
                           num_pending, None if bitmask is None else bitmask[0])

    def rows_metadata(self, seqs: list[SeqInput], for_draft: bool = False) -> SamplingMetadata:
        """Sampling metadata of one row per sequence, nothing in flight."""
        return SamplingMetadata.build([self.sampling_row(s, for_draft=for_draft) for s in seqs], self.vocab_size,
                                      self.device, for_draft)

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        return self.launch(req).result()

    @torch.inference_mode()
    def launch(self, req: ExecuteModelRequest, on_pass: Callable[[], None] | None = None) -> StepHandle:
        """Queue the step on the device; its tokens come to the host on the handle's result().
        `on_pass` is called once the inputs are prepared, as the model's pass is launched."""
        self.release(req.finished_seq_ids)
        if not req.seqs:
            return DoneStep(StepOutput([], []))
        span = DeviceSpan(self.device)
        cols = req.columns
        batch = self.runner.prepare(req.seqs, columns=cols)
        seq_ids = cols.seq_ids
        in_flight = self._fill_placeholders(batch, req.seqs, seq_ids)
        sampled = np.flatnonzero(cols.sample).tolist()
        if len(sampled) < len(req.seqs):
            seqs, seq_ids = [req.seqs[i] for i in sampled], [seq_ids[i] for i in sampled]
            ends = batch.last_rows[sampled]
        else:   # every sequence samples (decode): no per-row selection
            seqs, ends = req.seqs, batch.last_rows
        prompt_rows = PromptLogprobRows.of(req.seqs, batch.token_starts)
        if on_pass is not None:
            on_pass()
        if not sampled and not prompt_rows.rows:
            self.runner.write_kv(batch)
            return DoneStep(StepOutput([], []), one_token_per_seq=True)
        if prompt_rows.rows:
            rows = to_device(np.concatenate([ends, np.asarray(prompt_rows.rows, dtype=np.int64)]), self.device)
        else:   # one token per sequence, every one sampled (decode): the logits of every row, no index
            rows = None if batch.uniform_q == 1 and len(ends) == len(req.seqs) else to_device(ends, self.device)
        all_logits = self.runner.run(batch, rows)
        out = None
        if sampled:
            md = self._sampling_metadata(seqs, seq_ids, sampled, in_flight)
            if in_flight is not None and md.penalties is not None:
                row_of = {i: r for r, i in enumerate(sampled)}
                md.penalties.add_tokens(to_device([row_of[i] for i in in_flight[0]], self.device), in_flight[1])
            out = self.sampler(all_logits if len(all_logits) == len(ends) else all_logits[: len(ends)], md)
        copy = HostCopy(out.sampled, timed=True) if out is not None else None
        span.end(copy)
        prompt_logits = all_logits[len(ends):] if prompt_rows.rows else None
        handle = SampledStep(seqs, seq_ids, out, copy, prompt_rows, prompt_logits, req.seqs, span)
        if sampled:
            self._last = handle
            if md.needs_host_tokens:   # the next step's bans or masks need this step's tokens: no overlap
                handle.one_token_per_seq = False
        return handle

    def _sampling_metadata(self, seqs: list[SeqInput], seq_ids: list[int], sampled: list[int],
                           in_flight: tuple[list[int], torch.Tensor] | None) -> SamplingMetadata:
        """The sampled rows' metadata: the last step's when the same sequences sample again and it
        does not follow their tokens (a steady decode batch builds it once, not every step)."""
        def build() -> SamplingMetadata:
            pending = {} if in_flight is None else dict.fromkeys(in_flight[0], 1)
            rows = [self.sampling_row(s, pending.get(i, 0)) for i, s in zip(sampled, seqs)]
            return SamplingMetadata.build(rows, self.vocab_size, self.device)
        return self._reused_md.get(seq_ids, build)

    def resolve_placeholders(self, req: ExecuteModelRequest) -> ExecuteModelRequest:
        """The request with every in-flight token replaced by its value (waits for the step that samples it)."""
        if not any(s.token_ids[-1] == PLACEHOLDER_TOKEN for s in req.seqs):
            return req
        last = self._last_sampled()
        seqs = []
        for s in req.seqs:
            if s.token_ids[-1] == PLACEHOLDER_TOKEN:
                token = last.token_of(s.seq_id)
                s = replace(s, token_ids=s.token_ids[:-1] + [token], output_token_ids=s.output_token_ids + [token])
            seqs.append(s)
        return replace(req, seqs=seqs)

    def _last_sampled(self) -> "SampledStep":
        if self._last is None:
            raise RuntimeError("a step feeds a token in flight, but no earlier step sampled one.")
        return self._last

    def _fill_placeholders(self, batch: PreparedBatch, seqs: list[SeqInput], seq_ids: list[int]
                           ) -> tuple[list[int], torch.Tensor] | None:
        """Copy, on the device, the tokens the previous step sampled into this step's input rows.

        Returns the indices of the sequences fed such a token and the tokens (on the device: the
        penalties count them), or None when there are none.
        """
        ph = np.flatnonzero(batch.host_tokens[batch.last_rows] == PLACEHOLDER_TOKEN).tolist()
        if not ph:
            return None
        last = self._last_sampled()
        if len(ph) == len(seqs) and seq_ids == last.seq_ids:   # a steady decode batch: row for row
            if batch.uniform_q == 1:   # one row per sequence: the sampled tokens are the input, in order
                batch.input_ids.copy_(last.sampled)
                return ph, last.sampled
            dst, src = batch.last_rows, np.arange(len(seqs))
        else:
            dst = batch.last_rows[ph]
            src = np.asarray([last.row_of(seq_ids[i]) for i in ph], dtype=np.int64)
        dst_t, src_t = to_device_aligned([dst, src], self.device)
        tokens = last.sampled[src_t]
        batch.input_ids[dst_t] = tokens
        return ph, tokens


class SampledStep(StepHandle):
    """A plain step's handle: one token per sampled sequence, copied to the host without waiting."""

    one_token_per_seq = True

    def __init__(self, seqs: list[SeqInput], seq_ids: list[int], out: SamplerOutput | None, copy: HostCopy | None,
                 prompt_rows: "PromptLogprobRows", prompt_logits: torch.Tensor | None, chunk_seqs: list[SeqInput],
                 span: DeviceSpan):
        """copy: the sampled tokens' copy to the host (None when nothing was sampled)."""
        self.seqs, self.seq_ids, self._out, self._span = seqs, seq_ids, out, span
        self._prompt_rows, self._prompt_logits, self._chunk_seqs = prompt_rows, prompt_logits, chunk_seqs
        self.sampled = out.sampled if out is not None else None
        self._copy = copy
        self._rows: dict[int, int] | None = None
        self._output: StepOutput | None = None

    def row_of(self, seq_id: int) -> int:
        if self._rows is None:
            self._rows = {sid: r for r, sid in enumerate(self.seq_ids)}
        return self._rows[seq_id]

    def token_of(self, seq_id: int) -> int:
        return self._copy.values()[self.row_of(seq_id)]

    def result(self) -> StepOutput:
        if self._output is not None:
            return self._output
        prompt_logprobs = self._prompt_rows.results(self._prompt_logits, self._chunk_seqs)
        seq_ids, token_ids, logprobs, wait = [], [], None, 0.0
        if self._out is not None:
            seq_ids, tokens, wait = self.seq_ids, self._copy.values(), self._copy.wait_time
            token_ids = [[t] for t in tokens]
            if self._out.logprobs is not None:   # some row asked for logprobs (not the common case)
                dicts = logprob_dicts(self._out, [s.sampling_params.logprobs for s in self.seqs])
                logprobs = [None if lp is None else [lp] for lp in dicts]
        self._output = StepOutput(seq_ids, token_ids, logprobs, device_wait_time=wait,
                                  prompt_logprobs=prompt_logprobs, device_time=self._span.seconds())
        # Kept as the source of in-flight tokens: nothing but the tokens themselves.
        self._out = self._prompt_logits = self._chunk_seqs = None
        return self._output


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

"""vLLM's AsyncLLM coroutines beyond generate and abort, on top of the engine loop: beam search (one-token
requests through generate), the engine's configuration and health, and the operations that run in the engine
thread between steps (prefix-cache reset, profiling, statistics lines)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from vllm_spec.beam_search import one_token_params, search_async
from vllm_spec.engine.async_stream import EngineDeadError, not_aborted
from vllm_spec.engine.request_input import check_neutral
from vllm_spec.inputs import PromptType
from vllm_spec.outputs import RequestOutput
from vllm_spec.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from vllm_spec.engine.llm_engine import LLMEngine


class EngineOperations:
    """Mixed into AsyncLLMEngine, whose engine, engine thread, generate() and state these use."""

    engine: LLMEngine
    _executor: concurrent.futures.ThreadPoolExecutor
    _dead_error: BaseException | None
    _closing: bool
    is_stopped: bool

    async def beam_search(self, prompt: PromptType, request_id: str, params: BeamSearchParams,
                          lora_request: None = None) -> AsyncIterator[RequestOutput]:
        """vLLM's: the prompt's beam_width best beams as one finished RequestOutput, a completion per
        beam (vllm_spec.beam_search); its one-token steps are requests `<request_id>-<n>`."""
        check_neutral(lora_request=lora_request)
        first = await self._last_output(prompt, f"{request_id}-0",
                                        one_token_params(params, self.engine.config.model.max_logprobs))
        yield await self.continue_beam_search(first, request_id, params)

    async def continue_beam_search(self, first: RequestOutput, request_id: str,
                                   params: BeamSearchParams) -> RequestOutput:
        """A beam search from its first step's output (the server adds first steps as it adds other
        requests, so a bad prompt is refused before any answer starts)."""
        engine = self.engine
        one_token = one_token_params(params, engine.config.model.max_logprobs)
        return await search_async(functools.partial(self._last_output, params=one_token), first, request_id, params,
                                  engine.output_processor.eos_token_ids, engine.config.model.max_model_len,
                                  engine.tokenizer)

    async def _last_output(self, prompt: PromptType, request_id: str, params: SamplingParams) -> RequestOutput:
        async for out in self.generate(prompt, params, request_id):
            last = out
        return not_aborted(last)   # (a beam's step aborted: the search cannot go on)

    async def get_model_config(self):
        """The target's ModelConfig (vLLM's coroutine)."""
        return self.engine.get_model_config()

    async def get_vllm_config(self):
        """The engine's configuration (vLLM's coroutine)."""
        return self.engine.vllm_config

    async def get_tokenizer(self):
        """The tokenizer (vLLM's coroutine); None with skip_tokenizer_init."""
        return self.engine.get_tokenizer()

    async def do_log_stats(self, scheduler_outputs: None = None, model_output: None = None) -> None:
        """vLLM's: log the statistics lines now (in the engine thread, between steps)."""
        await self._in_engine_thread(self.engine.do_log_stats)

    async def check_health(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead_error}") from self._dead_error
        if self._closing:
            raise EngineDeadError("the engine is shutting down.")

    async def start_profile(self) -> None:
        """vLLM's: start a torch profiler trace of this process (in the engine thread, between steps)."""
        await self._in_engine_thread(self.engine.start_profile)

    async def stop_profile(self) -> None:
        """Stop the trace and write it to $VLLM_TORCH_PROFILER_DIR."""
        await self._in_engine_thread(self.engine.stop_profile)

    async def _in_engine_thread(self, call: Callable[[], Any]) -> Any:
        # The engine thread runs one call at a time: this one runs between two steps.
        if self.is_stopped:
            raise EngineDeadError("the engine is shut down.") from self._dead_error
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def reset_prefix_cache(self, device: object = None, reset_running_requests: bool = False) -> bool:
        """As vLLM's: forget the prefix cache's registrations (in the engine thread, between steps)."""
        return await self._in_engine_thread(functools.partial(self.engine.reset_prefix_cache, device,
                                                              reset_running_requests))

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's: LLMEngine.collective_rpc in the engine thread, between steps."""
        return await self._in_engine_thread(functools.partial(self.engine.collective_rpc, method, timeout, args,
                                                              kwargs))

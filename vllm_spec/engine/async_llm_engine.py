"""AsyncLLMEngine: an asyncio front for LLMEngine with per-request output streams.

One background task owns the engine. The engine's work (add/abort, step) is blocking CPU/GPU code,
so each loop iteration runs in a single dedicated worker thread; the engine is never touched from
any other thread. Callers only enqueue additions and aborts; the loop applies them between steps.

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=...))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
        print(out.outputs[0].text)   # the full text so far
    await engine.shutdown()

Errors: a bad request (SamplingParams/prompt/length) raises ValueError from generate()
to its caller only. An exception inside step() fails every in-flight request with that
exception (their streams raise EngineStepError chained to it), the engine state of those
requests is cleaned up, and the loop goes on serving new requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable

from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.engine.async_engine_ops import EngineOperations
from vllm_spec.engine.async_iteration import IterationResult, PendingAdd, run_iteration, settle
from vllm_spec.engine.async_stream import AsyncStream, EngineDeadError, EngineStepError, RequestAbortedError
from vllm_spec.engine.llm_engine import LLMEngine
from vllm_spec.engine.request_input import check_request_id, check_request_options
from vllm_spec.inputs import PromptType
from vllm_spec.metrics import Metric
from vllm_spec.outputs import RequestOutput
from vllm_spec.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine(EngineOperations):
    """Serves concurrent async callers from one LLMEngine driven by one background task."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._streams: dict[str, AsyncStream] = {}
        # Aborted streams waiting for their last output (their ids are free for new requests meanwhile).
        self._aborting: dict[str, AsyncStream] = {}
        self._pending_adds: list[PendingAdd] = []
        self._pending_aborts: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._closing = False
        self._dead_error: BaseException | None = None
        self._lock = threading.Lock()
        # Read by get_metrics(); refreshed by the engine thread after every iteration.
        self._metrics: list[Metric] = engine.get_metrics()
        self._num_free_blocks = engine.block_manager.num_free_blocks
        self.num_step_errors = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, start_engine_loop: bool = True, usage_context: object = None,
                         stat_loggers: dict | None = None) -> AsyncLLMEngine:
        """As vLLM's (the loop starts with the first request, in the caller's event loop, either way)."""
        return cls(LLMEngine.from_engine_args(args, usage_context, stat_loggers))

    # Properties -------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def vllm_config(self):
        return self.engine.vllm_config

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        """vLLM's: the engine serves (its loop starts with the first request); False once shut down or dead."""
        return not self.is_stopped

    @property
    def errored(self) -> bool:
        """vLLM's: dead or shut down."""
        return self.is_stopped

    @property
    def _loop_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def is_stopped(self) -> bool:
        return self._closing or self._dead_error is not None

    @property
    def num_free_blocks(self) -> int:
        return self._num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.engine.block_manager.num_usable_blocks

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # Loop -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background loop on the running event loop (generate() calls it too)."""
        if self.is_stopped:
            raise EngineDeadError("the engine is shut down.") from self._dead_error
        if self._loop_running:
            loop = asyncio.get_running_loop()
            if self._loop is not loop:
                raise RuntimeError("AsyncLLMEngine is running on another event loop.")
            return
        # (Again after an event loop it ran on stopped, as vLLM's: asyncio.run() per call.)
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wakeup = asyncio.Event()
        self._task = loop.create_task(self._run_loop(), name="AsyncLLMEngine.loop")
        self._task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        if task.cancelled() and not self._closing:
            # Its event loop stopped (asyncio.run() returning cancels what is left), not the engine:
            # the requests of that loop end, the engine drops them, and the next generate() starts
            # the loop again on its own event loop.
            stopped = EngineDeadError("the event loop running the engine stopped.")
            ids = list(self._streams)
            self._fail_all(stopped)
            self._pending_aborts.update(ids)
            return
        if task.cancelled():
            err: BaseException = EngineDeadError("the engine loop was cancelled.")
        elif task.exception() is not None:
            err = task.exception()
            logger.error("engine loop died", exc_info=err)
        else:
            return
        self._dead_error = err
        self._fail_all(EngineDeadError(f"the engine loop stopped: {err}"), err)

    def _fail_all(self, exc: BaseException, cause: BaseException | None = None) -> None:
        exc.__cause__ = cause
        for p in self._pending_adds:
            if not p.future.done():
                p.future.set_exception(exc)
        self._pending_adds.clear()
        for stream in [*self._streams.values(), *self._aborting.values()]:
            stream.finish(exc)
        self._streams.clear()
        self._aborting.clear()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending_adds and not self._pending_aborts and not self._streams and not self._aborting:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, set()
            try:
                result = await loop.run_in_executor(self._executor, self._iteration, loop, adds, aborts)
            except BaseException:
                # Not a step error (those come back in the result): the thread call itself failed.
                # The adds are resolved by the thread; make sure none is left hanging.
                for p in adds:
                    if not p.future.done():
                        p.future.set_exception(EngineDeadError("the engine loop stopped."))
                raise
            self._dispatch(result)
            # Let request handlers run between steps; back off a little when nothing moved
            # (e.g. requests waiting for KV blocks), so an idle wait does not spin a core.
            idle = not (adds or aborts or result.outputs or result.step_error or result.in_flight)
            await asyncio.sleep(0.002 if idle else 0)

    def _iteration(self, loop: asyncio.AbstractEventLoop, adds: list[PendingAdd],
                   aborts: set[str]) -> IterationResult:
        """Runs in the engine thread: apply queued adds and aborts, then one step."""
        result = run_iteration(self.engine, loop, adds, aborts)
        self._refresh_metrics()
        return result

    def _refresh_metrics(self) -> None:
        try:
            metrics = self.engine.get_metrics()
        except Exception:
            logger.exception("get_metrics failed")
            return
        with self._lock:
            self._metrics = metrics
            self._num_free_blocks = self.engine.block_manager.num_free_blocks

    def _dispatch(self, result: IterationResult) -> None:
        for out in result.aborted:
            stream = self._aborting.pop(out.request_id, None)
            if stream is not None:
                stream.put(out)
                stream.finish()
        for rid in list(self._aborting):
            if rid not in self._pending_aborts:   # applied, and the engine had nothing of it (finished meanwhile)
                self._aborting.pop(rid).finish(RequestAbortedError(f"request {rid!r} was aborted."))
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.put(out)
            if out.finished:
                stream.finish()
                del self._streams[out.request_id]
        if result.step_error is not None:
            self.num_step_errors += 1
            err = result.step_error
            for rid in result.failed_ids:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    exc = EngineStepError(f"engine step failed: {type(err).__name__}: {err}")
                    exc.__cause__ = err
                    stream.finish(exc)

    # Public API -------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                          arrival_time: float | None = None, lora_request: None = None,
                          tokenization_kwargs: dict | None = None, trace_headers: dict | None = None,
                          priority: int = 0) -> AsyncStream:
        """Queue a request; returns its stream once the engine has accepted it (the options as
        LLMEngine.add_request's).

        Raises ValueError (a bad request; TypeError: a request_id not a string), EngineDeadError (shut down)."""
        if self.is_stopped:
            raise EngineDeadError("the engine is shut down; no new requests.") from self._dead_error
        self.start()
        check_request_id(request_id)
        check_request_options(self.engine.config.scheduler.policy, lora_request, tokenization_kwargs, trace_headers,
                              priority)
        if request_id in self._streams or any(p.request_id == request_id for p in self._pending_adds):
            raise ValueError(f"request_id {request_id!r} is already in use.")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        stream = AsyncStream(request_id, coalesce=params.output_kind is not RequestOutputKind.DELTA)
        self._streams[request_id] = stream
        fut = self._loop.create_future()
        self._pending_adds.append(PendingAdd(request_id, prompt, params, fut,
                                              time.time() if arrival_time is None else arrival_time, priority))
        self._wakeup.set()
        try:
            await fut
        except BaseException as e:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            stream.finish()
            if isinstance(e, asyncio.CancelledError):
                # The caller went away while we were adding: make sure the engine drops it.
                self._abort_in_engine(request_id)
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str,
                       lora_request: None = None, trace_headers: dict | None = None,
                       priority: int = 0, data_parallel_rank: int | None = None,
                       tokenization_kwargs: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the RequestOutputs of one request (by default each carries the full output so far;
        data_parallel_rank: vLLM's, None or 0 only: one engine).

        Leaving the loop early (break, cancellation, client disconnect) aborts the request
        and frees its KV blocks before the next engine step."""
        if data_parallel_rank not in (None, 0):
            raise ValueError(f"data_parallel_rank must be None or 0 (one engine), got {data_parallel_rank!r}.")
        stream = await self.add_request(request_id, prompt, sampling_params, lora_request=lora_request,
                                        tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers,
                                        priority=priority)
        finished = False
        try:
            async for out in stream:
                if out.finished:
                    finished = True
                yield out
            finished = True
        except (EngineStepError, EngineDeadError, RequestAbortedError):
            finished = True  # nothing left to abort in the engine
            raise
        finally:
            if not finished:
                self.abort_nowait(request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort request(s), as vLLM's (awaited): see abort_nowait."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str | list[str]) -> None:
        """Abort request(s), as vLLM's: a running request's stream ends with a last output, finished,
        its unfinished completions' finish_reason "abort" (what they generated so far, or for DELTA
        what is new); one still being added raises RequestAbortedError to its caller. KV blocks are
        freed before the next step. Unknown or finished ids are ignored. Safe from the event loop only."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            error = RequestAbortedError(f"request {rid!r} was aborted.")
            stream = self._streams.pop(rid, None)
            if stream is not None:
                if self._loop_running and not any(p.request_id == rid for p in self._pending_adds):
                    self._aborting[rid] = stream   # the loop delivers its last output
                else:
                    stream.finish(error)
            self._abort_in_engine(rid, error)

    def _abort_in_engine(self, request_id: str, error: BaseException | None = None) -> None:
        # A queued add that has not run yet is dropped: its caller gets `error` (none: the caller
        # itself went away).
        for p in self._pending_adds:
            if p.request_id == request_id:
                self._pending_adds.remove(p)
                if error is not None:
                    settle(p.future, error)
                return
        if self._wakeup is not None and (self._loop_running or self._closing):
            self._pending_aborts.add(request_id)
            self._wakeup.set()

    async def get_metrics(self) -> list[Metric]:
        """The engine's metrics as of the end of the last loop iteration."""
        with self._lock:
            return list(self._metrics)

    def get_metrics_nowait(self) -> tuple[list[Metric], int]:
        """(metrics, free KV blocks) as of the end of the last loop iteration."""
        with self._lock:
            return list(self._metrics), self._num_free_blocks

    def shutdown(self, timeout: float | None = 30.0) -> Awaitable[None]:
        """Refuse new requests, abort the in-flight ones, stop the loop and release the engine thread;
        idempotent. Called as vLLM's (synchronously) or awaited: on the engine's running event loop
        the loop first applies the aborts (awaiting the result waits for that; timeout: for how long),
        elsewhere (no loop running) it is all done before returning."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop and self._loop is not None and self._loop.is_running():
            # Called from another thread than the engine's loop: the shutdown runs there, waited for here.
            asyncio.run_coroutine_threadsafe(self._shutdown_on_loop(timeout), self._loop).result()
            return _Done()
        if running is None or running is not self._loop:
            self.shutdown_background_loop()
            return _Done()
        if self._closing and not self._loop_running:
            # The loop is over, but a step it left (a cancelled loop) may still run in the engine thread:
            # the engine is shut down once that thread is done, without blocking the event loop.
            return running.create_task(self._release(running.run_in_executor(None, self._executor.shutdown, True)))
        self._closing = True
        for p in self._pending_adds:
            settle(p.future, EngineDeadError("the engine is shutting down."))
        self._pending_adds.clear()
        if self._streams:
            self.abort_nowait(list(self._streams))
        return running.create_task(self._release(self._stopped_loop(timeout)))

    async def _shutdown_on_loop(self, timeout: float | None) -> None:
        await self.shutdown(timeout)

    async def _stopped_loop(self, timeout: float | None) -> None:
        """Once the loop has applied the aborts and stopped (cancelled after timeout seconds), the
        engine thread's last work is done."""
        if self._task is not None and not self._task.done():
            self._wakeup.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                logger.warning("engine loop did not stop within %s s; cancelling it", timeout)
                self._task.cancel()
            except Exception:
                logger.debug("engine loop ended with an error (logged when it died)")
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    async def _release(self, stopped: Awaitable[None]) -> None:
        try:
            await stopped
        finally:   # (also where the event loop ends first, cancelling a shutdown nobody awaited)
            self._executor.shutdown(wait=True)
            self.engine.shutdown()   # its workers (tensor-parallel ranks) and their memory

    def shutdown_background_loop(self) -> None:
        """Synchronous shutdown for callers outside the engine's event loop (after it stopped)."""
        self._closing = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._executor.shutdown(wait=True)
        self.engine.shutdown()


class _Done:
    """An awaitable that is already done (a shutdown completed synchronously)."""

    def __await__(self):
        return
        yield


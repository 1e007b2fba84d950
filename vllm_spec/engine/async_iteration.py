"""The engine thread's side of AsyncLLMEngine: each iteration applies the queued additions and aborts, then
runs one step; every outcome is handed back to the event loop, never raised in the thread."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from vllm_spec.engine.llm_engine import LLMEngine
from vllm_spec.inputs import PromptType
from vllm_spec.outputs import RequestOutput
from vllm_spec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PendingAdd:
    """A caller's add_request, queued for the engine thread."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    future: asyncio.Future
    arrival_time: float
    priority: int


@dataclass
class IterationResult:
    """What one engine-thread iteration gives the event loop to dispatch."""

    outputs: list[RequestOutput] = field(default_factory=list)
    # The aborted requests' last outputs (their streams are no longer under their ids: one may be reused).
    aborted: list[RequestOutput] = field(default_factory=list)
    step_error: BaseException | None = None
    failed_ids: list[str] = field(default_factory=list)
    in_flight: bool = False   # a step was left running (async scheduling): step again at once


def run_iteration(engine: LLMEngine, loop: asyncio.AbstractEventLoop, adds: list[PendingAdd],
                  aborts: set[str]) -> IterationResult:
    """In the engine thread: apply queued adds and aborts, then one step. Each add's outcome goes to its
    caller's future; a failed step fails (and aborts) every request in the engine, reported in the result,
    not raised."""
    result = IterationResult()
    if aborts:   # first: an aborted request's id may come back in this iteration's adds
        result.aborted = engine.abort_with_outputs(list(aborts))
    for p in adds:
        if p.future.cancelled():
            continue
        try:
            engine.add_request(p.request_id, p.prompt, p.params, arrival_time=p.arrival_time, priority=p.priority)
        except BaseException as e:  # noqa: BLE001 - handed to that caller only
            loop.call_soon_threadsafe(settle, p.future, e)
        else:
            loop.call_soon_threadsafe(settle, p.future, None)
    if engine.has_unfinished_requests() or engine.has_step_in_flight:
        try:
            result.outputs = engine.step()
            result.in_flight = engine.has_step_in_flight
        except Exception as e:
            logger.exception("engine step failed; failing %d in-flight request(s)", len(engine.requests))
            result.step_error = e
            result.failed_ids = list(engine.requests)
            try:
                engine.abort_request(result.failed_ids)
            except Exception:
                logger.exception("cleaning up after the failed step failed too")
    return result


def settle(fut: asyncio.Future, error: BaseException | None) -> None:
    """An addition's outcome for its caller (unless it stopped waiting)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)

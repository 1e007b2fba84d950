"""The per-request output stream of AsyncLLMEngine, and the errors a stream can end with."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from vllm_spec.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop is shut down (or died) and accepts no more requests."""


class EngineStepError(RuntimeError):
    """An engine step failed; every request that was in flight at that time fails with it."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (by abort() or shutdown()) before it finished."""


def not_aborted(out: RequestOutput) -> RequestOutput:
    """The output, or RequestAbortedError where it is an aborted request's last one (for callers that need
    the request's whole answer, not what it had when aborted)."""
    if out.finished and any(c.finish_reason == "abort" for c in out.outputs):
        raise RequestAbortedError(f"request {out.request_id!r} was aborted.")
    return out


_FINISHED = object()  # end-of-stream marker


class AsyncStream:
    """The outputs of one request, consumed with `async for`.

    Cumulative outputs carry the full text/token_ids so far, so when the consumer is slower
    than the engine the stream yields only the newest one (nothing is lost). Delta outputs
    (RequestOutputKind.DELTA) are each yielded: `coalesce=False`."""

    def __init__(self, request_id: str, coalesce: bool = True):
        self.request_id = request_id
        self.coalesce = coalesce
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if not self.finished:
            self._queue.put_nowait(item)

    def finish(self, exc: BaseException | None = None) -> None:
        if not self.finished:
            if exc is not None:
                self._queue.put_nowait(exc)
            self._queue.put_nowait(_FINISHED)
            self.finished = True

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            # Coalesce: keep only the newest output among those already queued.
            while self.coalesce and isinstance(item, RequestOutput) and not self._queue.empty():
                nxt = self._queue.get_nowait()
                if not isinstance(nxt, RequestOutput):
                    yield item
                    item = nxt
                    break
                item = nxt
            if item is _FINISHED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

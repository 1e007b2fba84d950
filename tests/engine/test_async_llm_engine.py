"""AsyncLLMEngine as vLLM users call it: the package's names, awaited abort, the config and tokenizer
coroutines, aborts of requests still being added, ids reused after an abort, and an engine used from
one event loop after another (asyncio.run per call)."""

from __future__ import annotations

import asyncio

import pytest

from vllm_spec import AsyncEngineArgs, AsyncLLMEngine, RequestOutputKind, SamplingParams
from vllm_spec.engine.async_stream import EngineDeadError, RequestAbortedError

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama):
    # (vLLM's signature: start_engine_loop second; the loop starts with the first request either way.)
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24),
                                           False, usage_context="ENGINE_CONTEXT")


async def _text(engine: AsyncLLMEngine, request_id: str, params: SamplingParams = SHORT) -> list[int]:
    last = None
    async for out in engine.generate("hello world", params, request_id):
        last = out
    return last.outputs[0].token_ids


def test_config_tokenizer_and_an_awaited_abort(engine):
    async def main():
        try:
            assert (await engine.get_model_config()).max_model_len == engine.config.model.max_model_len
            assert engine.model_config is engine.config.model and engine.vllm_config is engine.config
            assert await engine.get_tokenizer() is engine.tokenizer
            seen = []
            async for out in engine.generate("hello world", LONG, "x"):
                seen.append(out)
                if len(seen) == 2:
                    await engine.abort("x")
            # As vLLM's: the stream ends with a last output, finished "abort" (DELTA: what is new since).
            last = seen[-1]
            assert last.finished and last.outputs[0].finish_reason == "abort"
            assert all(not o.finished for o in seen[:-1]) and len(seen) >= 3
            # The id is free again at once: its abort is applied before the new request is added.
            assert len(await _text(engine, "x")) == 6
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120.0))


def test_aborting_or_shutting_down_while_a_request_is_added_raises_the_engines_errors(engine):
    """A request aborted (or the engine shut down) before the engine accepted it ends with the
    engine's documented errors, never a cancellation of a task nobody cancelled."""
    async def main():
        task = asyncio.ensure_future(_text(engine, "a", LONG))
        await asyncio.sleep(0)   # generate() is waiting for the engine to accept "a"
        await engine.abort("a")
        with pytest.raises(RequestAbortedError):
            await task
        assert not task.cancelled()
        task = asyncio.ensure_future(_text(engine, "b", LONG))
        await asyncio.sleep(0)
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await task
        await engine.shutdown()   # idempotent

    asyncio.run(asyncio.wait_for(main(), 120.0))


def test_one_engine_serves_one_event_loop_after_another(engine):
    """As vLLM's: asyncio.run() per call; a request cut off when its loop stopped ends there, and the
    engine drops it."""
    async def cut_off():
        async for _ in engine.generate("hello world", LONG, "cut"):
            return   # leaves the request running as the loop ends

    try:
        assert engine.is_running and not engine.errored   # (vLLM's: serving before any request)
        first = asyncio.run(asyncio.wait_for(_text(engine, "1"), 120.0))
        asyncio.run(cut_off())
        assert not engine.errored
        second = asyncio.run(asyncio.wait_for(_text(engine, "2"), 120.0))
        assert first == second and len(first) == 6
        assert engine.engine.get_num_unfinished_requests() == 0   # "cut" was dropped
    finally:
        engine.shutdown()   # as vLLM's: synchronous outside the event loop
    assert engine.errored and not engine.is_running


def test_vllms_request_options_and_ids(engine):
    """generate/add_request take vLLM's lora_request, trace_headers and priority at their neutral values
    (others name the option), an arrival time, and string request ids only (TypeError, as vLLM's)."""
    async def main():
        try:
            out = None
            async for out in engine.generate("hello world", SHORT, "a", lora_request=None, trace_headers=None,
                                             priority=0, data_parallel_rank=None, tokenization_kwargs=None):
                pass
            assert len(out.outputs[0].token_ids) == 6
            for kwargs, field in ((dict(priority=2), "priority"), (dict(lora_request="x"), "lora_request"),
                                  (dict(trace_headers={"a": "b"}), "trace_headers"),
                                  (dict(data_parallel_rank=1), "data_parallel_rank")):
                with pytest.raises(ValueError, match=field):
                    async for _ in engine.generate("hello world", SHORT, "b", **kwargs):
                        pass
            with pytest.raises(TypeError, match="request_id must be a string"):
                await engine.add_request(7, "hello world", SHORT)
            with pytest.raises(ValueError, match="tokenization_kwargs"):
                await engine.add_request("t", "hello world", SHORT, tokenization_kwargs={"truncation": True})
            with pytest.raises(ValueError, match="arrival_time"):
                await engine.add_request("c", "hello world", SHORT, arrival_time="soon")
            stream = await engine.add_request("d", "hello world", SHORT, arrival_time=0.0)
            async for out in stream:
                pass
            assert out.finished and engine.engine.get_num_unfinished_requests() == 0
            # vLLM's EngineClient methods.
            assert await engine.reset_prefix_cache() and await engine.reset_prefix_cache(reset_running_requests=True)
            assert (await engine.get_vllm_config()).model_config is engine.engine.model_config
            await engine.do_log_stats()
            assert await engine.collective_rpc(lambda worker, x: (type(worker).__name__, x), args=(3,)) == \
                [("Worker", 3)]
            with pytest.raises(ValueError, match="has no method 'nothing'"):
                await engine.collective_rpc("nothing")
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120.0))


def test_reset_prefix_cache_between_steps(tiny_llama):
    """As vLLM's AsyncLLM.reset_prefix_cache: awaited, applied in the engine thread while other
    requests run; later prompts compute every token again. Refused once the engine is shut down."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                             enable_prefix_caching=True))
    prompt = {"prompt_token_ids": list(range(5, 45))}

    async def cached(request_id: str) -> int:
        async for out in engine.generate(prompt, SHORT, request_id):
            pass
        return out.num_cached_tokens

    async def main():
        try:
            assert await cached("cold") == 0
            assert await cached("warm") > 0
            running = asyncio.ensure_future(_text(engine, "running", SamplingParams(max_tokens=200, ignore_eos=True)))
            await asyncio.sleep(0.05)
            assert await engine.reset_prefix_cache() is True
            assert await cached("after") == 0
            assert len(await running) == 200
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await engine.reset_prefix_cache()

    asyncio.run(asyncio.wait_for(main(), 120.0))


@pytest.mark.parametrize("kind", ["DELTA", "FINAL_ONLY"])
def test_an_aborted_stream_ends_with_its_final_output(engine, kind):
    """As vLLM's (test_abort_final_output): abort() ends a stream with one last output, finished with
    finish_reason "abort"; DELTA pieces still add up to what was generated, FINAL_ONLY gets just that one."""
    from vllm_spec.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind[kind])

    async def main():
        try:
            outs = []

            async def consume():
                async for out in engine.generate("hello world", params, "fin"):
                    outs.append(out)

            task = asyncio.ensure_future(consume())
            for _ in range(500):   # until a few steps ran
                await asyncio.sleep(0.005)
                if engine.engine.requests.get("fin") and engine.engine.requests["fin"].seqs[0].output_token_ids[3:]:
                    break
            await engine.abort("fin")
            await asyncio.wait_for(task, 60.0)
            last = outs[-1]
            assert last.finished and last.outputs[0].finish_reason == "abort"
            assert all(not o.finished for o in outs[:-1])
            if kind == "FINAL_ONLY":
                assert len(outs) == 1 and 3 < len(last.outputs[0].token_ids) < 400
            else:
                assert 3 < sum(len(o.outputs[0].token_ids) for o in outs) < 400
            assert engine.engine.get_num_unfinished_requests() == 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120.0))


def test_an_aborted_id_is_free_at_once_and_a_shutdown_nobody_awaits_still_happens(engine):
    """As vLLM's: an id is free again right after abort() (its old stream still gets its last output, the
    new request its own); shutdown() called on the engine's loop without awaiting it still shuts the engine
    down when that loop ends."""
    shut = []
    release = engine.engine.shutdown
    engine.engine.shutdown = lambda: (shut.append(1), release())

    async def main():
        old = aiter(await engine.add_request("a", "hello world", LONG))
        first = await anext(old)
        await engine.abort("a")
        new = await _text(engine, "a")   # no "already in use"
        rest = [out async for out in old]
        assert not first.finished and rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert len(new) == 6 and engine.engine.get_num_unfinished_requests() == 0
        engine.shutdown()   # vLLM's style: synchronous, not awaited

    asyncio.run(asyncio.wait_for(main(), 120.0))
    assert shut and engine.errored


def test_shutdown_from_another_thread_than_the_engines_loop(engine):
    """shutdown() from a thread other than the one running the engine's event loop runs the shutdown on
    that loop (the loop's streams end as on it) and returns once it is done."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        first = asyncio.run_coroutine_threadsafe(_text(engine, "t"), loop).result(120)
        long = asyncio.run_coroutine_threadsafe(_text(engine, "long", LONG), loop)
        for _ in range(400):   # until it runs
            if engine.engine.requests.get("long"):
                break
            threading.Event().wait(0.01)
        engine.shutdown()
        assert engine.errored and long.result(60) is not None and len(first) == 6
        assert engine.engine.get_num_unfinished_requests() == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

"""AsyncLLMEngine streams: cumulative outputs may be coalesced, delta outputs never are."""

from __future__ import annotations

import asyncio

from vllm_spec import EngineArgs, SamplingParams
from vllm_spec.engine.async_llm_engine import AsyncLLMEngine
from vllm_spec.sampling_params import RequestOutputKind


def test_delta_streams_lose_nothing_and_cumulative_streams_end_complete(tiny_llama):
    async def main():
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24))
        try:
            cumulative = [o async for o in engine.generate(
                "hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), "c")]
            await asyncio.sleep(0)
            deltas = []
            async for out in engine.generate(
                    "hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                  output_kind=RequestOutputKind.DELTA), "d"):
                deltas.append(out)
                await asyncio.sleep(0.01)   # a slow consumer: outputs queue up
        finally:
            await engine.shutdown()
        full = cumulative[-1].outputs[0]
        assert len(full.token_ids) == 16 and cumulative[-1].finished
        assert sum((d.outputs[0].token_ids for d in deltas), []) == full.token_ids
        assert "".join(d.outputs[0].text for d in deltas) == full.text

    asyncio.run(asyncio.wait_for(main(), 120.0))


def test_concurrent_streams_with_async_scheduling_match_the_synchronous_engine(tiny_llama):
    """The server's engine loop over an engine that overlaps its steps: concurrent streams, one of
    them aborted mid-way, give the texts the synchronous offline engine gives."""
    from vllm_spec import LLM

    prompts = ["hello world", "the quick brown fox", "a b c d e f", "lorem ipsum"]
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True,
                             output_kind=RequestOutputKind.DELTA) for i in range(len(prompts))]
    ref = LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24, async_scheduling=False).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True) for p in params],
        use_tqdm=False)

    async def main():
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 24,
                                                            async_scheduling=True))

        async def collect(i: int) -> str:
            return "".join([o.outputs[0].text async for o in engine.generate(prompts[i], params[i], f"r{i}")])

        async def aborted() -> int:
            n = 0
            async for _ in engine.generate("x y z", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                                                                     output_kind=RequestOutputKind.DELTA), "gone"):
                n += 1
                if n == 3:
                    await engine.abort("gone")
            return n

        try:
            texts = await asyncio.gather(*(collect(i) for i in range(len(prompts))), aborted(),
                                         return_exceptions=True)
            for _ in range(200):   # the engine thread applies the abort on its next iteration
                if engine.num_free_blocks == engine.num_usable_blocks and not engine.engine.has_step_in_flight:
                    break
                await asyncio.sleep(0.01)
            assert not engine.engine.has_step_in_flight
            assert engine.num_free_blocks == engine.num_usable_blocks
        finally:
            await engine.shutdown()
        return texts

    texts = asyncio.run(asyncio.wait_for(main(), 120.0))
    assert texts[: len(prompts)] == [r.outputs[0].text for r in ref]

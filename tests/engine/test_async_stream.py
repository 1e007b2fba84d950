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

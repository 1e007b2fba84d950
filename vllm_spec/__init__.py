"""vllm_spec: lossless speculative decoding on a paged-KV, continuous-batching engine."""

import os

# Idle OpenMP threads sleep instead of spinning: on a CPU shared with other processes, spinning
# threads make every multi-threaded step wait for a time slice (measured 5-10x slower steps).
# Set before torch loads its OpenMP runtime; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from vllm_spec.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm_spec.engine.async_llm_engine import AsyncLLMEngine
from vllm_spec.engine.llm_engine import LLMEngine
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.inputs import PromptType, TextPrompt, TokensPrompt
from vllm_spec.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_spec.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs", "SamplingParams",
           "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob", "PromptType", "TextPrompt",
           "TokensPrompt"]
__version__ = "0.1.0"

"""vllm_spec: lossless speculative decoding on a paged-KV, continuous-batching engine."""

from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.engine.llm_engine import LLMEngine
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_spec.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

"""The offline API: `LLM(model=...).generate(prompts, sampling_params)` as in vLLM."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from vllm_spec.beam_search import BeamSearchOutput, beam_search, one_token_params
from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.engine.llm_engine import LLMEngine
from vllm_spec.engine.request_input import check_neutral, check_priority
from vllm_spec.entrypoints.chat_utils import render_chat
from vllm_spec.inputs import PromptType
from vllm_spec.metrics import Metric
from vllm_spec.outputs import RequestOutput
from vllm_spec.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from vllm_spec.utils import is_int


class LLM:
    """Batch generation over an LLMEngine. Keyword arguments are EngineArgs fields (as vLLM's LLM,
    disable_log_stats defaults to True: no statistics lines)."""

    def __init__(self, model: str, tokenizer: str | None = None, **kwargs: Any):
        kwargs.setdefault("disable_log_stats", True)
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, tokenizer=tokenizer, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def model_config(self):
        """The target's ModelConfig (vLLM's name)."""
        return self.llm_engine.model_config

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: vLLM's defaults, with the fields the
        model's generation config sets (generation_config="auto"; "vllm" leaves vLLM's own)."""
        return SamplingParams(**self.llm_engine.config.model.sampling_defaults)

    def set_tokenizer(self, tokenizer) -> None:
        """Use this tokenizer for the requests that come next (text prompts, detokenization)."""
        engine = self.llm_engine
        engine.tokenizer = engine.output_processor.tokenizer = tokenizer
        engine.update_eos_token_ids()   # its EOS stops requests too

    def _not_generative(self, method: str):
        raise NotImplementedError(f"LLM.{method} is not supported: this engine serves generative (decoder) "
                                  "models; use generate() or chat().")

    def encode(self, *args: Any, **kwargs: Any):
        self._not_generative("encode")

    def embed(self, *args: Any, **kwargs: Any):
        self._not_generative("embed")

    def classify(self, *args: Any, **kwargs: Any):
        self._not_generative("classify")

    def score(self, *args: Any, **kwargs: Any):
        self._not_generative("score")

    def reward(self, *args: Any, **kwargs: Any):
        self._not_generative("reward")

    def beam_search(self, prompts: PromptType | SequenceABC[PromptType], params: BeamSearchParams,
                    lora_request: None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's: the beam_width best continuations of each prompt, best first (vllm_spec.beam_search);
        concurrency_limit: how many prompts are searched at once (all by default)."""
        check_neutral(lora_request=lora_request)
        one_token = one_token_params(params, self.llm_engine.config.model.max_logprobs)
        if concurrency_limit is not None and not (is_int(concurrency_limit) and concurrency_limit >= 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}.")
        prompt_list = _as_prompt_list(prompts)
        if not prompt_list:
            raise ValueError("prompts must not be empty.")
        limit = concurrency_limit or len(prompt_list)
        # Each step's beams repeat their prompt and all but their last token: the search reads them from
        # the prefix cache even where the engine keeps none (vLLM's is on by default), and forgets them after.
        blocks = self.llm_engine.block_manager
        caching, blocks.enable_caching = blocks.enable_caching, True
        try:
            results = self._beam_search(prompt_list, params, one_token, limit, use_tqdm)
        finally:
            if not caching:
                blocks.enable_caching = False
                blocks.reset_prefix_cache()
        tokenizer = self.get_tokenizer()
        for out in results:
            for beam in out.sequences:   # the prompt and the beam's tokens, as vLLM's
                beam.text = None if tokenizer is None else tokenizer.decode(beam.tokens)
        return results

    def _beam_search(self, prompt_list: list[PromptType], params: BeamSearchParams, one_token: SamplingParams,
                     limit: int, use_tqdm: bool) -> list[BeamSearchOutput]:
        eos = self.llm_engine.output_processor.eos_token_ids
        results: list[BeamSearchOutput] = []
        with tqdm(total=params.max_tokens * -(-len(prompt_list) // limit), desc="Beam search",
                  disable=not use_tqdm) as bar:
            for start in range(0, len(prompt_list), limit):
                first = self.generate(prompt_list[start: start + limit], one_token, use_tqdm=False)
                bar.update()
                search = beam_search(first, params, eos, self.llm_engine.config.model.max_model_len)
                steps = 1
                try:
                    beams = next(search)
                    while True:
                        outputs = self.generate([{"prompt_token_ids": t} for t in beams], one_token, use_tqdm=False)
                        bar.update()
                        steps += 1
                        beams = search.send(outputs)
                except StopIteration as finished:
                    results += finished.value
                bar.update(params.max_tokens - steps)   # the steps all beams ended before
        return results

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        priority: int | list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts; outputs come back in prompt order. priority: one per
        prompt or one for all, lower first (with scheduling_policy="priority"); lora_request: vLLM's,
        None only."""
        prompt_list = _as_prompt_list(prompts)
        if not prompt_list:
            raise ValueError("prompts must not be empty.")
        check_neutral(lora_request=lora_request)
        if priority is not None and not isinstance(priority, (list, tuple)):
            priority = [priority] * len(prompt_list)   # (as vLLM: one value for every prompt)
        if priority is not None:
            if len(priority) != len(prompt_list):
                raise ValueError(f"priority must be None or one per prompt ({len(prompt_list)}), got {len(priority)}.")
            policy = self.llm_engine.config.scheduler.policy
            for p in priority:
                check_priority(p, policy)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            if not isinstance(sampling_params, (list, tuple)) or not all(
                    isinstance(p, SamplingParams) for p in sampling_params):
                raise TypeError(f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                                f"got {type(sampling_params).__name__}.")
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompt_list)} prompts."
                )
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                rid = str(next(self._ids))
                # generate() returns finished requests only: no per-step outputs to build.
                engine.add_request(rid, prompt, _final_only(params), priority=0 if priority is None else priority[i])
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        # As vLLM's: use_tqdm may be the progress bar's factory (e.g. functools.partial(tqdm, desc=...)).
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.llm_engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: None = None,
        chat_template_content_format: str = "auto",
        tools: list[dict[str, Any]] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate.
        Message contents may be strings or OpenAI content parts (text parts only); tools are rendered by
        the chat template (the model's tool calls come back as its text, as vLLM's offline chat).
        (lora_request and mm_processor_kwargs: vLLM's, accepted at their neutral values.)"""
        check_neutral(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this LLM was built with skip_tokenizer_init=True.")
        if not isinstance(messages, list) or not messages:
            raise TypeError(f"messages must be a conversation (a non-empty list of message dicts) or a list of "
                            f"them, got {messages!r}.")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [render_chat(tokenizer, conv, add_generation_prompt, continue_final_message, chat_template, False,
                               chat_template_kwargs, tools, chat_template_content_format) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: `method` (a worker method's name, or a callable taking the worker first) on every
        tensor-parallel rank's worker; the results by rank."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func) -> list:
        """vLLM's: func(model) on every rank's (target) model; the results by rank."""
        return self.llm_engine.apply_model(func)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's registrations (vLLM's; True when done)."""
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's: start a torch profiler trace (to $VLLM_TORCH_PROFILER_DIR; vllm_spec.profiler)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop the trace and write it."""
        self.llm_engine.stop_profile()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    # (bytes iterate as ints, a set in no fixed order: neither is a prompt's token ids)
    if isinstance(prompts, (bytes, bytearray, set, frozenset)) or not (
            hasattr(prompts, "tolist") or isinstance(prompts, Iterable)):
        raise TypeError(f"prompts must be a string, a dict, token ids or a list of them, got {prompts!r}.")
    # numpy and torch arrays: a 1-D one is one prompt of token ids, a 2-D one a prompt per row.
    prompts = prompts.tolist() if hasattr(prompts, "tolist") else list(prompts)
    if not isinstance(prompts, list):
        raise ValueError(f"prompts must be a string, a dict, token ids or a list of them, got {prompts!r}.")
    if prompts and all(is_int(t) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _final_only(params):
    if not isinstance(params, SamplingParams):
        return params   # add_request names the bad type
    # A shallow copy keeps the caller's object unchanged; add_request deep-copies what it keeps.
    params = copy.copy(params)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params

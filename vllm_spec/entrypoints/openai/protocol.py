"""OpenAI-compatible request/response models (pydantic 2), with vLLM's extra sampling fields."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from functools import cached_property
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from vllm_spec.entrypoints.openai.structured_request import ConstraintError, structured_outputs_of
from vllm_spec.sampling_params import (
    DEFAULT_MAX_LOGPROBS,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from vllm_spec.utils import check_text


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored (as vLLM does), so newer clients keep working.
    model_config = ConfigDict(extra="ignore")


class StreamedModel(OpenAIBaseModel):
    """A stream chunk's part: the optional fields it names are left out where unset, as vLLM's chunks
    (serialised without unset fields: clients test whether a key is present)."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        data = handler(self)
        for name in self.omitted_when_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body: its text must be Unicode (a lone surrogate is valid JSON that tokenizers refuse)."""

    @field_validator("*", mode="after")
    @classmethod
    def _unicode_text(cls, value: Any, info: ValidationInfo) -> Any:
        check_text(info.field_name or "body", value)   # (a 400 naming the field)
        return value


# Errors --------------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class OpenAIServingError(Exception):
    """Raised by handlers; rendered as an OpenAI-style error body with the given HTTP status."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type
        self.param = param

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.err_type, param=self.param,
                                             code=self.status_code))


# Shared pieces ------------------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False   # (vLLM's default: stream_options {} asks for no usage chunk)
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None   # with --enable-prompt-tokens-details


MAX_N = 128

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_field_of(message: str) -> str | None:
    """The SamplingParams field a refusal's message starts with (SamplingParams' and the engine's
    checks name the field first, structured_outputs' as structured_outputs.<kind>), or None."""
    first = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
    return first if first in _SAMPLING_FIELDS else None

# vLLM's request extras that change what is generated and that this server does not implement, with
# the values that change nothing: set otherwise, they get a 400 naming them rather than an output that
# silently ignores them. Other unknown fields are ignored, as vLLM ignores them.
_UNSUPPORTED_EXTRAS: dict[str, Any] = {"logits_processors": None, "guided_whitespace_pattern": None,
                                        "prompt_embeds": None}


class SamplingFields(OpenAIRequestModel):
    """Sampling fields common to completions and chat (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="allow")   # kept, to be checked against _UNSUPPORTED_EXTRAS

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)   # (vLLM's: an int64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    # Strict: JSON true, "60" or 60.0 are refused as the offline API refuses them, not converted.
    logit_bias: dict[str, StrictInt | StrictFloat] | None = None
    allowed_token_ids: list[StrictInt] | None = None   # vLLM's extra
    bad_words: list[str] | None = None                 # vLLM's extra
    user: str | None = None
    response_format: Any = None
    structured_outputs: Any = None   # vLLM's extra: {"json" | "regex" | "choice" | "grammar" | ...: ...}
    truncate_prompt_tokens: int | None = None
    # vLLM's extension: free-form arguments passed to SamplingParams.extra_args.
    vllm_xargs: dict[str, str | int | float] | None = None
    priority: StrictInt = 0   # vLLM's: lower runs first, with --scheduling-policy priority
    # vLLM's: n beams (beam width n) instead of n samples; length_penalty scores them.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: the prompt's logprobs (each prompt token's and its top prompt_logprobs), not in streams.
    prompt_logprobs: int | None = None
    # vLLM's: logprobs name their tokens "token_id:<id>" (None: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the response carries the prompt's and each choice's token ids.
    return_token_ids: bool | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _n_null_is_one(cls, value: Any) -> Any:
        return 1 if value is None else value   # OpenAI's schema: nullable, default 1

    def _check_unsupported(self) -> None:
        if self.n > MAX_N:
            # A request's n sequences are built on the engine's thread: a huge n held up every other
            # request there (and its memory grew without bound).
            raise OpenAIServingError(f"n must be an integer in [1, {MAX_N}] (OpenAI's bound), got {self.n}.", param="n")
        extras = self.model_extra or {}
        for name, neutral in _UNSUPPORTED_EXTRAS.items():
            value = extras.get(name, neutral)
            if value not in (neutral, None, [], {}):
                raise OpenAIServingError(f"{name} is not supported by this server.", param=name)
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIServingError("best_of != n is not supported.", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise OpenAIServingError("stream_options can only be set when stream is true.",
                                     param="stream_options")
        if self.stream and self.prompt_logprobs is not None and (self.prompt_logprobs > 0
                                                                 or self.prompt_logprobs == -1):
            raise OpenAIServingError("prompt_logprobs are not available when stream is true.",
                                     param="prompt_logprobs")

    def beam_search_params(self, params: SamplingParams, max_model_len: int) -> BeamSearchParams | None:
        """vLLM's use_beam_search (None: not asked): beams of the request's n, max_tokens (else the
        context's end), temperature, ignore_eos and length_penalty; its other sampling fields do not
        apply, and a structured-output constraint is refused rather than ignored."""
        if not self.use_beam_search:
            return None
        if self.constraint is not None:
            raise OpenAIServingError(f"use_beam_search cannot be combined with {self.constraint[1]} (beam search "
                                     "does not enforce structured outputs).", param="use_beam_search")
        if self.prompt_logprobs is not None:   # (beam steps score no prompt)
            raise OpenAIServingError("use_beam_search cannot be combined with prompt_logprobs.", param="use_beam_search")
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=params.max_tokens or max_model_len,
                                    ignore_eos=params.ignore_eos, temperature=params.temperature,
                                    length_penalty=self.length_penalty,
                                    include_stop_str_in_output=params.include_stop_str_in_output)
        except ValueError as e:   # (what SamplingParams did not check: a non-finite length_penalty)
            raise OpenAIServingError(str(e), param=str(e).split(" ", 1)[0]) from e

    @cached_property
    def constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """The structured-output constraint the request sets (response_format, structured_outputs, vLLM's
        older guided_* fields, or what _forced_constraint forces) and the field it came in, if any. Built
        once per request: its sampling parameters and the server's compile check both read it."""
        try:
            return structured_outputs_of(self.response_format, self.structured_outputs, self.model_extra or {},
                                         self._forced_constraint())
        except ConstraintError as e:
            raise OpenAIServingError(str(e), param=e.param) from e

    def _forced_constraint(self) -> tuple[Callable[[], StructuredOutputsParams | None], str] | None:
        """A constraint another field forces (built on demand) and that field: none here."""
        return None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any],
                         sent_as: dict[str, str] | None = None, prompt_logprobs: int | None = None,
                         max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplingParams:
        """SamplingParams from the fields, those left unset from `defaults` (the model's generation
        config; max_tokens is the caller's); a ValueError names the request's field (sent_as maps a
        SamplingParams field to the request field it came from where the names differ)."""

        def given(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        kwargs: dict[str, Any] = dict(
            n=1 if self.use_beam_search else self.n,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=given("top_k", 0),
            min_p=given("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=given("repetition_penalty", 1.0),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            extra_args=self.vllm_xargs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=(self.constraint or (None,))[0],
            # As vLLM: a response sent whole needs no per-step output (building one per request per
            # step is host time the engine spends between launches); a stream rebuilds its deltas
            # from cumulative outputs.
            output_kind=RequestOutputKind.CUMULATIVE if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        try:
            params = SamplingParams(**kwargs)
            params.check_logprobs(max_logprobs)
            if self.use_beam_search:
                # n is the beams' width, choices per prompt (set after the check: greedy beams are not n
                # greedy samples, which SamplingParams refuses); the beams' steps ask for one token each.
                params.n = self.n
            return params
        except (ValueError, TypeError) as e:
            msg = str(e)
            param = "vllm_xargs" if msg.startswith("extra_args") else sampling_field_of(msg)
            if param in (sent_as or {}):
                msg = sent_as[param] + msg[len(param):]
                param = sent_as[param]
            raise OpenAIServingError(msg, param=param) from e


class LogprobInfo(OpenAIBaseModel):
    """One token's entry in a prompt's logprobs (vLLM's Logprob on the wire)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first: None, nothing predicts it): {token id: its entry}.
PromptLogprobs = list[dict[int, LogprobInfo] | None]


# /v1/models -----------------------------------------------------------------------------------------
class ModelPermission(OpenAIBaseModel):
    """What clients may do with a served model (OpenAI's legacy card field, as vLLM fills it)."""

    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"   # (vLLM's: clients filter on it)
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)

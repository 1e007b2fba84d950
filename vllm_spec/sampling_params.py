"""Sampling parameters for one request, with vLLM's names and semantics."""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from vllm_spec.structured_output.params import StructuredOutputsParams
from vllm_spec.utils import FLOAT32_MAX, check_text, is_int, is_number

logger = logging.getLogger(__name__)

# Temperatures below this are treated as greedy, as in vLLM.
SAMPLING_EPS = 1e-5
# Positive temperatures are raised to at least this (vLLM's: smaller ones overflow the scaled logits).
MIN_TEMPERATURE = 0.01
# Most logprobs / prompt_logprobs a request may ask for unless the engine's max_logprobs says otherwise
# (vLLM's default).
DEFAULT_MAX_LOGPROBS = 20
# vLLM's logprobs_mode: what logprobs hold (raw: the model's logits, processed: after the sampling
# parameters' processing, temperature and top-k/top-p included).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}.")


def _logit_bias(bias: object) -> dict[int, float] | None:
    """logit_bias with int keys and biases clamped to [-100, 100] (None when empty)."""
    if bias is None:
        return None
    allowed = "a dict of token id (an integer >= 0, or its string) -> bias (a number)"
    _check(isinstance(bias, dict), "logit_bias", allowed, bias)
    out = {}
    for token, value in bias.items():
        if isinstance(token, str):
            try:
                token = int(token)
            except ValueError:
                pass   # named below
        _check(is_int(token) and token >= 0 and is_number(value) and value == value, "logit_bias", allowed, bias)
        out[int(token)] = min(100.0, max(-100.0, float(value)))
    return out or None


class RequestOutputKind(enum.Enum):
    """What each engine step reports for a request (vLLM's names)."""

    CUMULATIVE = 0   # everything generated so far, every step
    DELTA = 1        # only what this step added
    FINAL_ONLY = 2   # nothing until the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion of one request.

    temperature 0 means greedy. top_k 0 or -1 disables top-k. The penalties
    follow vLLM: presence/frequency penalties count output tokens only,
    repetition_penalty counts prompt and output tokens.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Left truncation of the prompt to its last k tokens (vLLM's); None keeps it whole.
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Free-form arguments for custom sampling code (vLLM's extra_args), passed through untouched.
    # Recognised here: "synthetic_acceptance_rate" (benchmarks only), see synthetic_acceptance_rate.
    extra_args: dict | None = None
    # Token id -> bias added to its logit before penalties and temperature (vLLM's; OpenAI's bound:
    # each bias clamped to [-100, 100]; string keys, as JSON sends them, are converted).
    logit_bias: dict[int, float] | None = None
    # Sample only among these token ids (vLLM's); None allows the whole vocabulary.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's): a word's last token is banned wherever the output so far ends
    # with the rest of it (each word tokenized as written and with a leading space).
    bad_words: list[str] | None = None
    # vLLM's: decoded text has spaces between special tokens (slow tokenizers only; see _verify).
    spaces_between_special_tokens: bool = True
    # The output must match a JSON schema, regex, choice or grammar (vLLM's; a dict is converted).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's names for what is not implemented here, accepted at the values that change nothing only:
    # best_of (= n), the rest None.
    best_of: int | None = None
    logits_processors: list | None = None
    guided_decoding: object | None = None
    # Characters of output text held back from streamed (unfinished) outputs: they could still become
    # a stop string, which is cut from the output (vLLM's name and rule; set from stop).
    output_text_buffer_length: int = field(default=0, init=False, repr=False)
    # Filled by the engine: the model's EOS ids, so min_tokens can mask them.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: bad_words' token sequences (update_from_tokenizer).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @classmethod
    def from_optional(cls, n: int | None = 1, presence_penalty: float | None = 0.0,
                      frequency_penalty: float | None = 0.0, repetition_penalty: float | None = 1.0,
                      temperature: float | None = 1.0, top_p: float | None = 1.0, **kwargs) -> "SamplingParams":
        """vLLM's constructor for optional arguments: n, the penalties, temperature and top_p given as
        None take their defaults; any other field keeps what is given (max_tokens=None: up to the
        context's end)."""
        return cls(n=1 if n is None else n,
                   presence_penalty=0.0 if presence_penalty is None else presence_penalty,
                   frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
                   repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
                   temperature=1.0 if temperature is None else temperature,
                   top_p=1.0 if top_p is None else top_p, **kwargs)

    def __post_init__(self) -> None:
        if is_number(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which may make the scaled logits inf or NaN: raised to %s.",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if self.seed == -1 and is_int(self.seed):
            self.seed = None   # vLLM's: -1 asks for a random seed
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)   # vLLM's: True asks for the sampled token's alone
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            _check(isinstance(self.stop, (list, tuple)), "stop", "a non-empty string or a list of them", self.stop)
            self.stop = list(self.stop)
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               "stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "a list of non-negative integers", self.stop_token_ids)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.top_k == -1:
            self.top_k = 0
        if is_int(self.seed):
            self.seed = int(self.seed)   # numpy's would overflow in seed + index and torch refuses them
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        _check(self.bad_words is None or (isinstance(self.bad_words, (list, tuple))
                                          and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
               "bad_words", "None or a list of non-blank strings", self.bad_words)
        self.bad_words = list(dict.fromkeys(self.bad_words)) if self.bad_words else None
        check_text("bad_words", self.bad_words)
        check_text("stop", self.stop)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0
                   and all(is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", "None or a non-empty list of non-negative integers", self.allowed_token_ids)
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        self._verify()
        if self.is_greedy:
            # Greedy ignores the truncation knobs; normalising them lets the
            # sampler skip work for mixed batches.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        self.all_stop_token_ids = set(self.stop_token_ids)
        self.output_text_buffer_length = (max(map(len, self.stop)) - 1
                                          if self.stop and not self.include_stop_str_in_output else 0)

    def _verify(self) -> None:
        _check(is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        # (applied in float32: a larger one would become inf there, and 0 * inf = NaN logits)
        _check(is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= FLOAT32_MAX,
               "repetition_penalty", "a number > 0 (and finite in float32)", self.repetition_penalty)
        _check(is_number(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature", "in [0, 2]",
               self.temperature)
        _check(is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(is_int(self.top_k) and self.top_k >= 0, "top_k", "0 or -1 (disabled) or a positive integer", self.top_k)
        _check(is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        # torch generators take seeds in [-2**63, 2**64); children n > 1 use seed + index.
        _check(self.seed is None or (is_int(self.seed) and -(1 << 63) <= self.seed and self.seed + self.n <= 1 << 64),
               "seed", "None or an integer in [-2**63, 2**64 - n]", self.seed)
        _check(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens", "an integer >= 1 or None", self.max_tokens,
        )
        _check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and value >= -1), name,
                   "None, -1 (the whole vocabulary) or an integer >= 0", value)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a non-empty string or a list of them", self.stop)
        _check(self.truncate_prompt_tokens is None or (is_int(self.truncate_prompt_tokens)
                                                       and (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1)),
               "truncate_prompt_tokens", "None, -1 (max_model_len - 1) or an integer >= 1", self.truncate_prompt_tokens)
        _check(self.best_of is None or self.best_of == self.n, "best_of",
               f"None or equal to n ({self.n}): best-of-n selection is not supported", self.best_of)
        # (Only slow tokenizers put spaces between special tokens: fast ones, the only kind here,
        # decode alike either way, as in vLLM.)
        _check(isinstance(self.spaces_between_special_tokens, bool), "spaces_between_special_tokens",
               "True or False", self.spaces_between_special_tokens)
        _check(self.logits_processors in (None, []), "logits_processors", "None (not supported)",
               self.logits_processors)
        _check(self.guided_decoding is None, "guided_decoding",
               "None (vLLM renamed it: use structured_outputs=StructuredOutputsParams(...))", self.guided_decoding)
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
               f"one of {[k.name for k in RequestOutputKind]}", self.output_kind)
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", "a dict or None",
               self.extra_args)
        rate = self.synthetic_acceptance_rate
        _check(rate is None or (is_number(rate) and 0.0 <= rate <= 1.0),
               'extra_args["synthetic_acceptance_rate"]', "a number in [0, 1]", rate)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def biases_logits(self) -> bool:
        """logit_bias or allowed_token_ids: the distribution (greedy's argmax too) is not the model's."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    def update_from_tokenizer(self, tokenizer) -> None:
        """bad_words' token sequences, as vLLM tokenizes them: each word as written (its leading
        blanks stripped), and with a leading space where that makes another first token of as
        many tokens (a word in the middle of text)."""
        self.bad_words_token_ids = []
        for word in self.bad_words or ():
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words: {word!r} encodes to no tokens.")
            self.bad_words_token_ids.append(bare)
            if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
                self.bad_words_token_ids.append(spaced)

    def check_logprobs(self, max_logprobs: int, vocab_size: int | None = None) -> None:
        """ValueError naming logprobs or prompt_logprobs where it asks for more than the engine's
        max_logprobs (-1: the whole vocabulary, as is a request's -1; vocab_size None: not known here, the
        engine checks against it)."""
        most = vocab_size if max_logprobs == -1 else max_logprobs
        if most is None:
            return
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(self, name)
            if asked == -1 and vocab_size is not None:
                asked = vocab_size
            if asked is not None and (asked == -1 or asked > most):
                what = "the whole vocabulary (-1)" if asked == -1 else asked
                raise ValueError(f"{name}: requested {what}, which is greater than max allowed: {most} (the "
                                 "engine's max_logprobs; -1 allows the whole vocabulary).")

    def check_vocab(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """ValueError naming the field whose token ids lie outside the model's vocabulary, or that asks
        for more logprobs than max_logprobs; logprobs of -1 become the vocabulary's size."""
        self.check_logprobs(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) == -1:
                setattr(self, name, vocab_size)
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids),
                          ("bad_words", [t for word in self.bad_words_token_ids for t in word])):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}.")

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def synthetic_acceptance_rate(self) -> float | None:
        """Benchmarks only: speculative verification accepts each of this request's draft tokens
        with this probability, whatever the models say (its output is then NOT the target's)."""
        return (self.extra_args or {}).get("synthetic_acceptance_rate")

    @cached_property
    def seeded_sampling(self) -> bool:
        """Sampled with the request's own seed: its draws may not depend on the batch it shares."""
        return not self.is_greedy and self.seed is not None

    @cached_property
    def batch_fields(self) -> BatchFields:
        """What batched sampling reads of these parameters, computed once per request (the
        engine's copy of a request's parameters never changes)."""
        return BatchFields(self.is_greedy, 1.0 if self.is_greedy else self.temperature, self.top_k, self.top_p,
                           self.min_p, self.has_penalties, self.logprobs, self.synthetic_acceptance_rate,
                           self.min_tokens, self.biases_logits, bool(self.bad_words),
                           self.structured_outputs is not None)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def checked_copy(self) -> "SamplingParams":
        """A copy normalised and checked again: as vLLM users do, a caller may have changed fields
        after construction (params.n = 0 would otherwise make a request that never finishes)."""
        params = copy.copy(self)
        for name, attr in vars(type(self)).items():
            if isinstance(attr, cached_property):
                params.__dict__.pop(name, None)
        params = copy.deepcopy(params)
        params.__post_init__()
        return params

    def truncate_prompt(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens ids, or all of them; -1: the most that leave room for
        one new token (max_model_len - 1: a prompt of max_model_len tokens is refused, as vLLM's).
        ValueError, as vLLM's, where truncate_prompt_tokens exceeds max_model_len (nothing it keeps fits)."""
        n = self.truncate_prompt_tokens
        if n is not None and n > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({n}) is greater than max_model_len ({max_model_len}): "
                             "choose a smaller truncation, or -1 for max_model_len - 1.")
        return token_ids if n is None else token_ids[-(max_model_len - 1 if n == -1 else n):]

    def for_child(self, index: int) -> "SamplingParams":
        """Parameters for the index-th of n parallel samples (vLLM: seed + index)."""
        child = self.clone()
        child.n, child.best_of = 1, None
        if child.seed is not None:
            child.seed = self.seed + index
        return child


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            _check(is_int(value) and value >= 1, name, "an integer >= 1", value)
        _check(is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0",
               self.temperature)
        _check(is_number(self.length_penalty) and math.isfinite(self.length_penalty), "length_penalty",
               "a finite number", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name))


class BatchFields(NamedTuple):
    """SamplingParams.batch_fields: one row of a batch's sampling columns."""

    greedy: bool
    temperature: float   # 1.0 on greedy rows (never divides by 0)
    top_k: int
    top_p: float
    min_p: float
    has_penalties: bool
    logprobs: int | None
    synthetic_acceptance_rate: float | None
    min_tokens: int
    biases_logits: bool
    has_bad_words: bool   # bans that follow the output's tokens
    structured: bool      # a grammar's mask, which follows the output's tokens

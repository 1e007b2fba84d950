"""SamplingParams validation: every invalid value raises ValueError naming the field."""

from __future__ import annotations

import math

import pytest

from vllm_spec.sampling_params import SamplingParams

INVALID = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True), ("n", "2"), ("n", None),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("presence_penalty", "0.1"), ("presence_penalty", None),
    ("frequency_penalty", 2.01), ("frequency_penalty", -3), ("frequency_penalty", math.nan),
    ("frequency_penalty", "1"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf), ("repetition_penalty", math.nan), ("repetition_penalty", None),
    ("temperature", -0.1), ("temperature", -math.inf), ("temperature", math.nan), ("temperature", "hot"),
    ("temperature", None), ("temperature", math.inf), ("temperature", 2.01),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", math.nan), ("top_p", None),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "5"), ("top_k", None),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", math.nan), ("min_p", "0.1"),
    ("seed", 1.5), ("seed", "7"), ("seed", True),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0), ("max_tokens", True), ("max_tokens", "16"),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", None), ("min_tokens", 17),  # 17 > max_tokens 16
    ("logprobs", -2), ("logprobs", 1.0), ("logprobs", "5"), ("prompt_logprobs", -2),
    ("n", 2, dict(temperature=0)),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 5), ("stop", [None]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", [1.5]), ("stop_token_ids", [True]),
    ("stop_token_ids", 5), ("stop_token_ids", [[1]]), ("extra_args", [("synthetic_acceptance_rate", 0.5)]), ("extra_args", "x"),
]


@pytest.mark.parametrize("case", INVALID, ids=[f"{c[0]}={c[1]!r}" for c in INVALID])
def test_invalid_value_raises_value_error_naming_field(case):
    field, value, *others = case
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}, **(others[0] if others else {}))


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match="min_tokens") as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert "max_tokens" in str(e.value)


VALID = [
    {}, {"n": 3}, {"presence_penalty": -2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2},
    {"repetition_penalty": 2.0}, {"repetition_penalty": 0.01}, {"temperature": 0}, {"temperature": 2.0},
    {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"min_p": 0.0}, {"min_p": 1.0},
    {"seed": 0}, {"seed": -3}, {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 16},
    {"logprobs": 0}, {"logprobs": 20}, {"logprobs": 500}, {"logprobs": -1}, {"prompt_logprobs": -1},
    {"stop": "x"}, {"stop": ["a", "bc"]}, {"stop": ("a",)},
    {"stop_token_ids": [0, 5]}, {"max_tokens": None, "min_tokens": 1000},
    {"extra_args": {"plugin": [1, 2]}}, {"extra_args": {"synthetic_acceptance_rate": 0}},
    {"extra_args": {"synthetic_acceptance_rate": 1.0}},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(v) for v in VALID])
def test_valid_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        if key == "stop":
            assert p.stop == ([value] if isinstance(value, str) else list(value))
        elif key == "top_k":
            assert p.top_k == (0 if value == -1 else value)
        elif key not in ("top_p", "min_p") or p.temperature != 0:
            assert getattr(p, key) == value


@pytest.mark.parametrize("rate", [-0.1, 1.01, math.nan, math.inf, "0.5", True])
def test_invalid_synthetic_acceptance_rate_names_the_key_and_range(rate):
    with pytest.raises(ValueError) as e:
        SamplingParams(extra_args={"synthetic_acceptance_rate": rate})
    assert 'extra_args["synthetic_acceptance_rate"]' in str(e.value) and "[0, 1]" in str(e.value)


def test_extra_args_pass_through():
    args = {"synthetic_acceptance_rate": 0.25, "plugin": {"x": 1}}
    p = SamplingParams(extra_args=args)
    assert p.extra_args == args and p.synthetic_acceptance_rate == 0.25
    assert p.clone().extra_args == args and p.for_child(1).synthetic_acceptance_rate == 0.25
    assert SamplingParams().synthetic_acceptance_rate is None
    assert SamplingParams(extra_args={"plugin": 1}).synthetic_acceptance_rate is None


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=None, top_k=-1)
    assert p.stop == ["END"] and p.stop_token_ids == [] and p.top_k == 0
    g = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.is_greedy and (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams(temperature=0.01).is_greedy
    assert SamplingParams(stop_token_ids=[3, 4]).all_stop_token_ids == {3, 4}
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties


def test_vllm_normalisation():
    """vLLM's __post_init__ rules: a tiny positive temperature is raised to 0.01, seed -1 is random,
    logprobs True is 1, duplicate stop ids and bad words are dropped (first occurrence kept)."""
    assert SamplingParams(temperature=0.001).temperature == 0.01
    assert SamplingParams(temperature=0.0).temperature == 0.0
    assert SamplingParams(temperature=1.0, seed=-1).seed is None
    p = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (p.logprobs, p.prompt_logprobs) == (1, 1)
    p = SamplingParams(stop_token_ids=[5, 5, 6, 5], bad_words=["b", "a", "b"])
    assert p.stop_token_ids == [5, 6] and p.bad_words == ["b", "a"]
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 3"):
        SamplingParams(n=3, temperature=0)


def test_from_optional_keeps_none_where_vllm_does():
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                     frequency_penalty=None, repetition_penalty=None, max_tokens=None, seed=None)
    assert (p.n, p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == \
        (1, 1.0, 1.0, 0.0, 0.0, 1.0)
    assert p.max_tokens is None and p.seed is None
    assert SamplingParams.from_optional(max_tokens=7, logprobs=2).logprobs == 2


def test_logprobs_bounded_by_the_engines_max_logprobs():
    """Construction takes any count; the engine's check_vocab bounds it by max_logprobs (-1: the vocabulary)
    and turns -1 into the vocabulary's size."""
    p = SamplingParams(logprobs=-1, prompt_logprobs=3)
    p.check_vocab(100, max_logprobs=-1)
    assert (p.logprobs, p.prompt_logprobs) == (100, 3)
    with pytest.raises(ValueError, match=r"logprobs: requested 100, which is greater than max allowed: 20"):
        SamplingParams(logprobs=-1).check_vocab(100, max_logprobs=20)
    with pytest.raises(ValueError, match=r"logprobs: requested 101, which is greater than max allowed: 100"):
        SamplingParams(logprobs=101).check_vocab(100, max_logprobs=-1)   # -1: the vocabulary bounds it
    SamplingParams(logprobs=101).check_logprobs(-1)   # (the vocabulary not known: the engine checks)
    with pytest.raises(ValueError, match=r"prompt_logprobs: requested 8, which is greater than max allowed: 7"):
        SamplingParams(prompt_logprobs=8).check_vocab(100, max_logprobs=7)
    SamplingParams(logprobs=20).check_vocab(100)
    with pytest.raises(ValueError, match=r"^logprobs: requested 21"):
        SamplingParams(logprobs=21).check_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids has token ids outside the vocabulary \[0, 100\): \[100\]"):
        SamplingParams(stop_token_ids=[3, 100]).check_vocab(100)


def test_for_child_offsets_seed_and_keeps_original():
    p = SamplingParams(n=3, seed=10, stop=["x"])
    kids = [p.for_child(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12] and all(k.n == 1 for k in kids)
    kids[0].stop.append("y")
    assert p.stop == ["x"] and p.n == 3 and p.seed == 10
    assert SamplingParams(n=2).for_child(1).seed is None


def test_vllm_names_accepted_where_they_change_nothing():
    assert SamplingParams(n=3, best_of=3).n == 3
    assert SamplingParams(repetition_penalty=2.5).repetition_penalty == 2.5
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    assert SamplingParams.from_optional(temperature=None, top_p=0.5, seed=None).temperature == 1.0
    for kwargs, name in [(dict(best_of=2), "best_of"), (dict(bad_words=["x", " "]), "bad_words"),
                         (dict(logits_processors=[print]), "logits_processors"),
                         (dict(spaces_between_special_tokens="no"), "spaces_between_special_tokens"),
                         (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                         (dict(repetition_penalty=float("inf")), "repetition_penalty")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_truncation_past_max_model_len_is_refused():
    """As vLLM: truncate_prompt_tokens above max_model_len is an error naming it; -1 keeps the most that
    leave room for one new token."""
    ids = list(range(10))
    assert SamplingParams(truncate_prompt_tokens=4).truncate_prompt(ids, 8) == [6, 7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt(ids, 8) == ids[3:]
    assert SamplingParams(truncate_prompt_tokens=8).truncate_prompt(ids, 8) == ids[2:]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(9\) is greater than max_model_len \(8\)"):
        SamplingParams(truncate_prompt_tokens=9).truncate_prompt(ids, 8)


def test_logit_bias_and_allowed_token_ids():
    """vLLM's forms: string keys (as JSON sends them) become ints, biases are clamped to OpenAI's [-100, 100]."""
    p = SamplingParams(logit_bias={"5": 250, 3: -1.5, 7: -1e9}, allowed_token_ids=(4, 2))
    assert p.logit_bias == {5: 100.0, 3: -1.5, 7: -100.0} and p.allowed_token_ids == [4, 2]
    assert p.biases_logits and p.batch_fields.biases_logits and not SamplingParams().biases_logits
    assert SamplingParams(logit_bias={}).logit_bias is None
    for kwargs, name in [(dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={1: "a"}), "logit_bias"),
                         (dict(logit_bias={"\u00b2": 1.0}), "logit_bias"), (dict(logit_bias={1: True}), "logit_bias"),
                         (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias"),
                         (dict(logit_bias={1: float("nan")}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed"),
                         (dict(allowed_token_ids=[1.5]), "allowed"), (dict(allowed_token_ids=5), "allowed")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=r"allowed_token_ids has token ids outside the vocabulary \[0, 10\): \[10\]"):
        SamplingParams(allowed_token_ids=[1, 10]).check_vocab(10)
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside the vocabulary \[0, 10\): \[12\]"):
        SamplingParams(logit_bias={12: 1.0}).check_vocab(10)


class _WordTokenizer:
    """Each space-separated word one token; a word with a leading space another token."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        words = text.split(" ")
        pieces = ([" " + words[1]] + words[2:]) if text.startswith(" ") else words
        return [self.ids.setdefault(w, len(self.ids)) for w in pieces]


def test_bad_words_tokenized_bare_and_with_a_leading_space():
    tok = _WordTokenizer()
    p = SamplingParams(bad_words=["  foo bar", "baz"])
    assert p.bad_words == ["  foo bar", "baz"] and p.batch_fields.has_bad_words
    p.update_from_tokenizer(tok)
    foo, bar, sfoo, baz, sbaz = (tok.ids[w] for w in ("foo", "bar", " foo", "baz", " baz"))
    assert p.bad_words_token_ids == [[foo, bar], [sfoo, bar], [baz], [sbaz]]
    assert SamplingParams(bad_words="x").bad_words == ["x"] and SamplingParams(bad_words=[]).bad_words is None
    with pytest.raises(ValueError, match=r"bad_words has token ids outside the vocabulary"):
        p.check_vocab(2)


def test_seed_range_and_children():
    for seed in (-(1 << 63), (1 << 64) - 1, 0):
        assert SamplingParams(temperature=1.0, seed=seed).seed == seed
    for seed, n in (((1 << 64), 1), (-(1 << 63) - 1, 1), ((1 << 64) - 1, 2)):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(temperature=1.0, seed=seed, n=n)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e39)
    import dataclasses
    child = SamplingParams(n=3, best_of=3, seed=5).for_child(2)
    assert (child.n, child.best_of, child.seed) == (1, None, 7)
    dataclasses.replace(child)   # a child is a valid SamplingParams of its own

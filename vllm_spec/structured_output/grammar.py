"""Grammars (xgrammar) for structured outputs: compiled once per constraint, matched per sequence.

A sequence's matcher follows its output tokens; for a verification it also walks the drafts, so
that position j is masked by the grammar's state after the first j drafts (then rolls them back:
the verifier decides what is kept). A draft the grammar refuses has target probability 0 and is
rejected, so speculation stays lossless under a grammar.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from vllm_spec.structured_output.enforceable import enforceable_schema, enforceable_structural_tag, regex_problem
from vllm_spec.structured_output.lark import is_lark, lark_to_ebnf
from vllm_spec.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from vllm_spec.config import ModelConfig

logger = logging.getLogger(__name__)
# xgrammar's cache of compiled grammars (vLLM's default bound): distinct schemas cannot grow it past this.
_CACHE_BYTES = 512 << 20
# xgrammar prefixes its messages with a time and a C++ source location: not for API users.
_XGRAMMAR_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: ?)?")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured_outputs need the xgrammar package (pip install xgrammar).") from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar writes a length-bounded JSON string as `"` X{lo, hi} `"`, with X a rule of its own whose
# characters exclude only `"`, backslash, CR and LF: raw control characters pass, in output no JSON parser
# takes (its unbounded strings' rule excludes U+0000-U+001F, as JSON does). Swapped for JSON's class in the
# grammar's text, xgrammar's own (fast) length bounds stay.
_BOUNDED_STRING_RULE = re.compile(r'^(\S+ ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.MULTILINE)
_JSON_STRING_CHARS = r'[^\"\\\0-\x1f]'


@functools.lru_cache(maxsize=64)
def _json_schema_grammar(schema: str, any_whitespace: bool) -> xgrammar.Grammar:
    """The schema's grammar with its length-bounded strings' characters as JSON allows them (cached: each
    request compiles its constraint at least twice, and the text round trip is not free)."""
    xgr = _xgrammar()
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return xgr.Grammar.from_ebnf(_BOUNDED_STRING_RULE.sub(lambda m: m[1] + _JSON_STRING_CHARS + m[2], text))


def _legacy_structural_tag(tag: dict[str, Any]) -> tuple[list, list[str]]:
    """vLLM's first structural-tag form: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not (isinstance(structures, list) and all(isinstance(s, dict) and isinstance(s.get("begin"), str)
                                                 and isinstance(s.get("end"), str) for s in structures)
            and isinstance(triggers, list) and all(isinstance(t, str) for t in triggers)):
        raise ValueError('needs "structures": [{"begin": <string>, "schema": {...}, "end": <string>}, ...] and '
                         '"triggers": [<string>, ...]')
    xgr = _xgrammar()
    return [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in structures], triggers


class GrammarCompiler:
    """Compiles StructuredOutputsParams into grammars over one tokenizer's vocabulary (xgrammar caches
    them, bounded)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        stops = {i for i in info.stop_token_ids if 0 <= i < vocab_size}
        if any(info.decoded_vocab[i] for i in stops):
            # xgrammar reads a stop token's text (<|im_end|>) as text a grammar may match, so an output
            # could stop there mid-grammar: as empty tokens they only end a complete output. (Other
            # special tokens keep their text: structural tags are built on them.)
            vocab = [b"" if i in stops else token for i, token in enumerate(info.decoded_vocab)]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                     stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=_CACHE_BYTES)
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams, check_start: bool = True) -> xgrammar.CompiledGrammar:
        """The compiled grammar; ValueError naming the field when it does not compile, or (check_start:
        a request's checks, not the matchers of its sequences) when it allows no first token."""
        try:
            compiled = self._compile(params)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            message = _XGRAMMAR_PREFIX.sub("", str(e).strip())
            raise ValueError(f"structured_outputs.{params.kind} is not valid: {message}") from None
        if check_start:
            xgr = _xgrammar()
            first = xgr.allocate_token_bitmask(1, self.vocab_size)
            xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first)
            if not first.any():
                raise ValueError(f"structured_outputs.{params.kind} is not valid: it allows no first token, so no "
                                 "output can match it.")
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        c, any_ws = self._compiler, not params.disable_any_whitespace
        if params.json is not None:
            schema = json.dumps(enforceable_schema(json.loads(params.json)), ensure_ascii=False)
            if '"minLength"' in schema or '"maxLength"' in schema:
                return c.compile_grammar(_json_schema_grammar(schema, any_ws))
            return c.compile_json_schema(schema, any_whitespace=any_ws)
        if params.json_object:   # as vLLM: an object, not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
        if params.regex is not None:
            problem = regex_problem(params.regex)
            if problem:
                raise ValueError(f"xgrammar would not enforce it as written: {problem}.")
            return c.compile_regex(params.regex)
        if params.choice is not None:
            return c.compile_grammar(choice_grammar(params.choice))
        if params.grammar is not None:
            return c.compile_grammar(lark_to_ebnf(params.grammar) if is_lark(params.grammar) else params.grammar)
        tag = enforceable_structural_tag(json.loads(params.structural_tag))
        if "structures" in tag:
            return c.compile_structural_tag(*_legacy_structural_tag(tag))
        return c.compile_structural_tag(json.dumps(tag, ensure_ascii=False))

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(params, check_start=False)), self.vocab_size)


class GrammarState:
    """One sequence's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int):
        self.matcher = matcher
        self.width = (vocab_size + 31) // 32
        self.consumed = 0
        # Past the grammar's end (a stop token accepted; more tokens only with ignore_eos), or after a
        # token it refused: the output is no longer constrained (as vLLM's).
        self.free = False

    def _follow(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not seen yet (a sequence's output only grows, preempted or not)."""
        for token in output_token_ids[self.consumed:]:
            if self.free or self.matcher.is_terminated():
                self.free = True
                break
            if not self.matcher.accept_token(token):
                logger.warning("the grammar refused output token %d; the rest of the output is unconstrained.",
                               token)
                self.free = True
        self.consumed = len(output_token_ids)

    def bitmasks(self, output_token_ids: list[int], drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, ceil(V / 32)] int32 bitmasks of the allowed tokens after the output and
        the first j drafts (all allowed where unconstrained, and after a draft the grammar refuses:
        verification stops at that draft)."""
        self._follow(output_token_ids)
        masks = torch.full((len(drafts) + 1, self.width), -1, dtype=torch.int32)
        walked = 0
        if not self.free:
            for j in range(len(drafts) + 1):
                if self.matcher.is_terminated():
                    break
                self.matcher.fill_next_token_bitmask(masks, j)
                if j == len(drafts) or not self.matcher.accept_token(drafts[j]):
                    break
                walked += 1
            if walked:
                self.matcher.rollback(walked)
        return masks


_compilers: dict[tuple, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(model_config: ModelConfig, tokenizer: Any = None) -> GrammarCompiler:
    """The process's compiler for a model (an engine, its in-process worker and the server share it);
    the tokenizer is loaded when not given."""
    key = (str(model_config.path), str(model_config.tokenizer), model_config.arch.vocab_size)
    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            from vllm_spec.generation_config import model_eos_token_ids
            from vllm_spec.tokenizer import get_tokenizer
            tokenizer = tokenizer if tokenizer is not None else get_tokenizer(model_config)
            eos, _ = model_eos_token_ids(model_config, tokenizer)
            compiler = _compilers[key] = GrammarCompiler(tokenizer, model_config.arch.vocab_size, eos)
        return compiler


class StructuredOutputs:
    """A worker's grammar states, one per sequence with structured outputs."""

    def __init__(self, model_config: ModelConfig):
        self.model_config = model_config
        self._states: dict[int, GrammarState] = {}

    def bitmasks(self, seq_id: int, params: StructuredOutputsParams, output_token_ids: list[int],
                 drafts: list[int]) -> torch.Tensor:
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = compiler_for(self.model_config).matcher(params)
        return state.bitmasks(output_token_ids, drafts)

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self._states.pop(sid, None)

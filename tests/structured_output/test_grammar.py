"""Grammar states: masks per verified position (after the drafts before it), rollback, escapes."""

from __future__ import annotations

import re
import time

import pytest
import torch

from vllm_spec.sampling_params import StructuredOutputsParams
from vllm_spec.sample.metadata import allowed_tokens



def _allowed(state, output, drafts, vocab):
    return allowed_tokens(state.bitmasks(output, drafts), vocab)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_allowed_tokens_unpacks_bits():
    bitmask = torch.tensor([[0b1011, -1], [-(1 << 31), 0]], dtype=torch.int32)   # bit 31: the sign
    allowed = allowed_tokens(bitmask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0, :4].tolist() == [True, True, False, True] and not allowed[0, 4:32].any()
    assert allowed[0, 32:].all() and not allowed[1, :31].any() and allowed[1, 31] and not allowed[1, 32:].any()


def test_masks_follow_the_drafts_and_roll_back(tok, compiler):
    vocab = len(tok)
    state = compiler.matcher(StructuredOutputsParams(choice=["cat", "dog"]))
    first = _allowed(state, [], [], vocab)[0]
    cat = _ids(tok, "cat")
    assert first[cat[0]] and first.sum() < vocab
    # Position j is masked after the first j drafts; the drafts are rolled back afterwards.
    masks = _allowed(state, [], cat, vocab)
    assert masks.shape == (len(cat) + 1, vocab)
    assert torch.equal(masks[0], first)
    assert masks[-1].nonzero().flatten().tolist() == [tok.eos_token_id]   # complete: only the stop token
    assert torch.equal(_allowed(state, [], [], vocab)[0], first)
    # A refused draft: positions after it are unconstrained (verification stops at it).
    bad = next(t for t in range(vocab) if not first[t])
    masks = _allowed(state, [], [bad, bad], vocab)
    assert torch.equal(masks[0], first) and masks[1:].all()
    # The output advances the state; past the stop token nothing is constrained (as vLLM).
    after = _allowed(state, cat[:1], [], vocab)[0]
    assert after.sum() >= 1 and not torch.equal(after, first)
    assert _allowed(state, cat + [tok.eos_token_id], [], vocab).all()


def test_choice_escapes(tok, compiler):
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "naïve ✓"]
    for choice in choices:
        state = compiler.matcher(StructuredOutputsParams(choice=choices))
        for token in _ids(tok, choice):
            assert state.matcher.accept_token(token), choice
        assert state.matcher.accept_token(tok.eos_token_id) and state.matcher.is_terminated()
    state = compiler.matcher(StructuredOutputsParams(choice=choices))
    assert not all(state.matcher.accept_token(t) for t in _ids(tok, 'say "hi" again'))


@pytest.mark.parametrize("params, named", [
    (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex is not valid"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar is not valid"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json is not valid"),
])
def test_grammars_that_do_not_compile_are_named(compiler, params, named):
    with pytest.raises(ValueError, match=named):
        compiler.compile(params)


def test_schema_properties_keep_their_order(tok, compiler):
    """As vLLM: the schema's text reaches xgrammar as given (JSON objects' fields come in the order declared)."""
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    for text, accepted in (('{"zeta": 1, "alpha": 2}', True), ('{"alpha": 2, "zeta": 1}', False)):
        state = compiler.matcher(StructuredOutputsParams(json=schema))
        assert all(state.matcher.accept_token(t) for t in _ids(tok, text)) == accepted, text


def test_malformed_structural_tags_are_named(compiler):
    for tag in ({"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]},
                {"type": "structural_tag", "structures": []}):
        with pytest.raises(ValueError, match="structured_outputs.structural_tag is not valid"):
            compiler.compile(StructuredOutputsParams(structural_tag=tag))
    ok = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
          "triggers": ["<f"]}
    compiler.compile(StructuredOutputsParams(structural_tag=ok))


def test_messages_carry_no_source_locations(compiler):
    with pytest.raises(ValueError) as e:
        compiler.compile(StructuredOutputsParams(json={"type": "no-such-type"}))
    assert ".cc:" not in str(e.value)


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}},
    {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    {"type": "object", "properties": {"a": {"not": {"type": "integer"}}}},
    {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 3}},
    {"type": "object", "dependentRequired": {"a": ["b"]}},
    {"$defs": {"A": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/A"},
    {"type": "object", "properties": {"v": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 4}}},
    {"type": "object", "propertyNames": {"pattern": "^a", "minLength": 2}},
    {"type": "number", "multipleOf": 0.5},
    {"type": "string", "pattern": "^(?!ab)[a-z]{2}$"},
    {"type": "string", "pattern": "^a^b$"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
    {"type": "string", "format": "email", "maxLength": 20},            # xgrammar drops the bounds
    {"type": "string", "enum": ["abcd"], "maxLength": 3},
    {"type": "object", "properties": {"a": {"pattern": "^x$"}}},      # no type: xgrammar allows any value
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},             # 3 is both: xgrammar would allow it
    {"oneOf": [{"const": 1}, {"enum": [2, 1.0]}]},
    {"oneOf": [{"type": ["object", "null"], "properties": {"x": {"type": "integer"}}, "required": ["x"]},
               {"type": ["object", "null"], "properties": {"y": {"type": "integer"}}, "required": ["y"]}]},  # null
    {"oneOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                "unevaluatedProperties": True},
               {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
    {"oneOf": [{"enum": [{"a": 1}]}, {"enum": [{"a": 1.0}]}]},
    {"oneOf": [{"const": 0}, {"const": -0.0}]},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},   # {"a": 1, "b": 2}
               {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"],
                "additionalProperties": True}]},
    {"$defs": {"A": {"type": "object"}},
     "oneOf": [{"$ref": "#/$defs/A"}, {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]}]},
])
def test_schemas_xgrammar_would_not_enforce_are_refused(compiler, schema):
    with pytest.raises(ValueError, match="cannot be enforced by the xgrammar backend"):
        compiler.compile(StructuredOutputsParams(json=schema))
    tag = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}],
           "triggers": ["<a"]}
    with pytest.raises(ValueError, match="structured_outputs.structural_tag .*xgrammar backend"):
        compiler.compile(StructuredOutputsParams(structural_tag=tag))


@pytest.mark.parametrize("regex, refused", [
    ("a^b", "^ after its start"), ("a$b", "$ before its end"), ("(?=a)a", "lookaround"),
    (r"\ud83d\ude00", "surrogate"), ("[^a]b$", None), (r"^\$[0-9]+\.[0-9]{2}$", None), ("[$^]x", None),
    (r"\Aab", "the letter A"), (r"ab\Z", "the letter Z"), (r"ab\z", "the letter z"), (r"[\\A]\\Z", None),
])
def test_regexes_xgrammar_would_not_enforce_are_refused(compiler, regex, refused):
    if refused is None:
        compiler.compile(StructuredOutputsParams(regex=regex))
        return
    with pytest.raises(ValueError, match=re.escape(refused)):
        compiler.compile(StructuredOutputsParams(regex=regex))


def test_satisfiable_look_alikes_compile(compiler):
    for schema in ({"type": "integer", "multipleOf": 5}, {"type": "string", "pattern": "^[a-z]{2,4}$"},
                   {"type": "object", "required": ["x"], "additionalProperties": {"type": "integer"}},
                   {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}):
        compiler.compile(StructuredOutputsParams(json=schema))


def test_keyword_names_as_property_names_and_one_part_all_of_are_fine(tok, compiler):
    schema = {"type": "object", "properties": {"if": {"type": "integer"}, "not": {"allOf": [{"type": "boolean"}],
                                                                                   "description": "a flag"}},
              "required": ["if", "not"]}
    state = compiler.matcher(StructuredOutputsParams(json=schema))
    assert all(state.matcher.accept_token(t) for t in _ids(tok, '{"if": 3, "not": true}'))
    state = compiler.matcher(StructuredOutputsParams(json=schema))
    assert not all(state.matcher.accept_token(t) for t in _ids(tok, '{"if": 3, "not": 7'))


def test_stop_tokens_are_never_text(tok, compiler):
    """A stop token's text (the EOS <|endoftext|>) is no text a grammar matches: the output cannot stop
    before the grammar is complete. Other special tokens keep theirs (structural tags use them)."""
    state = compiler.matcher(StructuredOutputsParams(grammar='root ::= "Q" [^\\n]+'))
    after_q = _allowed(state, _ids(tok, "Q"), [], len(tok))[0]
    assert after_q.any() and not after_q[tok.eos_token_id]
    assert _allowed(state, _ids(tok, "Qx"), [], len(tok))[0][tok.eos_token_id]   # complete: EOS may end it
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    tagged = compiler.matcher(StructuredOutputsParams(grammar='root ::= "<|im_start|>" "x"'))
    assert _allowed(tagged, [], [], len(tok))[0][im_start]


def test_a_grammar_no_output_matches_is_refused(compiler):
    with pytest.raises(ValueError, match="structured_outputs.grammar is not valid: it allows no first token"):
        compiler.compile(StructuredOutputsParams(grammar="root ::= root"))


def test_one_of_with_disjoint_branches_compiles(tok, compiler):
    pet = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
           "required": ["kind"]}
    schema = {"$defs": {"Cat": pet, "Dog": {**pet, "properties": {"kind": {"enum": ["dog"]}}}},
              "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}
    state = compiler.matcher(StructuredOutputsParams(json=schema))
    assert all(state.matcher.accept_token(t) for t in _ids(tok, '{"kind": "dog"}'))
    a = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    for schema in ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, {"oneOf": [{"const": True}, {"const": 1}]},
                   {"oneOf": [a, b]}):
        compiler.compile(StructuredOutputsParams(json=schema))


def _assert_no_control_characters(tok, state, prefix):
    vocab = len(tok)
    control = [t for t in range(vocab) if (text := tok.decode([t])) and all(ord(c) < 0x20 for c in text)]
    assert control
    inside = _allowed(state, _ids(tok, prefix), [], vocab)[0]
    assert inside[_ids(tok, "a")[0]] and not inside[control].any()


@pytest.mark.parametrize("schema, prefix, refused", [
    ({"type": "string", "maxLength": 3}, '"', '"abcd"'),
    ({"type": "string", "minLength": 1}, '"', '""'),
    ({"type": ["string", "null"], "minLength": 1, "maxLength": 4}, '"', '"abcde"'),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, '{"', '{"abc"'),
    ({"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 2}}, '["', '["a", ""'),
])
def test_length_bounded_strings_are_json(tok, compiler, schema, prefix, refused):
    """xgrammar's own rule for a length-bounded string lets raw control characters in (no JSON parses
    that): the bounds are enforced as a pattern instead, and still bound the length."""
    state = compiler.matcher(StructuredOutputsParams(json=schema))
    _assert_no_control_characters(tok, state, prefix)
    state = compiler.matcher(StructuredOutputsParams(json=schema))
    assert not all(state.matcher.accept_token(t) for t in _ids(tok, refused))


def test_structural_tag_schemas_get_the_same_bounds(tok, compiler):
    tag = {"type": "structural_tag", "triggers": ["<a"],
           "structures": [{"begin": "<a>", "schema": {"type": "string", "maxLength": 2}, "end": "</a>"}]}
    _assert_no_control_characters(tok, compiler.matcher(StructuredOutputsParams(structural_tag=tag)), '<a>"')
    state = compiler.matcher(StructuredOutputsParams(structural_tag=tag))
    assert all(state.matcher.accept_token(t) for t in _ids(tok, '<a>"ab"</a>'))
    state = compiler.matcher(StructuredOutputsParams(structural_tag=tag))
    assert not all(state.matcher.accept_token(t) for t in _ids(tok, '<a>"abc"'))


def test_long_length_bounds_compile_at_once(compiler):
    """The bounds stay xgrammar's own repetition (a pattern of 8000 repeats took 40 s to compile)."""
    start = time.monotonic()
    compiler.compile(StructuredOutputsParams(json={"type": "string", "minLength": 10, "maxLength": 8000}))
    assert time.monotonic() - start < 5.0


def test_structural_tags_name_tokens_and_keep_their_grammars_text(tok, compiler):
    """Tags compile with the tokenizer (tokens named by their text), and only their JSON strings' rules change:
    a grammar element's own character class keeps control characters (a TAB here)."""
    compiler.compile(StructuredOutputsParams(structural_tag={
        "type": "structural_tag", "format": {"type": "token", "token": "<|im_start|>"}}))
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "grammar", "grammar": 'root ::= "<" [^"\\\\\\r\\n]* ">"'},
        {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 3}}]}}
    state = compiler.matcher(StructuredOutputsParams(structural_tag=tag))
    assert all(state.matcher.accept_token(t) for t in _ids(tok, '<a\tb>"ab"'))
    _assert_no_control_characters(tok, compiler.matcher(StructuredOutputsParams(structural_tag=tag)), '<a>"')


def test_huge_bounds_in_a_structural_tag_are_refused_and_huge_consts_compared(compiler):
    tag = {"type": "structural_tag", "triggers": ["<a"],
           "structures": [{"begin": "<a>", "schema": {"type": "string", "maxLength": 5000}, "end": "</a>"}]}
    with pytest.raises(ValueError, match="in a structural tag, string length bounds above 1024"):
        compiler.compile(StructuredOutputsParams(structural_tag=tag))
    from vllm_spec.structured_output.enforceable import enforceable_schema

    enforceable_schema({"oneOf": [{"const": 10 ** 400}, {"const": 2}]})   # (no float of it: no OverflowError)

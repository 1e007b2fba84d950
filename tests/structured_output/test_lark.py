"""Lark grammars (as vLLM's xgrammar backend takes them): what they accept once translated, what
cannot be translated (named, with its line), and Lark grammars end to end under speculation."""

from __future__ import annotations

import re

import pytest
import xgrammar

from conftest import FIXED, SPEC_KV, output_ids
from vllm_spec import LLM, SamplingParams
from vllm_spec.sampling_params import StructuredOutputsParams as SO
from vllm_spec.structured_output.lark import is_lark, lark_to_ebnf

JSON_LARK = r"""
?value: dict
      | list
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null

list : "[" [value ("," value)*] "]"
dict : "{" [pair ("," pair)*] "}"
pair : string ":" value
string : ESCAPED_STRING

%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""



def _matches(compiler, tok, grammar: str, text: str) -> bool:
    """Whether the grammar accepts the whole text (and may end there)."""
    matcher = xgrammar.GrammarMatcher(compiler.compile(SO(grammar=grammar)))
    return matcher.accept_string(text) and matcher.accept_token(tok.eos_token_id)


def test_lark_is_told_from_ebnf():
    assert is_lark(JSON_LARK) and is_lark('start: "a"') and is_lark('?expr.2 : "a"\n')
    assert is_lark('start: "::="') and is_lark('// not EBNF: x ::= y\nstart: "a"')
    assert not is_lark('root ::= "a" | "b"') and not is_lark('root ::= rule\nrule ::= "x: y"')
    assert not is_lark('# note: a comment\nroot::= "a"')


def test_json_with_ignored_whitespace(compiler, tok):
    for text in ('{"a": [1, 2.5e3, true], "b" : null}', " [ ] ", '"x\\"y"', "-1.5", '{"k":{"n":[false,-2]}}'):
        assert _matches(compiler, tok, JSON_LARK, text), text
    for text in ('{"a":}', "[1,]", '"open', "tru", "1 2", "[1]]"):
        assert not _matches(compiler, tok, JSON_LARK, text), text


@pytest.mark.parametrize("grammar, good, bad", [
    # start is `start` wherever it is defined; otherwise the first rule
    ('item: "x"\nstart: item+', ["x", "xxx"], ["", "y"]),
    ('greeting: "hi" | "hello"\nother: "no"', ["hi", "hello"], ["no"]),
    # ranges, repetition counts, optional brackets, case-insensitive strings
    ('start: DIGIT~2..3 ["!"]\nDIGIT: "0".."9"', ["12", "123!", "99!"], ["1", "1234", "ab"]),
    ('start: "ab"~2', ["abab"], ["ab", "ababab"]),
    ('start: "select"i " " WORD\nWORD: /[a-z]+/', ["SeLeCt x", "select abc"], ["selec x", "select X"]),
    # regexps, priorities, rule prefixes, _-terminals, aliases, comments, a rule named root
    ('start: _NUM ("," _NUM)*  // numbers\n_NUM.2: /-?[0-9]+/\n', ["1,-2,30"], ["1,", "a"]),
    ('?start: pair\n!pair: KEY "=" root\nroot: /[0-9]+/ -> value\nKEY: /[a-z]+/', ["a=1", "key=42"], ["a=", "=1"]),
    # imports: a name, an alias, several at once
    ('start: N "-" w\nw: CNAME\n%import common.INT -> N\n%import common (CNAME, WS)\n', ["12-ab_3"], ["12-3ab"]),
    # multi-line alternatives with | at the start of a line
    ('start: "a"\n     | "b"\n     | "c" "d"', ["a", "b", "cd"], ["c", "ab"]),
    # Lark's string escapes: only \\n \\t \\r \\f \\\\ \\" \\x \\u \\U; a backslash before anything else stays
    (r'start: "\d" "\x41" "\"" "\\"', ['\\dA"\\'], ["dA\"\\"]),
    # a regexp's . is anything but a newline; negative priorities
    ('start: /a.b/ X\nX.-1: "!"', ["axb!"], ["a\nb!"]),
    # case-insensitive as Python's re: the capital sharp s and the Kelvin sign too
    ('start: "straße"i "k"i', ["STRAẞEK", "straßek", "Straße\u212a"], ["STRASSEK", "strasek"]),
    # single-quoted strings (vLLM's conversion takes them), where \\' is the quote
    ("start: 'a' \"\\'\" 'b\\'c'", ["a\\'b'c"], ["a'b'c"]),
    # a regexp's character class may start with ] or [; a . after it is still no newline
    ('start: /[[]./ /[a[]./', ["[x[y"], ["[\n[y", "[xay\n"]),
    # ranges past the basic plane
    ('start: "\\U0001F600".."\\U0001F64F"', ["\U0001F642"], ["\U0001F650", "a"]),
    # a C comment ends at its first */
    ('start: C_COMMENT+\n%import common.C_COMMENT', ["/* a */", "/* a *//**/", "/***/"], ["/* a */ */", "/* a"]),
])
def test_lark_constructs(compiler, tok, grammar, good, bad):
    for text in good:
        assert _matches(compiler, tok, grammar, text), (grammar, text)
    for text in bad:
        assert not _matches(compiler, tok, grammar, text), (grammar, text)


@pytest.mark.parametrize("grammar, named", [
    ('start: A', "line 1: A is used but not defined"),
    ('start: "a"\n\nstart: "b"', "line 3: start is defined twice"),
    ('start: x{1}', "templates"),
    ('start: "a"\n%declare X', "line 2: %declare is not supported"),
    ('start: "a" /x/i', "regexp flags"),
    ('start: "a" &', "line 1: unexpected '&'"),
    ('%import foo.BAR\nstart: "a"', "line 1: only Lark's common terminals"),
    ('%import common.NOPE\nstart: "a"', "common.NOPE is not one of"),
    ('start: ("a"', "not closed"),
    ('start: "a"~3..2', "empty range"),
    ('start: "a"~-1', "empty range"),
    ('start: "ab".."c"', "two single characters"),
    ('start: /(?=a)a/', "lookaround"),
    ('start: "a" )', "unexpected ')'"),
    (r'start: "\u12"', r"line 1: \u12 is not a valid escape"),
    (r'start: "\ud800"', "not a valid escape"),
    ("start: " + "(" * 400 + '"a"' + ")" * 400, "nests too deeply"),
    ('start: start', "allows no first token"),
    ('start: "a"\n%ignore', "line 2: %ignore needs what to ignore"),
])
def test_what_cannot_be_translated_is_named(compiler, grammar, named):
    if "first token" not in named:   # (that one translates; the compiler finds it empty)
        with pytest.raises(ValueError, match=re.escape(named)):
            lark_to_ebnf(grammar)
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar is not valid: .*" + re.escape(named)):
        compiler.compile(SO(grammar=grammar))


def test_ignored_runs_match_in_linear_time(compiler, tok):
    """%ignore WS repeats WS's one character, not WS itself: (X+)* would split a run many ways."""
    grammar = 'start: "[" "1" "]"\n%import common.WS\n%ignore WS'
    assert "lark.ignore ::= ((lark.re" in lark_to_ebnf(grammar) and ")+)*" not in lark_to_ebnf(grammar)
    assert _matches(compiler, tok, grammar, "[" + " " * 2000 + "1 ]")


def test_only_what_the_start_rule_reaches_is_kept():
    ebnf = lark_to_ebnf('start: INT\n%import common.INT\n%import common.WS')
    names = {line.split(" ::= ")[0] for line in ebnf.splitlines()}
    assert names == {"root", "start", "INT", "common.INT", "common.DIGIT"}


def test_lark_grammars_end_to_end_with_speculation(spec_pair, baseline):
    """Outputs match the Lark grammar, and speculation keeps the non-speculative greedy ids."""
    grammar = 'start: "(" DIGIT~1..3 ")"\n%import common.DIGIT'
    spec = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=4, **FIXED, **SPEC_KV)
    params = [SamplingParams(temperature=t, max_tokens=24, seed=i, structured_outputs=SO(grammar=grammar))
              for i, t in enumerate((0.0, 0.0, 1.0))]
    prompts = ["The answer is", "x = ", "Hello"]
    outs = spec.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert re.fullmatch(r"\(\d{1,3}\)", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    ref = baseline.generate(prompts[:2], params[:2], use_tqdm=False)
    assert output_ids(outs[:2]) == output_ids(ref)

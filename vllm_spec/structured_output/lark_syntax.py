"""The syntax side of Lark grammars: lexing a grammar text into tokens grouped per definition or
directive, and the recursive-descent parser that turns one definition's right-hand side (alternatives,
repeats, names, strings with Lark's escapes and `i` flag, ranges, regexps) into EBNF. It holds the
names the parsed EBNF refers to (`lark.ignore`, renamed rules); what a grammar defines, imports and
ignores is kept by the translation in `lark.py`, which drives this parser.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_spec.structured_output.lark import Translation

_TOKEN = re.compile(r"""
    (?P<nl>\r?\n) | (?P<ws>[ \t\f]+) | (?P<comment>(?://|\#)[^\n]*)
    | (?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?) | (?P<regexp>/(?:[^/\\\n]|\\.)+/[a-z]*)
    | (?P<directive>%[a-z]+) | (?P<name>[A-Za-z_][A-Za-z0-9_]*) | (?P<number>-?[0-9]+)
    | (?P<op>->|\.\.|[:|()\[\]*+?~!.,{}])
""", re.VERBOSE)
IGNORE = "lark.ignore"   # the translation defines it from %ignore; the parser puts it before a rule's tokens


@dataclass
class Token:
    """One lexeme of a grammar text: its kind (the _TOKEN group it matched), text and line."""

    kind: str
    text: str
    line: int


def _tokens(text: str) -> list[Token]:
    tokens, line, pos = [], 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"line {line}: unexpected {text[pos]!r}")
        if m.lastgroup not in ("ws", "comment"):
            tokens.append(Token(m.lastgroup, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return tokens


def split_statements(text: str) -> list[list[Token]]:
    """A grammar text's tokens per definition or directive: a line that starts with `|` continues the one before."""
    tokens = _tokens(text)
    statements: list[list[Token]] = []
    for i, tok in enumerate(tokens):
        if tok.kind == "nl":
            continue
        if i == 0 or tokens[i - 1].kind == "nl":
            if not (tok.text == "|" and statements):
                statements.append([])
        statements[-1].append(tok)
    return statements


def is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def ebnf_name(name: str) -> str:
    return "lark.root" if name == "root" else name   # `root` is the EBNF's own start


class Expansions:
    """Recursive descent over one definition's right-hand side, writing EBNF as it goes."""

    def __init__(self, translation: Translation, tokens: list[Token], line: int, in_rule: bool):
        self.t, self.toks, self.pos, self.line, self.in_rule = translation, tokens, 0, line, in_rule

    def parse(self) -> str:
        out = self._alternatives()
        if self.pos < len(self.toks):
            tok = self.toks[self.pos]
            raise ValueError(f"line {tok.line}: unexpected {tok.text!r}")
        return out

    def _peek(self) -> Token | None:
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def _take(self, text: str) -> bool:
        tok = self._peek()
        if tok is not None and tok.kind == "op" and tok.text == text:
            self.pos += 1
            return True
        return False

    def _alternatives(self) -> str:
        alts = [self._sequence()]
        while self._take("|"):
            alts.append(self._sequence())
        return " | ".join(alts)

    def _sequence(self) -> str:
        items = []
        while (tok := self._peek()) is not None and not (tok.kind == "op" and tok.text in "|)]"):
            if self._take("->"):
                alias = self._peek()
                if alias is None or alias.kind != "name":
                    raise ValueError(f"line {self.line}: expected a name after '->'")
                self.pos += 1
                continue
            items.append(self._repeated())
        return " ".join(items) if items else '""'

    def _repeated(self) -> str:
        atom = self._atom()
        tok = self._peek()
        if tok is not None and tok.kind == "op" and tok.text in "*+?":
            self.pos += 1
            return f"({atom}){tok.text}"
        if self._take("~"):
            low = self._number()
            high = self._number() if self._take("..") else low
            if not 0 <= low <= high:
                raise ValueError(f"line {self.line}: ~{low}..{high} is an empty range")
            return f"({atom}){{{low},{high}}}"
        return atom

    def _number(self) -> int:
        tok = self._peek()
        if tok is None or tok.kind != "number":
            raise ValueError(f"line {self.line}: expected a number after '~' or '..'")
        self.pos += 1
        return int(tok.text)

    def _atom(self) -> str:
        tok = self._peek()
        self.pos += 1
        if tok.kind == "op" and tok.text in "([":
            inner = self._alternatives()
            close = ")" if tok.text == "(" else "]"
            if not self._take(close):
                raise ValueError(f"line {tok.line}: {tok.text!r} is not closed")
            return f"({inner})" if close == ")" else f"({inner})?"
        if tok.kind == "name":
            if self._peek() is not None and self._peek().text == "{":
                raise ValueError(f"line {tok.line}: templates ({tok.text}{{...}}) are not supported")
            name = self.t.prefix + tok.text
            self.t.used.setdefault(name, tok.line)
            return self._token(ebnf_name(name), is_terminal(tok.text))
        if tok.kind == "string":
            text = self._literal(tok)
            if self._take(".."):
                end = self._peek()
                if end is None or end.kind != "string":
                    raise ValueError(f"line {tok.line}: expected a string after '..'")
                self.pos += 1
                low, high = text, self._literal(end)
                if len(low) != 1 or len(high) != 1 or low > high:
                    raise ValueError(f"line {tok.line}: a range needs two single characters in order")
                return self._token(f"[{_class_char(low)}-{_class_char(high)}]")
            if tok.text.endswith("i"):
                parts = [_any_case(c) for c in text]
                return self._token("(" + " ".join(parts) + ")" if parts else '""')
            return self._token(_string(text))
        if tok.kind == "regexp":
            return self._token(self.t.regexp_rule(tok))
        raise ValueError(f"line {tok.line}: unexpected {tok.text!r}")

    def _token(self, ebnf: str, terminal: bool = True) -> str:
        # With %ignore, what it ignores may come before any token of a rule (and ends the root).
        return f"{IGNORE} {ebnf}" if terminal and self.in_rule and self.t.ignores_apply else ebnf

    @staticmethod
    def _literal(tok: Token) -> str:
        quote = tok.text[0]   # "..." (Lark's) or '...' (vLLM's conversion takes them too)
        return _unescape(tok.text[1: tok.text.rindex(quote)], tok.line, quote)



def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _class_char(ch: str) -> str:
    if ch in "]\\^-":
        return "\\" + ch
    if ch.isprintable():
        return ch
    return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"


@cache
def _case_twins() -> dict[str, str]:
    """Characters by their lowercase (one character), for the `i` flag: K and the Kelvin sign for k."""
    twins: dict[str, str] = {}
    for code in range(0x1E950):   # (no character past the Adlam block has a case)
        ch = chr(code)
        low = ch.lower()
        if len(low) == 1:
            twins[low] = twins.get(low, low) + ch if ch != low else twins.get(low, low)
    return twins


def _any_case(ch: str) -> str:
    """EBNF for one character of an `i` string: it and the characters with its lowercase."""
    low = ch.lower()
    variants = sorted(set(ch + (_case_twins().get(low, "") if len(low) == 1 else "")))
    return _string(ch) if len(variants) == 1 else "[" + "".join(_class_char(v) for v in variants) + "]"

_CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "\\": "\\"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


def _unescape(body: str, line: int, quote: str = '"') -> str:
    """A Lark string's text: \\n \\t \\r \\f \\\\, its quote and \\x.. \\u.... \\U........ are escapes; a
    backslash before any other character stays a backslash (Lark's rule, not Python's)."""
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\" or i + 1 == len(body):
            out.append(ch)
            i += 1
            continue
        code = body[i + 1]
        if code in _CONTROL_ESCAPES or code == quote:
            out.append(_CONTROL_ESCAPES.get(code, quote))
            i += 2
        elif code in _HEX_ESCAPES:
            digits = body[i + 2: i + 2 + _HEX_ESCAPES[code]]
            if len(digits) != _HEX_ESCAPES[code] or not all(c in string.hexdigits for c in digits) \
                    or not (int(digits, 16) <= 0x10FFFF and not 0xD800 <= int(digits, 16) <= 0xDFFF):
                raise ValueError(f"line {line}: \\{code}{digits} is not a valid escape")
            out.append(chr(int(digits, 16)))
            i += 2 + len(digits)
        else:
            out.append("\\")
            i += 1
    return "".join(out)

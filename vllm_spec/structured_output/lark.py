"""Lark grammars for structured outputs, translated to the EBNF that xgrammar compiles (vLLM's xgrammar
backend takes Lark grammars too).

Rules (lowercase names), terminals (uppercase), strings (with the `i` flag), regexps (without flags),
`"a".."z"` ranges, `[optional]`, `* + ?`, `~n` and `~m..n`, aliases (`-> name`, dropped: they only name
tree nodes), priorities, `?` / `!` / `_` prefixes, `%import common.NAME` (Lark's common terminals) and
`%ignore`. The start rule is `start`, else the first rule; strings unescape as Lark's, a regexp's `.`
excludes newlines and an `i` string's characters match those with the same lowercase. Lark's lexer picks one match per
terminal (the longest, or the shortest under a lazy repeat); the grammar here accepts every way of
cutting the text into terminals and reads lazy repeats as greedy, so it may let through a text that
Lark's parser would refuse (as vLLM's conversion does). What cannot be translated raises ValueError
naming the line.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from functools import cache, lru_cache

from vllm_spec.structured_output.enforceable import regex_problem

_TOKEN = re.compile(r"""
    (?P<nl>\r?\n) | (?P<ws>[ \t\f]+) | (?P<comment>(?://|\#)[^\n]*)
    | (?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?) | (?P<regexp>/(?:[^/\\\n]|\\.)+/[a-z]*)
    | (?P<directive>%[a-z]+) | (?P<name>[A-Za-z_][A-Za-z0-9_]*) | (?P<number>-?[0-9]+)
    | (?P<op>->|\.\.|[:|()\[\]*+?~!.,{}])
""", re.VERBOSE)
_DEFINITION = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?[0-9]+)?\s*:", re.MULTILINE)
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.\-]*\s*::=", re.MULTILINE)
_IGNORE = "lark.ignore"
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_.\-]*|.', re.DOTALL)

# Lark's common terminals (lark/grammars/common.lark), in Lark syntax; ESCAPED_STRING without its
# lookbehind (a string of non-newline characters whose closing quote is not escaped) and C_COMMENT
# without its lazy repeat (a comment ends at its first */).
_COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+" | "-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e" | "E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+" | "-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+" | "-"] NUMBER
ESCAPED_STRING: "\"" (/[^"\\\n]/ | "\\" /[^\n]/)* "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_" | LETTER) ("_" | LETTER | DIGIT)*
WS_INLINE: (" " | /\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
C_COMMENT: /\/\*[^*]*\*+([^\/*][^*]*\*+)*\//
SQL_COMMENT: /--[^\n]*/
"""


def is_lark(grammar: str) -> bool:
    """Whether a grammar text is Lark rather than EBNF (whose rules are `name ::= ...`)."""
    return _EBNF_RULE.search(grammar) is None and _DEFINITION.search(grammar) is not None


@lru_cache(maxsize=64)   # a request's grammar is checked by the server, then compiled by the engine
def lark_to_ebnf(grammar: str) -> str:
    """The EBNF (root rule `root`) for a Lark grammar; ValueError saying what and where otherwise."""
    try:
        return _Translation(grammar).ebnf()
    except RecursionError:
        raise ValueError("the Lark grammar nests too deeply") from None


@dataclass
class _Token:
    kind: str
    text: str
    line: int


def _tokens(text: str) -> list[_Token]:
    tokens, line, pos = [], 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"line {line}: unexpected {text[pos]!r}")
        if m.lastgroup not in ("ws", "comment"):
            tokens.append(_Token(m.lastgroup, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return tokens


def _statements(tokens: list[_Token]) -> list[list[_Token]]:
    """Tokens per definition or directive: a line that starts with `|` continues the one before."""
    statements: list[list[_Token]] = []
    for i, tok in enumerate(tokens):
        if tok.kind == "nl":
            continue
        if i == 0 or tokens[i - 1].kind == "nl":
            if not (tok.text == "|" and statements):
                statements.append([])
        statements[-1].append(tok)
    return statements


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _class_char(ch: str) -> str:
    if ch in "]\\^-":
        return "\\" + ch
    if ch.isprintable():
        return ch
    return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"


@dataclass
class _Translation:
    """One Lark grammar on its way to EBNF: its rules (user's, imported, regexps') and what they use."""

    source: str
    rules: dict[str, str] = field(default_factory=dict)   # name -> EBNF body
    ignores: list[str] = field(default_factory=list)
    used: dict[str, int] = field(default_factory=dict)   # name -> first line using it
    regexps: dict[str, str] = field(default_factory=dict)   # pattern -> its rule's name
    prefix: str = ""   # the namespace of the grammar being read ("" for the user's)
    ignores_apply: bool = False   # the grammar has %ignore (which may come after the rules it applies to)

    def ebnf(self) -> str:
        statements = _statements(_tokens(self.source))
        self.ignores_apply = any(s[0].text == "%ignore" for s in statements)
        self._read(statements)
        own = [name for name in self.rules if not name.startswith(("lark.", "common."))]
        if not own:
            raise ValueError("the Lark grammar defines no rule")
        for name, line in self.used.items():
            if name not in self.rules:
                raise ValueError(f"line {line}: {name} is used but not defined (or imported)")
        start = "start" if "start" in self.rules else next((n for n in own if not _is_terminal(n)), own[0])
        bodies = {"root": self._ref(start) + (f" {_IGNORE}" if self.ignores else "")}
        if self.ignores:
            # (X+)* is ambiguous (a run of ignored text splits many ways), which slows matching down
            # past linear: the repeat of an ignored X+ is (X)*.
            bodies[_IGNORE] = f"({' | '.join(self._unrepeated(item) for item in self.ignores)})*"
        bodies.update((self._ref(name), body) for name, body in self.rules.items())
        # Only what the start rule reaches (imports bring all of Lark's common terminals).
        reached, todo = set(), ["root"]
        while todo:
            name = todo.pop()
            if name not in reached:
                reached.add(name)
                todo += [t for t in _EBNF_TOKEN.findall(bodies[name]) if t in bodies]
        return "\n".join(f"{name} ::= {body}" for name, body in bodies.items() if name in reached)

    def _unrepeated(self, item: str) -> str:
        """An ignored item's X where it is (a name for) `(X)+`, else the item."""
        while item in self.rules:
            item = self.rules[item]
        tokens = _EBNF_TOKEN.findall(item)
        if len(tokens) < 3 or tokens[0] != "(" or tokens[-2:] != [")", "+"]:
            return item
        depth = 0
        for i, token in enumerate(tokens[:-1]):
            depth += (token == "(") - (token == ")")
            if depth == 0 and i < len(tokens) - 2:
                return item   # (A)(B)+: not one group
        return "".join(tokens[:-1])

    @staticmethod
    def _ref(name: str) -> str:
        return "lark.root" if name == "root" else name   # `root` is the EBNF's own start

    def _read(self, statements: list[list[_Token]]) -> None:
        for statement in statements:
            head = statement[0]
            if head.kind == "directive":
                self._directive(statement)
            else:
                self._definition(statement)

    def _definition(self, statement: list[_Token]) -> None:
        toks = [t for t in statement if not (t.kind == "op" and t.text in "?!" and t is statement[0])]
        if not toks or toks[0].kind != "name":
            raise ValueError(f"line {statement[0].line}: expected a rule or terminal definition, got "
                             f"{statement[0].text!r}")
        name, line, pos = self.prefix + toks[0].text, toks[0].line, 1
        if pos < len(toks) and toks[pos].text == "{":
            raise ValueError(f"line {line}: templates ({toks[0].text}{{...}}) are not supported")
        if pos + 1 < len(toks) and toks[pos].text == "." and toks[pos + 1].kind == "number":
            pos += 2   # a priority: it orders Lark's lexer, not the language
        if pos >= len(toks) or toks[pos].text != ":":
            raise ValueError(f"line {line}: expected ':' after {toks[0].text}")
        if name in self.rules:
            raise ValueError(f"line {line}: {toks[0].text} is defined twice")
        parser = _Expansions(self, toks[pos + 1:], line, in_rule=not _is_terminal(toks[0].text))
        self.rules[name] = parser.parse()

    def _directive(self, statement: list[_Token]) -> None:
        head, rest = statement[0], statement[1:]
        if head.text == "%ignore":
            if not rest:
                raise ValueError(f"line {head.line}: %ignore needs what to ignore (e.g. %ignore WS)")
            parser = _Expansions(self, rest, head.line, in_rule=False)
            self.ignores.append(parser.parse())
        elif head.text == "%import":
            self._import(rest, head.line)
        else:
            raise ValueError(f"line {head.line}: {head.text} is not supported (only %import common and %ignore)")

    def _import(self, rest: list[_Token], line: int) -> None:
        text = "".join(t.text if t.kind != "op" or t.text not in ("->", ",") else f" {t.text} " for t in rest)
        m = re.fullmatch(r"common\.([A-Z_]+)(?:\s*->\s*([A-Za-z_]\w*))?|common\s*\(([\w\s,]+)\)", text.strip())
        if m is None:
            raise ValueError(f"line {line}: only Lark's common terminals can be imported "
                             f"(%import common.NAME, %import common.NAME -> ALIAS, %import common (A, B))")
        pairs = [(m.group(1), m.group(2) or m.group(1))] if m.group(1) else \
            [(n.strip(), n.strip()) for n in m.group(3).split(",") if n.strip()]
        for name, alias in pairs:
            if name not in _common_names():
                raise ValueError(f"line {line}: common.{name} is not one of Lark's common terminals "
                                 f"({', '.join(sorted(_common_names()))})")
            if alias in self.rules:
                raise ValueError(f"line {line}: {alias} is defined twice")
            self._load_common()
            self.rules[alias] = f"common.{name}"

    def _load_common(self) -> None:
        if "common.DIGIT" in self.rules:
            return
        outer, self.prefix = self.prefix, "common."
        try:
            self._read(_statements(_tokens(_COMMON)))
        finally:
            self.prefix = outer

    def regexp_rule(self, token: _Token) -> str:
        """The rule matching a `/pattern/` (one per distinct pattern), from xgrammar's own translation."""
        body, flags = token.text[1:].rsplit("/", 1)
        if flags:
            raise ValueError(f"line {token.line}: regexp flags ({flags}) are not supported: write the pattern "
                             "without them (e.g. [aA] for a case-insensitive a)")
        pattern = _lark_dots(body.replace("\\/", "/"))
        if pattern in self.regexps:
            return self.regexps[pattern]
        problem = regex_problem(pattern)
        if problem:
            raise ValueError(f"line {token.line}: /{body}/ cannot be enforced: {problem}")
        import xgrammar
        try:
            ebnf = str(xgrammar.Grammar.from_regex(pattern))
        except RuntimeError as e:
            raise ValueError(f"line {token.line}: /{body}/ is not a valid regexp: {e}") from None
        name = self.regexps[pattern] = f"lark.re{len(self.regexps)}"
        renamed = "".join(name + t[4:] if re.fullmatch(r"root(_\w+)?", t) else t for t in _EBNF_TOKEN.findall(ebnf))
        for line in renamed.strip().splitlines():
            rule, body_text = line.split(" ::= ", 1)
            self.rules[rule] = body_text
        return name


def _lark_dots(pattern: str) -> str:
    """The pattern with Python's `.` (anything but a newline) for xgrammar's (anything)."""
    out, class_start, i = [], None, 0   # class_start: where the open [...] begins (its ] may come first)
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i: i + 2])
            i += 2
            continue
        if class_start is not None:
            first = class_start + 1 + (pattern[class_start + 1: class_start + 2] == "^")
            if ch == "]" and i > first:
                class_start = None
        elif ch == "[":
            class_start = i
        out.append("[^\\n]" if ch == "." and class_start is None else ch)
        i += 1
    return "".join(out)


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


@cache
def _common_names() -> frozenset[str]:
    return frozenset(m.group(1) for m in re.finditer(r"^([A-Z][A-Z_]*):", _COMMON, re.MULTILINE))


class _Expansions:
    """Recursive descent over one definition's right-hand side, writing EBNF as it goes."""

    def __init__(self, translation: _Translation, tokens: list[_Token], line: int, in_rule: bool):
        self.t, self.toks, self.pos, self.line, self.in_rule = translation, tokens, 0, line, in_rule

    def parse(self) -> str:
        out = self._alternatives()
        if self.pos < len(self.toks):
            tok = self.toks[self.pos]
            raise ValueError(f"line {tok.line}: unexpected {tok.text!r}")
        return out

    def _peek(self) -> _Token | None:
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
            return self._token(_Translation._ref(name), _is_terminal(tok.text))
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
        return f"{_IGNORE} {ebnf}" if terminal and self.in_rule and self.t.ignores_apply else ebnf

    @staticmethod
    def _literal(tok: _Token) -> str:
        quote = tok.text[0]   # "..." (Lark's) or '...' (vLLM's conversion takes them too)
        return _unescape(tok.text[1: tok.text.rindex(quote)], tok.line, quote)


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

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

import re
from dataclasses import dataclass, field
from functools import cache, lru_cache

from vllm_spec.structured_output.enforceable import regex_problem
from vllm_spec.structured_output.lark_syntax import IGNORE, Expansions, Token, ebnf_name, is_terminal, split_statements

_DEFINITION = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?[0-9]+)?\s*:", re.MULTILINE)
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.\-]*\s*::=", re.MULTILINE)
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
        return Translation(grammar).ebnf()
    except RecursionError:
        raise ValueError("the Lark grammar nests too deeply") from None


@dataclass
class Translation:
    """One Lark grammar on its way to EBNF: its rules (user's, imported, regexps') and what they use."""

    source: str
    rules: dict[str, str] = field(default_factory=dict)   # name -> EBNF body
    ignores: list[str] = field(default_factory=list)
    used: dict[str, int] = field(default_factory=dict)   # name -> first line using it
    regexps: dict[str, str] = field(default_factory=dict)   # pattern -> its rule's name
    prefix: str = ""   # the namespace of the grammar being read ("" for the user's)
    ignores_apply: bool = False   # the grammar has %ignore (which may come after the rules it applies to)

    def ebnf(self) -> str:
        statements = split_statements(self.source)
        self.ignores_apply = any(s[0].text == "%ignore" for s in statements)
        self._read(statements)
        own = [name for name in self.rules if not name.startswith(("lark.", "common."))]
        if not own:
            raise ValueError("the Lark grammar defines no rule")
        for name, line in self.used.items():
            if name not in self.rules:
                raise ValueError(f"line {line}: {name} is used but not defined (or imported)")
        start = "start" if "start" in self.rules else next((n for n in own if not is_terminal(n)), own[0])
        bodies = {"root": ebnf_name(start) + (f" {IGNORE}" if self.ignores else "")}
        if self.ignores:
            # (X+)* is ambiguous (a run of ignored text splits many ways), which slows matching down
            # past linear: the repeat of an ignored X+ is (X)*.
            bodies[IGNORE] = f"({' | '.join(self._unrepeated(item) for item in self.ignores)})*"
        bodies.update((ebnf_name(name), body) for name, body in self.rules.items())
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

    def _read(self, statements: list[list[Token]]) -> None:
        for statement in statements:
            head = statement[0]
            if head.kind == "directive":
                self._directive(statement)
            else:
                self._definition(statement)

    def _definition(self, statement: list[Token]) -> None:
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
        parser = Expansions(self, toks[pos + 1:], line, in_rule=not is_terminal(toks[0].text))
        self.rules[name] = parser.parse()

    def _directive(self, statement: list[Token]) -> None:
        head, rest = statement[0], statement[1:]
        if head.text == "%ignore":
            if not rest:
                raise ValueError(f"line {head.line}: %ignore needs what to ignore (e.g. %ignore WS)")
            parser = Expansions(self, rest, head.line, in_rule=False)
            self.ignores.append(parser.parse())
        elif head.text == "%import":
            self._import(rest, head.line)
        else:
            raise ValueError(f"line {head.line}: {head.text} is not supported (only %import common and %ignore)")

    def _import(self, rest: list[Token], line: int) -> None:
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
            self._read(split_statements(_COMMON))
        finally:
            self.prefix = outer

    def regexp_rule(self, token: Token) -> str:
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
def _common_names() -> frozenset[str]:
    return frozenset(m.group(1) for m in re.finditer(r"^([A-Z][A-Z_]*):", _COMMON, re.MULTILINE))


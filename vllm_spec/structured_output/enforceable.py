"""What xgrammar can enforce. It accepts some JSON-schema keywords and regex constructs that it then
ignores (at most a C++ warning), so an output could break them and still finish with "stop": those
are refused here, with a ValueError saying what, before compiling (as vLLM refuses xgrammar's
unsupported features)."""

from __future__ import annotations

from typing import Any

# Keywords xgrammar accepts but does not enforce.
_UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "allOf", "not", "if", "then", "else",
                        "dependentRequired", "dependentSchemas")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")


# Anchors xgrammar does not know: it matches the escaped letter itself (\b and \B it refuses).
_ANCHOR_ESCAPES = ("A", "Z", "z", "G")


def regex_problem(pattern: str) -> str | None:
    """Why xgrammar would not enforce this regex as written (None: it would): lookarounds, ^ or $ inside
    the pattern, anchors it reads as letters (\\A, \\Z, \\z, \\G), surrogate escapes (no UTF-8 text
    matches them)."""
    in_class, i = False, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            escape = pattern[i + 1: i + 6]
            if escape[:1] in ("u", "U") and len(escape) == 5 and escape[1:2] in "dD" and escape[2:3] in "89abcdefABCDEF":
                return f"it escapes a UTF-16 surrogate (\\{escape}), which no text contains"
            if not in_class and escape[:1] in _ANCHOR_ESCAPES:
                return f"it uses \\{escape[0]}, which xgrammar would match as the letter {escape[0]}"
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return "it uses a lookaround"
        elif ch == "^" and i > 0:
            return "it has ^ after its start"
        elif ch == "$" and i < len(pattern) - 1:
            return "it has $ before its end"
        i += 1
    return None


def _inline_single_all_of(node: dict[str, Any]) -> dict[str, Any]:
    """{"allOf": [X], ...annotations} is X with the annotations (pydantic writes it around a $ref)."""
    parts = node.get("allOf")
    if isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict):
        return {**{k: v for k, v in node.items() if k != "allOf"}, **parts[0]}
    return node


def _node_problem(node: dict[str, Any]) -> str | None:
    unenforced = [k for k in _UNENFORCED_KEYWORDS if k in node]
    if unenforced:
        return f"it uses {unenforced}"
    if "multipleOf" in node and node.get("type") != "integer":
        return "it uses multipleOf on non-integers"
    if isinstance(node.get("pattern"), str):
        if "minLength" in node or "maxLength" in node:
            return "it bounds the length of a string that has a pattern (put the bounds in the pattern)"
        problem = regex_problem(node["pattern"])
        if problem:
            return f"its pattern {node['pattern']!r}: {problem}"
    required, properties = node.get("required"), node.get("properties") or {}
    others_allowed = node.get("additionalProperties", False) is not False or node.get("patternProperties")
    if isinstance(required, list) and not others_allowed:   # (xgrammar's strict mode: none unless allowed)
        missing = [r for r in required if r not in properties]
        if missing:
            return f"it requires {missing}, which are not among its properties (no other property is allowed)"
    return None


def enforceable_schema(node: Any) -> Any:
    """The schema with one-part allOfs inlined; ValueError saying what xgrammar would not enforce."""
    if not isinstance(node, dict):
        return node
    node = _inline_single_all_of(node)
    problem = _node_problem(node)
    if problem:
        raise ValueError(f"the schema cannot be enforced by the xgrammar backend: {problem}.")
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: enforceable_schema(sub) for name, sub in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [enforceable_schema(sub) for sub in node[key]]
    for key in _SCHEMA_VALUES:
        if key in node:
            out[key] = enforceable_schema(node[key])
    return out


def check_structural_tag(tag: Any) -> None:
    """The JSON schemas a structural tag holds (in either of its forms) must be enforceable too."""
    if isinstance(tag, dict):
        for key, value in tag.items():
            if key in ("schema", "json_schema") and isinstance(value, dict):
                enforceable_schema(value)
            else:
                check_structural_tag(value)
    elif isinstance(tag, list):
        for item in tag:
            check_structural_tag(item)

"""What xgrammar can enforce. It accepts some JSON-schema keywords and regex constructs that it then
ignores (at most a C++ warning), so an output could break them and still finish with "stop": those
are refused here, with a ValueError saying what, before compiling (as vLLM refuses xgrammar's
unsupported features)."""

from __future__ import annotations

import json
from typing import Any

# Keywords xgrammar accepts but does not enforce.
_UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "allOf", "not", "if", "then", "else",
                        "dependentRequired", "dependentSchemas")
_STRING_BOUNDS = ("minLength", "maxLength")
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


def _node_problem(node: dict[str, Any], root: Any, key: bool) -> str | None:
    """What xgrammar would not enforce at this node (None: nothing). `key`: the node constrains property
    names (strings without saying so)."""
    unenforced = [k for k in _UNENFORCED_KEYWORDS if k in node]
    if unenforced:
        return f"it uses {unenforced}"
    if "multipleOf" in node and node.get("type") != "integer":
        return "it uses multipleOf on non-integers"
    bounds = [k for k in _STRING_BOUNDS if k in node]
    if bounds and "format" in node:
        return f"it bounds the length of a string with a format ({bounds}; xgrammar ignores them there)"
    if bounds and ("enum" in node or "const" in node):
        return f"it bounds the length of an enum or const ({bounds}; list only the values that fit)"
    if (not key and "type" not in node and ("pattern" in node or bounds)
            and not any(k in node for k in ("enum", "const", "$ref", "anyOf", "oneOf"))):
        return 'it constrains strings (pattern, minLength, maxLength) without "type": "string" (xgrammar then ignores them)'
    if isinstance(node.get("pattern"), str):
        if bounds:
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
    branches = node.get("oneOf")
    if isinstance(branches, list) and not all(
            _disjoint(a, b, root) for i, a in enumerate(branches) for b in branches[i + 1:]):
        return ("it uses oneOf with branches that may overlap (xgrammar enforces them as anyOf): use anyOf, or "
                "branches that differ in type, const / enum, or a required property's const / enum")
    return None


# A structural tag's schemas compile inside xgrammar with the tokenizer (no grammar text to mend): their
# strings' length bounds go in as a pattern there, whose compile time grows with the square of the bound.
_PATTERN_BOUND_MAX = 1024


def _length_as_pattern(node: dict[str, Any], key: bool) -> dict[str, Any]:
    """A string's length bounds as its pattern (in a structural tag: see grammar._json_schema_grammar for
    what xgrammar's own bounded strings let through), whose rule keeps JSON's characters."""
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    is_string = key or "string" in (_types(node) or ())
    if (not is_string or "pattern" in node or not any(k in node for k in _STRING_BOUNDS)
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in (lo, 0 if hi is None else hi))):
        return node
    if max(lo, hi or 0) > _PATTERN_BOUND_MAX:
        raise ValueError(f"the schema cannot be enforced by the xgrammar backend: in a structural tag, string length "
                         f"bounds above {_PATTERN_BOUND_MAX} are not supported (minLength {lo}, maxLength {hi}).")
    out = {k: v for k, v in node.items() if k not in _STRING_BOUNDS}
    out["pattern"] = f"^[\\s\\S]{{{lo},{'' if hi is None else hi}}}$"
    return out


def _resolve(node: Any, root: Any) -> Any:
    """A local $ref's target ("#/$defs/X", "#/definitions/X"); the node itself otherwise."""
    for _ in range(32):   # a chain of refs, not a cycle
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return node
        target = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node = target
    return node


def _values(node: dict[str, Any]) -> list | None:
    """The values a const / enum allows (None: not limited so)."""
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def _json_key(value: Any) -> str:
    """Equal JSON values, equal keys (1, 1.0 and -0.0 vs 0 are one number, at any depth; true is not 1)."""
    return json.dumps(_canonical(value), sort_keys=True)


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):   # (tagged: "1" the string is not 1)
        return ["n", value]
    if isinstance(value, float):
        return ["n", int(value) if value.is_integer() else value]   # 1.0 is 1, -0.0 is 0
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return repr(value)


def _types(node: dict[str, Any]) -> set[str] | None:
    types = node.get("type")
    if isinstance(types, str):
        return {types}
    return set(types) if isinstance(types, list) else None


def _disjoint(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    """Provably no output xgrammar lets one schema produce matches the other: their types differ
    (integers are numbers), their const / enum values differ, each requires a property the other's
    objects never have, or a property both require has disjoint schemas (a discriminator)."""
    a, b = _resolve(a, root), _resolve(b, root)
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 8:
        return False
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None:
        ta = ta | {"integer"} if "number" in ta else ta
        tb = tb | {"integer"} if "number" in tb else tb
        if not ta & tb:
            return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not {_json_key(v) for v in va} & {_json_key(v) for v in vb}:
        return True
    if ta != {"object"} or tb != {"object"}:   # (required and properties say nothing of other values)
        return False
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    ra, rb = set(a.get("required") or []), set(b.get("required") or [])
    if _lacks(a, rb) and _lacks(b, ra):   # each output lacks a property the other branch requires
        return True
    return any(name in pa and name in pb and _disjoint(pa[name], pb[name], root, depth + 1) for name in sorted(ra & rb))


def _lacks(node: dict[str, Any], required: set[str]) -> bool:
    """Every object xgrammar lets this node produce lacks one of `required`: one is not among its
    properties, and it allows no others (xgrammar's strict mode, unless additional or pattern
    properties say otherwise)."""
    closed = (node.get("additionalProperties", False) is False and node.get("unevaluatedProperties", False) is False
              and not node.get("patternProperties"))
    return closed and bool(required - set(node.get("properties") or {}))


def enforceable_schema(schema: Any, bounds_as_pattern: bool = False) -> Any:
    """The schema as xgrammar should compile it (one-part allOfs inlined; with bounds_as_pattern, string
    length bounds as patterns); ValueError saying what xgrammar would not enforce."""

    def walk(node: Any, key: bool = False) -> Any:
        if not isinstance(node, dict):
            return node
        node = _inline_single_all_of(node)
        problem = _node_problem(node, schema, key)
        if problem:
            raise ValueError(f"the schema cannot be enforced by the xgrammar backend: {problem}.")
        out = _length_as_pattern(node, key) if bounds_as_pattern else dict(node)
        for name in _SCHEMA_MAPS:
            if isinstance(node.get(name), dict):
                out[name] = {k: walk(sub) for k, sub in node[name].items()}
        for name in _SCHEMA_LISTS:
            if isinstance(node.get(name), list):
                out[name] = [walk(sub) for sub in node[name]]
        for name in _SCHEMA_VALUES:
            if name in node:
                out[name] = walk(node[name], key=name == "propertyNames")
        return out

    return walk(schema)


def enforceable_structural_tag(tag: Any) -> Any:
    """The structural tag (either form) with each JSON schema it holds as enforceable_schema gives it."""
    if isinstance(tag, dict):
        return {key: enforceable_schema(value, bounds_as_pattern=True)
                if key in ("schema", "json_schema") and isinstance(value, dict)
                else enforceable_structural_tag(value) for key, value in tag.items()}
    if isinstance(tag, list):
        return [enforceable_structural_tag(item) for item in tag]
    return tag

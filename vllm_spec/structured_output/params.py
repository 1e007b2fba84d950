"""StructuredOutputsParams: what a request's output must match, with vLLM's names."""

from __future__ import annotations

import json as json_lib
from dataclasses import dataclass, fields
from typing import NoReturn

from vllm_spec.utils import check_text

# The constraint kinds, of which a request sets exactly one (vLLM's fields).
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _fail(name: str, allowed: str, value: object) -> NoReturn:
    raise ValueError(f"structured_outputs.{name} must be {allowed}, got {value!r}.")


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _json_text(name: str, value: object) -> str:
    """A JSON schema or structural tag as JSON text (a dict, a pydantic model class, or text)."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        value = value.model_json_schema()
    if isinstance(value, str):
        check_text(f"structured_outputs.{name}", value)
        try:
            value = json_lib.loads(value, parse_constant=_no_constant)
        except (json_lib.JSONDecodeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}.") from None
    if not isinstance(value, dict):
        kinds = "a dict, its JSON text, or a pydantic model class" if name == "json" else "a dict or its JSON text"
        _fail(name, f"a JSON object ({kinds})", value)
    try:
        # Not sorted: xgrammar (as vLLM's) writes an object's properties in the order the schema declares.
        return json_lib.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{name} cannot be written as JSON: {e}.") from None


@dataclass
class StructuredOutputsParams:
    """The output must match exactly one of: `json` (a JSON schema: a dict, its text or a pydantic
    model class), `regex`, `choice` (one of these strings), `grammar` (EBNF, as xgrammar reads it),
    `json_object` (any JSON object) or `structural_tag` (xgrammar's structural tag, as JSON).

    disable_any_whitespace: JSON without free whitespace between its tokens. Additional properties
    are never allowed where a schema does not allow them (xgrammar's strict mode), so
    disable_additional_properties changes nothing here. whitespace_pattern (another backend's
    option in vLLM) is refused.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None

    @classmethod
    def from_dict(cls, value: object, name: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a request's JSON object, unknown keys named."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object with one of {list(KINDS)}, got {value!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{name} has unknown fields {unknown}; allowed: {sorted(known)}.")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        if self.json is not None:
            self.json = _json_text("json", self.json)
        if self.structural_tag is not None:
            self.structural_tag = _json_text("structural_tag", self.structural_tag)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                _fail(name, "a non-empty string", value)
            check_text(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                _fail("choice", "a non-empty list of non-empty strings", self.choice)
            self.choice = list(self.choice)
            check_text("structured_outputs.choice", self.choice)
        if self.json_object not in (None, True):
            _fail("json_object", "True, False or None", self.json_object)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "True or False", getattr(self, name))
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (it is not an option of "
                             "xgrammar, the backend here); use disable_any_whitespace=True for compact JSON.")
        chosen = [k for k in KINDS if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {list(KINDS)}, got "
                             f"{chosen or 'none'}.")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

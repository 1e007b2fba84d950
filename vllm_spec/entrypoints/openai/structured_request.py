"""A request's structured-output constraint: from response_format, vLLM's structured_outputs, or the
guided_* fields vLLM had before 0.12, each refusal naming the field it came from."""

from __future__ import annotations

import json
from typing import Any

from vllm_spec.sampling_params import StructuredOutputsParams

# vLLM's fields before 0.12 (then renamed into structured_outputs): still understood here.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


class ConstraintError(ValueError):
    """A refused constraint, and the request field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or fmt.get("type", "text") not in _RESPONSE_FORMATS:
        raise ValueError(f"response_format must be an object whose type is one of {list(_RESPONSE_FORMATS)}, "
                         f"got {fmt!r}.")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":   # as vLLM: the whole object is the tag
        return StructuredOutputsParams(structural_tag=json.dumps(fmt))
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError('response_format of type "json_schema" needs "json_schema": {"name": ..., '
                         f'"schema": {{...}}}}, got {fmt!r}.')
    return StructuredOutputsParams(json=spec["schema"])


def structured_outputs_of(response_format: Any, structured_outputs: Any,
                          extras: dict[str, Any]) -> tuple[StructuredOutputsParams, str] | None:
    """The one constraint a request sets and the field it came in (None: none); ConstraintError naming
    the field otherwise."""
    given: list[tuple[str, Any]] = []
    if response_format is not None:
        given.append(("response_format", lambda: _from_response_format(response_format)))
    if structured_outputs is not None:
        given.append(("structured_outputs", lambda: StructuredOutputsParams.from_dict(structured_outputs)))
    for name, kind in _GUIDED.items():
        if extras.get(name) is not None:
            given.append((name, lambda kind=kind, name=name: StructuredOutputsParams(**{kind: extras[name]})))
    built = []
    for name, build in given:
        try:
            params = build()
        except (ValueError, TypeError) as e:
            raise ConstraintError(str(e), name) from e
        if params is not None:
            built.append((name, params))
    if len(built) > 1:
        names = [name for name, _ in built]
        raise ConstraintError(f"set only one of {names}: each constrains the output.", names[1])
    return (built[0][1], built[0][0]) if built else None

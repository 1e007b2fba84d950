"""A request's structured-output constraint: from response_format, vLLM's structured_outputs, the
guided_* fields vLLM had before 0.12, or a forced tool choice, each refusal naming the field it came
from. structured_outputs holding only options (e.g. disable_any_whitespace) applies them to the
constraint another field sets, as vLLM folds response_format into it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from vllm_spec.sampling_params import StructuredOutputsParams
from vllm_spec.structured_output.params import KINDS

# vLLM's fields before 0.12 (then renamed into structured_outputs): still understood here.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


class ConstraintError(ValueError):
    """A refused constraint, and the request field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    """As OpenAI's (and vLLM's) models: "type" is required; a json_schema needs its "name" and "schema"."""
    if not isinstance(fmt, dict) or fmt.get("type") not in _RESPONSE_FORMATS:
        raise ValueError(f"response_format must be an object whose type is one of {list(_RESPONSE_FORMATS)}, "
                         f"got {fmt!r}.")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":   # as vLLM: the whole object is the tag
        return StructuredOutputsParams(structural_tag=json.dumps(fmt))
    spec = fmt.get("json_schema")
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("schema"), dict)):
        raise ValueError('response_format of type "json_schema" needs "json_schema": {"name": <string>, '
                         f'"schema": {{...}}}}, got {fmt!r}.')
    return StructuredOutputsParams(json=spec["schema"])


def structured_outputs_of(response_format: Any, structured_outputs: Any, extras: dict[str, Any],
                          forced: tuple[Callable[[], StructuredOutputsParams | None], str] | None = None
                          ) -> tuple[StructuredOutputsParams, str] | None:
    """The one constraint a request sets and the field it came in (None: none); ConstraintError naming
    the field otherwise. forced: a forced tool choice's constraint (built on demand) and its field."""
    options: dict[str, Any] = {}
    if isinstance(structured_outputs, dict) and not any(structured_outputs.get(k) is not None for k in KINDS):
        options, structured_outputs = structured_outputs, None
    given: list[tuple[str, Callable[[], StructuredOutputsParams | None]]] = []
    if response_format is not None:
        given.append(("response_format", lambda: _from_response_format(response_format)))
    if structured_outputs is not None:
        given.append(("structured_outputs", lambda: StructuredOutputsParams.from_dict(structured_outputs)))
    for name, kind in _GUIDED.items():
        if extras.get(name) is not None:
            given.append((name, lambda kind=kind, name=name: StructuredOutputsParams(**{kind: extras[name]})))
    if forced is not None:
        given.append((forced[1], forced[0]))
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
        raise ConstraintError(f"set only one of {names}: each constrains the output.", names[-1])
    if options:
        if not built:
            raise ConstraintError(f"structured_outputs must set exactly one of {list(KINDS)}, got only options "
                                  f"{sorted(options)}.", "structured_outputs")
        name, params = built[0]
        try:
            built = [(name, StructuredOutputsParams.from_dict({**_constraint_fields(params), **options}))]
        except (ValueError, TypeError) as e:
            raise ConstraintError(str(e), "structured_outputs") from e
    return built[0][::-1] if built else None


def _constraint_fields(params: StructuredOutputsParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}

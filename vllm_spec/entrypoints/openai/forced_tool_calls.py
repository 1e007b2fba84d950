"""tool_choice "required" or a named function, as vLLM serves them: the output is constrained by
structured outputs to the calls' JSON (a named function: its arguments; "required": a list of
{"name", "parameters"}) and read back as tool calls. No tool-call parser is needed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_spec.entrypoints.openai.tool_calls import ParsedCall
from vllm_spec.sampling_params import StructuredOutputsParams


def _tool_name(tool_choice: Any) -> str | None:
    """The function a named tool_choice forces ({"type": "function", "function": {"name": ...}}), else None."""
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        return tool_choice["function"]["name"]
    return None


def check_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> None:
    """ValueError naming tool_choice unless it is "none", "auto", "required" or a given function by name."""
    if tool_choice in (None, "none", "auto", "required"):
        return
    name = _tool_name(tool_choice)
    if name is None:
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         f'{{"name": <string>}}}}, got {tool_choice!r}.')
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools {names}.")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters schema; none (or {}) takes an object, as vLLM's."""
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}


def _required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A list of one or more {"name", "parameters"} calls of the tools. Their parameters' $defs move to
    the root, where their "#/$defs/..." references (pydantic writes them) still resolve."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define the $defs entry {name!r} differently: rename one of them.")
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


def forced_constraint(tool_choice: Any, tools: list[dict[str, Any]] | None) -> StructuredOutputsParams | None:
    """The constraint that makes the output the forced calls' JSON (None: tool_choice forces none)."""
    if tool_choice == "required":
        return StructuredOutputsParams(json=_required_schema(tools or []))
    name = _tool_name(tool_choice)
    if name is None:
        return None
    return StructuredOutputsParams(json=_parameters(next(t for t in tools or [] if t["function"]["name"] == name)))


@dataclass
class ForcedToolCalls:
    """One choice's constrained output read back as tool calls (name: the named function; None:
    "required"). Streamed, the text is held and the calls come whole when the choice ends; an output
    that does not parse (cut by max_tokens) stays content."""

    name: str | None
    text: str = ""
    num_calls: int = 0

    @property
    def reports_calls(self) -> bool:
        """As vLLM: "required" ends with finish_reason "tool_calls"; a named function with the model's own."""
        return self.name is None

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.text += delta
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of the whole text: the calls, or the text as content when it does not parse."""
        try:
            value = json.loads(self.text)
        except (ValueError, RecursionError):
            return self.text, []
        if self.name is not None:
            calls = [ParsedCall(self.name, json.dumps(value, ensure_ascii=False))]
        elif isinstance(value, list) and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
            calls = [ParsedCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]
        else:
            return self.text, []
        self.num_calls = len(calls)
        return "", calls

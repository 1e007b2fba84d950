"""tool_choice "required" or a named function, as vLLM serves them: the output is constrained by
structured outputs to the calls' JSON (a named function: its arguments; "required": a list of
{"name", "parameters"}) and read back as tool calls. No tool-call parser is needed."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vllm_spec.entrypoints.openai.tool_calls import ParsedCall, parse_call
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
    """One choice's constrained output read back as tool calls (as vLLM's). A named function's output is
    its call's arguments, streamed as they come (the first piece names the function; an output cut by
    max_tokens stays the call's arguments). "required" (name None) streams each call of the list once its
    object closes (name and arguments, the arguments as json.dumps writes them: the same text streamed or
    not); an output whose calls do not parse is the choice's content when it ends."""

    name: str | None
    text: str = ""
    num_calls: int = 0
    _scanned: int = 0          # "required": how much of text the scan has read
    _depth: int = 0            # its nesting there, and whether inside a string (after a backslash)
    _in_string: bool = False
    _escaped: bool = False
    _object_start: int = -1    # where the list's open object starts
    _invalid: bool = False     # an object that is not a call was found: nothing more streams

    @property
    def reports_calls(self) -> bool:
        """As vLLM: "required" ends with finish_reason "tool_calls"; a named function with the model's own."""
        return self.name is None

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.text += delta
        if not delta:
            return "", []
        if self.name is None:
            return "", self._closed_calls()
        first, self.num_calls = self.num_calls == 0, 1
        return "", [ParsedCall(self.name if first else None, delta)]

    def _closed_calls(self) -> list[ParsedCall]:
        """The list's call objects that closed since the last scan."""
        calls, text = [], self.text
        for i in range(self._scanned, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if c == "{" and self._depth == 2:
                    self._object_start = i
            elif c in "]}":
                if c == "}" and self._depth == 2 and not self._invalid:
                    call = parse_call(text[self._object_start: i + 1])
                    if call is None:
                        self._invalid = True
                    else:
                        calls.append(replace(call, index=self.num_calls))
                        self.num_calls += 1
                self._depth -= 1
        self._scanned = len(text)
        return calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content, calls) the end adds: "required"'s text as content when none of its calls streamed
        (it does not parse); a named function that generated nothing, its call with empty arguments."""
        if self.name is not None:
            if self.num_calls:
                return "", []
            self.num_calls = 1
            return "", [ParsedCall(self.name, "")]
        return ("", []) if self.num_calls else (self.text, [])

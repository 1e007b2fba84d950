"""Tool calls parsed out of a chat completion's generated text (vLLM's `--enable-auto-tool-choice
--tool-call-parser hermes`); their wire models are in protocol_chat.py.

The hermes format (Hermes, Qwen2.5 and others' chat templates) wraps each call in tags:
`<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`. Text outside the
calls is the message's content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

TOOL_CALL_PARSERS = ("hermes",)
_START, _END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """A tool call found in the output, or a streamed piece of one (clients join pieces by index): the
    function's name (on a call's first piece only) and its arguments' JSON text (or a piece of it)."""

    name: str | None
    arguments: str
    index: int = 0   # which call of the choice


def parse_call(body: str) -> ParsedCall | None:
    """A call's JSON ({"name", "arguments" or "parameters"}) as a ParsedCall (arguments as json.dumps
    writes them), or None when the text is no such object."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):   # (deeply nested output: json's recursion limit)
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def read_tool_calls(reader, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, tool calls) of a whole generated text, as a new reader (a ToolCallStream, or any
    reader with its feed/finish) finds them streamed: a client gets the same answer either way.
    Content is None when there are calls and nothing else is left."""
    content, pieces = reader.feed(text)
    rest, last = reader.finish()
    content += rest
    calls: dict[int, ParsedCall] = {}
    for piece in pieces + last:
        call = calls.get(piece.index)
        calls[piece.index] = piece if call is None else replace(call, arguments=call.arguments + piece.arguments)
    return (content or None) if calls else content, list(calls.values())


@dataclass
class ToolCallStream:
    """One streamed choice's text, split into content deltas and whole tool calls as they close."""

    buffer: str = ""
    in_call: bool = False
    num_calls: int = 0
    reports_calls = True   # a choice with calls ends with finish_reason "tool_calls"
    # Content's trailing whitespace is held until more content comes (then sent with it) or the choice
    # ends (sent if it called nothing): the newlines around calls are no content, however text is split.
    held: str = ""

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        """The content to send now and the calls completed by this delta."""
        self.buffer += delta
        content, calls = [], []
        while True:
            if not self.in_call:
                start = self.buffer.find(_START)
                if start < 0:
                    keep = _partial_tag_length(self.buffer)   # a tag may be arriving: hold its start back
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(_START):], True
            else:
                end = self.buffer.find(_END)
                if end < 0:
                    break
                body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(_END):], False
                call = parse_call(body.strip())
                if call is None:   # not a call after all: its text is content
                    content.append(_START + body + _END)
                    continue
                calls.append(replace(call, index=self.num_calls))
                self.num_calls += 1
        text = self.held + "".join(content)
        body = text.rstrip()
        self.held = text[len(body):]
        return body, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What is left when the choice ends: an unclosed last call that parses is a call, anything else
        content."""
        rest, in_call, held = self.buffer, self.in_call, self.held
        self.buffer, self.in_call, self.held = "", False, ""
        call = parse_call(rest.strip()) if in_call else None
        if call is not None:
            self.num_calls += 1
            return "", [replace(call, index=self.num_calls - 1)]
        text = held + (_START if in_call else "") + rest
        return (text.rstrip() if self.num_calls else text), []


def _partial_tag_length(text: str) -> int:
    """The longest end of text that begins the start tag."""
    for n in range(min(len(_START) - 1, len(text)), 0, -1):
        if _START.startswith(text[-n:]):
            return n
    return 0

"""Chat messages to a prompt, one way for the offline API (LLM.chat) and the server."""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.nodes

from vllm_spec.utils import check_text


def text_content(content: Any) -> str:
    """A message's content as text: a string, None (empty), or OpenAI content parts whose text parts
    are joined by newlines, as vLLM does; any other part (an image, say) is a ValueError."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in text_parts(content))


def text_parts(content: Any) -> list[dict[str, str]]:
    """A message's content as OpenAI text parts (vLLM's "openai" content format): a string is one part,
    None none; any part but a text part (an image, say) is a ValueError."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of content parts, got {type(content).__name__}.")
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts are supported, got type {kind!r}.")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a text content part needs a string 'text', got {part!r}.")
    return [{"type": "text", "text": part["text"]} for part in content]


CONTENT_FORMATS = ("auto", "string", "openai")


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" where the template loops over a message's content (it expects a list of parts, as
    vLLM detects it), else "string"."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return "string"   # (rendering reports it)

    def is_content(node: jinja2.nodes.Node, aliases: set[str]) -> bool:
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, jinja2.nodes.Getitem):
            return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
        if isinstance(node, jinja2.nodes.Filter):   # e.g. message['content'] | selectattr(...)
            return node.node is not None and is_content(node.node, aliases)
        return isinstance(node, jinja2.nodes.Name) and node.name in aliases

    aliases = {assign.target.name for assign in tree.find_all(jinja2.nodes.Assign)
               if isinstance(assign.target, jinja2.nodes.Name) and is_content(assign.node, set())}
    return "openai" if any(is_content(loop.iter, aliases) for loop in tree.find_all(jinja2.nodes.For)) else "string"


def _template_of(tokenizer, chat_template: str | None) -> str | None:
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):   # named templates: transformers uses "default"
        template = template.get("default")
    return template if isinstance(template, str) else None


# Arguments of apply_chat_template that render_chat sets itself: not template variables.
_RESERVED = ("tokenize", "conversation", "messages", "tokenizer", "add_special_tokens")


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                add_special_tokens: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, content_format: str = "auto") -> dict[str, Any]:
    """{"prompt", "prompt_token_ids"} of a conversation under the tokenizer's chat template (or the
    given one); add_special_tokens adds the tokenizer's own (BOS...) to the template's; tools (OpenAI
    function definitions) are the template's to show the model; content_format (vLLM's): how contents
    reach the template, "string" (text parts joined) or "openai" (a list of text parts), "auto" as the
    template reads them. ValueError for contents it cannot render."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, got "
                         f"{content_format!r}.")
    template_kwargs = dict(template_kwargs or {})
    if tools is not None:
        if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"tools must be a list of tool definitions (dicts), got {tools!r}.")
        template_kwargs["tools"] = tools
    reserved = sorted(set(template_kwargs) & set(_RESERVED))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {reserved}: they are arguments of their own.")
    # As vLLM: chat_template_kwargs apply last, over the arguments of the same names.
    add_generation_prompt = template_kwargs.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = template_kwargs.pop("continue_final_message", continue_final_message)
    chat_template = template_kwargs.pop("chat_template", chat_template)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true.")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError(f"messages must be dicts with a string 'role' (and a 'content'), got {messages!r}.")
    if content_format == "auto":
        template = _template_of(tokenizer, chat_template)
        content_format = detect_content_format(template) if template is not None else "string"
    as_content = text_parts if content_format == "openai" else text_content
    messages = [_with_parsed_tool_calls({**m, "content": as_content(m.get("content"))}) for m in messages]
    check_text("messages", messages)
    if continue_final_message:
        template_kwargs["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **template_kwargs)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat_template could not be rendered: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ValueError("the chat template did not render to text.")
    # The template writes the special tokens itself: tokenized without adding them again unless asked.
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=add_special_tokens).input_ids}


def _with_parsed_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls with their arguments as objects, as vLLM hands them to templates
    (OpenAI sends them as JSON text: a template would render that text as a string, quoted)."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return message
    if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
        raise ValueError(f"messages: an assistant message's tool_calls must be a list of "
                         f'{{"function": {{"name": ..., "arguments": ...}}}}, got {calls!r}.')
    parsed = []
    for call in calls:
        arguments = call["function"].get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"messages: tool call arguments must be JSON, got {arguments!r} ({e}).") from None
        parsed.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": parsed}

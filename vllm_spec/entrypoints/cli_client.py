"""`vllm-spec chat` and `vllm-spec complete`: vLLM's command-line clients of a running server (the
OpenAI API over HTTP, standard library only). Each reads prompts from stdin line by line, or answers
one --quick prompt and exits; replies stream as they are generated."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any


class ClientError(RuntimeError):
    """The server cannot be reached or refused a request: printed, exit status 1."""


def add_client_parsers(sub: argparse._SubParsersAction) -> None:
    for name, what, func in (("chat", "chat with a running server (a conversation kept across lines)", run_chat),
                             ("complete", "complete prompts with a running server", run_complete)):
        p = sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}: vllm chat / complete.")
        p.add_argument("--url", default="http://localhost:8000/v1", help="the server's OpenAI API base URL")
        p.add_argument("--model-name", default=None, help="the model to ask (default: the server's first)")
        p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="the server's API key (default: $OPENAI_API_KEY)")
        p.add_argument("-q", "--quick", default=None, metavar="TEXT", help="send this one prompt, print, exit")
        p.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (default: the server's)")
        if name == "chat":
            p.add_argument("--system-prompt", default=None, help="a system message opening the conversation")
        p.set_defaults(func=func)


class _Server:
    def __init__(self, args: argparse.Namespace):
        self.url = args.url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if args.api_key:
            self.headers["Authorization"] = f"Bearer {args.api_key}"
        self.model = args.model_name or self._first_model()

    def _open(self, path: str, body: dict[str, Any] | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = e.reason
            raise ClientError(f"{self.url + path}: {e.code} {message}") from None
        except urllib.error.URLError as e:
            raise ClientError(f"cannot reach the server at {self.url} (--url): {e.reason}") from None

    def _first_model(self) -> str:
        with self._open("/models") as r:
            models = json.loads(r.read())["data"]
        if not models:
            raise ClientError(f"the server at {self.url} serves no model.")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed request."""
        with self._open(path, {**body, "model": self.model, "stream": True}) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ClientError(f"the server: {chunk['error'].get('message', chunk['error'])}")
                yield chunk


def _prompts(args: argparse.Namespace, marker: str) -> Iterator[str]:
    if args.quick is not None:
        yield args.quick
        return
    while True:
        try:
            line = input(marker)
        except EOFError:
            return
        if line.strip():
            yield line


def _printed(pieces: Iterator[str]) -> str:
    text = []
    for piece in pieces:
        print(piece, end="", flush=True)
        text.append(piece)
    print()
    return "".join(text)


def _reporting(run):
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ClientError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return wrapped


@_reporting
def run_chat(args: argparse.Namespace) -> int:
    server = _Server(args)
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    print(f"Using model: {server.model}", file=sys.stderr)
    for line in _prompts(args, "> "):
        messages.append({"role": "user", "content": line})
        chunks = server.stream("/chat/completions", {"messages": messages, **extra})
        reply = _printed(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        messages.append({"role": "assistant", "content": reply})
    return 0


@_reporting
def run_complete(args: argparse.Namespace) -> int:
    server = _Server(args)
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    print(f"Using model: {server.model}", file=sys.stderr)
    for line in _prompts(args, "> "):
        _printed(c["choices"][0]["text"] for c in server.stream("/completions", {"prompt": line, **extra})
                 if c["choices"])
    return 0

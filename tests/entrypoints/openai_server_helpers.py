"""Constants and helpers shared by the OpenAI-server tests: the Server handle, /metrics parsing, SSE and POST."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    import openai

    from vllm_spec.entrypoints.llm import LLM

API_KEY = "test-key-123"
MODEL_NAME = "tiny-spec"
KV_BYTES = "33554432"
MAX_TOKENS = 12
PROMPTS = ["def wrap(text):", "hello world", "The quick brown fox", "import textwrap\n", "width = 70",
           "Return a list of", "class TextWrapper:", "    def __init__(self,"]
MESSAGES = [[{"role": "user", "content": "hello"}],
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "wrap this text"}]]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    total_blocks: int = 0
    ref_text: dict = dataclasses.field(default_factory=dict)   # prompt -> greedy text (offline, no draft)
    ref_chat: list = dataclasses.field(default_factory=list)   # per MESSAGES entry
    llm: LLM | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        # Imported here, not at the top: conftest.py imports this module for every test in the folder,
        # and only the server tests need openai (they importorskip it).
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60.0)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def _metrics_text(server: Server) -> str:
    r = httpx.get(server.url + "/metrics", timeout=10.0)
    assert r.status_code == 200
    return r.text


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    raise KeyError(f"{name} {labels} not in /metrics")


def _wait_all_blocks_free(server: Server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics_text(server)
        free = _metric(text, "vllm:kv_cache_free_blocks")
        if free == server.total_blocks and _metric(text, "vllm:num_requests_running") == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"KV blocks not freed: {free} of {server.total_blocks} free")
        time.sleep(0.1)


def _sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _post(server: Server, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60.0, **kw)


@contextlib.contextmanager
def _stream_completion(server: Server, max_tokens: int):
    """An open streamed greedy completion of PROMPTS[0] (ignore_eos), its status checked; leaving the
    block closes the connection, mid-stream if the caller stopped reading."""
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60.0) as client, \
            client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        yield r

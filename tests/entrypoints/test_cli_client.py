"""`vllm-spec chat` / `vllm-spec complete` against a running server (vLLM's CLI clients)."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import ROOT
from .openai_server_helpers import API_KEY, MODEL_NAME, _post


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "vllm_spec.entrypoints.cli", *args], input=stdin, text=True,
                          capture_output=True, env=env, timeout=300)


def test_quick_chat_and_complete(server):
    url = server.url + "/v1"
    for command in ("chat", "complete"):
        r = _cli(command, "--url", url, "--api-key", API_KEY, "-q", "hello", "--max-tokens", "5")
        assert r.returncode == 0, r.stderr
        assert f"Using model: {MODEL_NAME}" in r.stderr and r.stdout.strip(), (r.stdout, r.stderr)


def test_interactive_complete_streams_each_line_and_chat_keeps_the_conversation(server):
    url = server.url + "/v1"
    r = _cli("complete", "--url", url, "--api-key", API_KEY, "--max-tokens", "3", stdin="one\n\ntwo\n")
    assert r.returncode == 0 and r.stdout.count("> ") == 4, (r.stdout, r.stderr)   # 2 prompts, 1 blank, EOF
    r = _cli("chat", "--url", url, "--api-key", API_KEY, "--model-name", MODEL_NAME, "--max-tokens", "3",
             "--system-prompt", "be brief", stdin="hi\nand again\n")
    assert r.returncode == 0 and r.stdout.count("> ") == 3, (r.stdout, r.stderr)
    # The server is still answering the same way after the clients (nothing left running).
    assert _post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_client_errors_exit_1_with_the_reason(server):
    r = _cli("chat", "--url", server.url + "/v1", "--api-key", "wrong", "-q", "hi")
    assert r.returncode == 1 and "401" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _cli("complete", "--url", "http://127.0.0.1:9/v1", "-q", "hi")
    assert r.returncode == 1 and "cannot reach the server" in r.stderr, r.stderr

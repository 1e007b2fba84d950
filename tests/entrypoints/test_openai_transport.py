"""vLLM's server transport flags: --uds (a Unix domain socket), HTTPS (--ssl-keyfile / --ssl-certfile),
several --api-key values, --enable-force-include-usage and --default-chat-template-kwargs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import ROOT, _free_port, _stop

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if flag %}[flag]{% endif %}"


def _start(model: str, log: Path, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm_spec.entrypoints.openai.api_server", model, "--kv-cache-memory-bytes",
           str(1 << 24), "--max-model-len", "256", "--uvicorn-log-level", "warning", *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _wait(client: httpx.Client, proc: subprocess.Popen, log: Path) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            pytest.fail(f"server exited:\n{log.read_text()}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server not healthy:\n{log.read_text()}")


def test_unix_domain_socket(tiny_llama, tmp_path):
    path = tmp_path / "server.sock"
    log = tmp_path / "uds.log"
    proc = _start(str(tiny_llama), log, "--uds", str(path))
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost",
                          timeout=60) as client:
            _wait(client, proc, log)
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        _stop(proc)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_keys_usage_and_template_defaults(tiny_llama, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    port, log = _free_port(), tmp_path / "https.log"
    proc = _start(str(tiny_llama), log, "--host", "127.0.0.1", "--port", str(port), "--ssl-keyfile", str(key),
                  "--ssl-certfile", str(cert), "--api-key", "k1", "k2", "--enable-force-include-usage",
                  "--chat-template", TEMPLATE, "--trust-request-chat-template",
                  "--default-chat-template-kwargs", json.dumps({"flag": True}))
    try:
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=False, timeout=60) as client:
            _wait(client, proc, log)
            body = {"prompt": "hello", "max_tokens": 2, "temperature": 0, "stream": True}
            assert client.post("/v1/completions", json=body).status_code == 401
            assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k3"}).status_code == 401
            for key_ in ("k1", "k2"):
                r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key_}"})
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                # No stream_options, and still a usage chunk last.
                assert r.status_code == 200 and chunks[-1]["choices"] == [] and chunks[-1]["usage"][
                    "completion_tokens"] == 2, r.text
            auth = {"Authorization": "Bearer k1"}
            messages = [{"role": "user", "content": "hi"}]
            tokens = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False},
                                 headers=auth).json()["tokens"]
            own = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                 "chat_template_kwargs": {"flag": False}}, headers=auth).json()
            detok = client.post("/detokenize", json={"tokens": tokens}, headers=auth).json()["prompt"]
            assert detok.endswith("<user>hi[flag]") and len(own["tokens"]) < len(tokens)
    finally:
        _stop(proc)

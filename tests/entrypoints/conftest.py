"""Fixtures for the entrypoint tests: a real OpenAI-compatible server subprocess with speculative decoding;
a small offline LLM and its greedy reference (test_llm.py, test_llm_arguments.py)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vllm_spec.engine.arg_utils import EngineArgs
from vllm_spec.entrypoints.llm import LLM
from vllm_spec.sampling_params import SamplingParams

from .offline_llm_helpers import MAX_MODEL_LEN, PROMPT, greedy
from .openai_server_helpers import (
    API_KEY,
    KV_BYTES,
    MAX_TOKENS,
    MESSAGES,
    MODEL_NAME,
    PROMPTS,
    Server,
    _metric,
    _metrics_text,
)

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 240.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode} during startup:\n{server.logs()}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not healthy after {timeout} s:\n{server.logs()}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# Module scope: each test file gets its own server, so the SIGTERM test at the end of
# test_openai_serving.py stops only that file's server.
@pytest.fixture(scope="module")
def server(spec_pair, tmp_path_factory):
    target, draft = spec_pair
    port = _free_port()
    log = tmp_path_factory.mktemp("openai_server") / "server.log"
    cmd = [sys.executable, "-m", "vllm_spec.entrypoints.openai.api_server", target,
           "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
           "--served-model-name", MODEL_NAME, "--kv-cache-memory-bytes", KV_BYTES,
           "--speculative-model", draft, "--num-speculative-tokens", "3",
           "--uvicorn-log-level", "warning", "--shutdown-timeout", "20"]
    if any(f.name == "speculative_policy" for f in dataclasses.fields(EngineArgs)):
        cmd += ["--speculative-policy", "fixed"]  # always draft k=3, so the spec counters must move
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(log.parent))
    srv = Server(proc, port, log)
    try:
        # The offline references load while the server starts.
        llm = LLM(target, kv_cache_memory_bytes=int(KV_BYTES))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        srv.ref_text = {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}
        srv.ref_chat = [o.outputs[0].text for o in llm.chat(MESSAGES, params, use_tqdm=False)]
        srv.llm = llm
        _wait_healthy(srv, STARTUP_TIMEOUT)
        srv.total_blocks = int(_metric(_metrics_text(srv), "vllm:kv_cache_total_blocks"))
        yield srv
    finally:
        _stop(proc)


# Module scope: test_llm.py and test_llm_arguments.py each build their own engine.
@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 24, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference(llm):
    """The greedy continuation of PROMPT with no stop condition."""
    return llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]

"""An OpenAI-compatible vllm_spec server launched on a free loopback port, waited for until healthy
(benchmark_serving.py --compare starts one per configuration)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`python -m vllm_spec.entrypoints.openai.api_server MODEL ...` as a subprocess, its output in log_dir."""

    def __init__(self, label: str, model: str, extra: list[str], api_key: str | None, log_dir: Path,
                 startup_timeout: float):
        self.label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server_{label}.log"
        cmd = [sys.executable, "-m", "vllm_spec.entrypoints.openai.api_server", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.cmd = cmd
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        print(f"[{label}] starting: {' '.join(cmd)}", file=sys.stderr)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"[{label}] server exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"[{label}] server not healthy after {startup_timeout} s")
            time.sleep(0.5)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode

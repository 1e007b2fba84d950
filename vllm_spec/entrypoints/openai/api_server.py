"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLMEngine: the app's assembly
(error handlers, auth, routes) and running it.

    python -m vllm_spec.entrypoints.openai.api_server MODEL [--host 127.0.0.1] [--port 8000]
        [--api-key KEY] [--served-model-name NAME ...] [engine flags, e.g. --speculative-model DRAFT]

Endpoints: POST /v1/completions (serving_completion.py), POST /v1/chat/completions (serving_chat.py),
both with stream=true as SSE; GET /v1/models, GET /health, GET /metrics (Prometheus text,
prometheus.py), GET /version.
Bad requests get HTTP 400 with an OpenAI-style body {"error": {message, type, param, code}};
with --api-key every /v1 route needs `Authorization: Bearer <key>` (401 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_spec.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from vllm_spec.entrypoints.openai.prometheus import EngineCollector
from vllm_spec.entrypoints.openai.protocol import ModelCard, ModelList, OpenAIServingError
from vllm_spec.entrypoints.openai.serving import ERROR_TYPES, ServerState, error_response
from vllm_spec.entrypoints.openai.serving_chat import create_chat_completion
from vllm_spec.entrypoints.openai.serving_completion import create_completion
from vllm_spec.entrypoints.openai.serving_tokenize import detokenize, tokenize

logger = logging.getLogger("vllm_spec.api_server")

VERSION = "0.1.0"


# Auth (pure ASGI, so streaming and disconnect detection are untouched) ------------------------------
class APIKeyMiddleware:
    def __init__(self, app, api_keys: Sequence[str]):
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope, receive, send):
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):   # (uvicorn's --root-path prefixes every request's path)
            path = path[len(root):]
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not path.startswith("/v1"):
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        if not any(secrets.compare_digest(auth, key) for key in self.expected):
            response = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                      "AuthenticationError")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _json_body(request: Request) -> None:
    """As vLLM's server: a body that is not declared JSON (curl -d's form encoding) is a 415."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise OpenAIServingError("Unsupported Media Type: only 'application/json' is allowed.", status_code=415,
                                 err_type=ERROR_TYPES[415])


@dataclass
class CorsOptions:
    """Cross-origin requests (browser clients), as vLLM's --allowed-origins / --allowed-methods /
    --allowed-headers / --allow-credentials: every origin, method and header by default."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


# App ------------------------------------------------------------------------------------------------------
def build_app(state: ServerState, cors: CorsOptions | None = None, docs: bool = True,
              request_id_headers: bool = False) -> FastAPI:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(EngineCollector(state.engine, state.model_name))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        logger.info("engine loop started; serving %s", ", ".join(state.served_model_names))
        try:
            yield
        finally:
            logger.info("shutting down the engine loop")
            await state.engine.shutdown()
            state.tokenizer_thread.shutdown(wait=False)

    off = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="vllm_spec OpenAI-compatible server", version=VERSION, lifespan=lifespan, **off)
    app.state.server = state
    if request_id_headers:
        @app.middleware("http")
        async def _request_id(request: Request, call_next):
            response = await call_next(request)
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            return response

    @app.exception_handler(OpenAIServingError)
    async def _serving_error(_: Request, exc: OpenAIServingError):
        return JSONResponse(exc.to_response().model_dump(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        parts, param = [], None
        for err in errors[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))} "
                             f"(at character {loc[0] if loc else '?'})")
            else:
                if param is None and loc:
                    param = loc[0]
                where = ".".join(loc) or "body"
                parts.append(f"{where}: {err.get('msg')} ({err.get('type')})")
        return error_response(400, "; ".join(parts) or "Invalid request.", param=param)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        # Still an OpenAI-style body for clients (the traceback goes to the log).
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}", ERROR_TYPES[500])

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                               ERROR_TYPES.get(exc.status_code, "BadRequestError"))

    @app.get("/health")
    async def health():
        try:
            await state.engine.check_health()
        except EngineDeadError as e:
            return error_response(503, str(e), "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
                 for name in state.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)   # (a schema entry per method: a clash)
    async def ping():   # vLLM's (SageMaker's) liveness probe: /health's answer
        return await health()

    if os.environ.get("VLLM_TORCH_PROFILER_DIR"):   # as vLLM: only where traces have somewhere to go
        async def profiler_call(call) -> Response:
            try:
                await call()
            except RuntimeError as e:   # started twice, or stopped while not running: the client's order
                return error_response(400, str(e))
            return Response(status_code=200)

        @app.post("/start_profile")
        async def start_profile():
            return await profiler_call(state.engine.start_profile)

        @app.post("/stop_profile")
        async def stop_profile():
            return await profiler_call(state.engine.stop_profile)

    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":   # as vLLM: a development server's extra
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            await state.engine.reset_prefix_cache()
            return Response(status_code=200)

    json_only = [Depends(_json_body)]
    app.post("/v1/completions", dependencies=json_only)(create_completion)
    app.post("/v1/chat/completions", dependencies=json_only)(create_chat_completion)
    app.post("/tokenize", dependencies=json_only)(tokenize)
    app.post("/detokenize", dependencies=json_only)(detokenize)

    if state.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=state.api_keys)
    cors = cors or CorsOptions()
    # Added last, so outermost: preflight requests are answered before auth, and 4xx errors carry its
    # headers (an unexpected 500 is answered by Starlette's outermost error middleware, without them).
    app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                       allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    return app


def build_state(engine: AsyncLLMEngine, model: str, served_model_names: Sequence[str] | None = None,
                api_key: str | Sequence[str] | None = None, chat_template: str | None = None,
                response_role: str = "assistant", enable_prompt_tokens_details: bool = False,
                trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
                return_tokens_as_token_ids: bool = False, log_requests: bool = False,
                max_log_len: int | None = None, chat_template_content_format: str = "auto",
                force_include_usage: bool = False,
                default_chat_template_kwargs: dict[str, Any] | None = None) -> ServerState:
    """Server state around a built engine; loads the server's own tokenizer copy (the engine's is
    used by the engine thread only)."""
    from vllm_spec.tokenizer import get_tokenizer

    cfg = engine.config.model
    tokenizer = get_tokenizer(cfg) if engine.tokenizer is not None else None
    names = [n for n in (served_model_names or []) if n] or [model]
    return ServerState(engine=engine, served_model_names=names, model_path=str(model), tokenizer=tokenizer,
                       api_keys=[k for k in ([api_key] if isinstance(api_key, str) else api_key or []) if k],
                       max_model_len=cfg.max_model_len, max_logprobs=cfg.max_logprobs,
                       chat_template=chat_template,
                       response_role=response_role, sampling_defaults=cfg.get_diff_sampling_param(),
                       enable_prompt_tokens_details=enable_prompt_tokens_details,
                       trust_request_chat_template=trust_request_chat_template, tool_call_parser=tool_call_parser,
                       return_tokens_as_token_ids=return_tokens_as_token_ids, log_requests=log_requests,
                       max_log_len=max_log_len, chat_template_content_format=chat_template_content_format,
                       force_include_usage=force_include_usage,
                       default_chat_template_kwargs=dict(default_chat_template_kwargs or {}))


# Running ----------------------------------------------------------------------------------------------------
def _make_uvicorn_server(config, engine: AsyncLLMEngine):
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown (so the process dies by the
        signal); we shut down cleanly and exit 0 instead."""

        async def shutdown(self, sockets=None):
            # uvicorn cancels the requests still running at its graceful-shutdown deadline: they would
            # end as bare 500s and cut streams. Shortly before it, the engine aborts them, so each
            # handler answers as for any aborted request (a JSON 503, or an SSE error event + [DONE]).
            timeout = self.config.timeout_graceful_shutdown
            aborting, shutdowns = None, []   # (the task referenced until it is done)
            if timeout is not None:
                aborting = asyncio.get_running_loop().call_later(
                    max(timeout - 1.0, 0.8 * timeout), lambda: shutdowns.append(asyncio.ensure_future(engine.shutdown())))
            try:
                await super().shutdown(sockets)
            finally:
                if aborting is not None:
                    aborting.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if captured:
                    logger.info("graceful shutdown after signal(s) %s", captured)
                    captured.clear()

    return _Server(config)


def bind_socket(host: str | None, port: int, uds: str | None = None) -> socket.socket:
    """The listening socket, taken before the engine loads (as vLLM's server): a port in use is a clear
    error at once, not after minutes of loading; clients connecting meanwhile wait in its queue. host
    None: every interface; uds: a Unix domain socket at that path instead (a stale one is replaced)."""
    sock = None
    try:
        if uds is not None:
            if os.path.exists(uds) and stat.S_ISSOCK(os.stat(uds).st_mode):
                os.unlink(uds)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(uds)
        else:
            family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        sock.listen()
    except OSError as e:
        if sock is not None:
            sock.close()
        where = f"{uds} (--uds)" if uds is not None else f"{host or '*'}:{port} (--host/--port)"
        raise ValueError(f"cannot listen on {where}: {e.strerror or e}.") from None
    return sock


def run_server(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Load the engine from the parsed serve flags and serve on `sock` (bound here when None) until
    SIGINT/SIGTERM. Returns 0, or 1 when the server did not start."""
    sock = sock or bind_socket(args.host, args.port, args.uds)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from vllm_spec.engine.arg_utils import EngineArgs

    logging.basicConfig(level=getattr(logging, str(args.uvicorn_log_level).upper(), logging.INFO),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    spec = engine.config.speculative
    logger.info("loaded %s in %.1f s (%s); KV blocks: %d; max_model_len %d", args.model,
                time.perf_counter() - t0,
                f"speculative: {spec.method}, k={spec.num_speculative_tokens}" if spec else "no speculation",
                engine.num_usable_blocks, engine.config.model.max_model_len)
    state = build_state(engine, args.model, args.served_model_name, args.api_key, args.chat_template,
                        args.response_role, args.enable_prompt_tokens_details, args.trust_request_chat_template,
                        args.tool_call_parser if args.enable_auto_tool_choice else None,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        log_requests=args.enable_log_requests and not args.disable_log_requests,
                        max_log_len=args.max_log_len,
                        chat_template_content_format=args.chat_template_content_format,
                        force_include_usage=args.enable_force_include_usage,
                        default_chat_template_kwargs=args.default_chat_template_kwargs)
    app = build_app(state, CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                       args.allow_credentials),
                    docs=not args.disable_fastapi_docs, request_id_headers=args.enable_request_id_headers)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on", root_path=args.root_path,
                            access_log=not args.disable_uvicorn_access_log, ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                            ssl_cert_reqs=args.ssl_cert_reqs)
    server = _make_uvicorn_server(config, engine)
    # (uvicorn says where it listens only for sockets it binds itself; --port 0 picks one.)
    if sock.family == socket.AF_UNIX:
        logger.info("serving on unix:%s", sock.getsockname())
    else:
        host, port = sock.getsockname()[:2]
        logger.info("serving on %s://%s:%d", "https" if args.ssl_certfile else "http",
                    f"[{host}]" if sock.family == socket.AF_INET6 else host, port)
    server.run(sockets=[sock])
    engine.shutdown()   # (done already where the lifespan's shutdown ran: a forced exit skips it)
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    from vllm_spec.entrypoints.openai.cli_args import make_arg_parser, serve_main

    parser = make_arg_parser()
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

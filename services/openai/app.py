"""The FastAPI app: OpenAI's routes, each a thin translation onto the router's AsyncLLM."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.client.credentials import channel_credentials
from tandem.common import tracing
from tandem.openai.chat import chat_completions
from tandem.openai.completions import completions
from tandem.openai.config import FrontConfig
from tandem.openai.embeddings import EmbeddingRequest, embeddings
from tandem.openai.errors import OpenAIError, error_response, from_exception
from tandem.openai.front import TRACE_CONTEXT_HEADERS, Front, trace_headers
from tandem.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = logging.getLogger("tandem.openai")
# The routes --api-key guards (as vLLM's: the API; /health, /ping, /metrics and /version stay open).
GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@contextlib.contextmanager
def _as_openai_errors():
    """A route's failures (gRPC statuses above all) as OpenAIErrors, which the app renders."""
    try:
        yield
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure gets an OpenAI-style body
        raise from_exception(exc) from exc


def build_app(config: FrontConfig) -> FastAPI:
    """The app for the router at config.target."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.front = Front(config)
        try:
            yield
        finally:
            app.state.front.llm.close()

    app = FastAPI(title="tandem OpenAI-compatible API", lifespan=lifespan)

    app.add_middleware(_GuardAndCount, api_key=config.api_key)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request, exc: RequestValidationError):
        # OpenAI answers 400 (not FastAPI's 422) with what was wrong.
        problems = [
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        ]
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        return error_response(400, "; ".join(problems), ".".join(str(p) for p in first[1:]) or None)

    @app.post("/v1/completions")
    async def _completions(body: CompletionRequest, request: Request):
        with _as_openai_errors():
            return await completions(request.app.state.front, body, request)

    @app.post("/v1/chat/completions")
    async def _chat_completions(body: ChatCompletionRequest, request: Request):
        with _as_openai_errors():
            return await chat_completions(request.app.state.front, body, request)

    @app.post("/v1/embeddings")
    async def _embeddings(body: EmbeddingRequest, request: Request):
        with _as_openai_errors():
            return await embeddings(request.app.state.front, body, request)

    async def model_cards(front: Front) -> list[dict]:
        """The served model, then its LoRA adapters (vLLM's cards: `parent` names the base)."""
        info = await front.info()
        name = await front.model_name()
        card = {
            "object": "model",
            "created": front.started,
            "owned_by": "tandem",
            "max_model_len": info.max_model_len,
        }
        return [
            {"id": name, **card, "root": info.model, "parent": None},
            *(
                {"id": adapter.lora_name, **card, "root": adapter.lora_path, "parent": name}
                for adapter in front.adapters.values()
            ),
        ]

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": await model_cards(request.app.state.front)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        with _as_openai_errors():
            front: Front = request.app.state.front
            await front.check_model(model_id)
            return next(c for c in await model_cards(front) if c["id"] == model_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        with _as_openai_errors():
            front = await _front_for(request, body.model)
            tokenizer = await front.tokenizer()
            if body.messages is not None:
                text = tokenizer.apply_chat_template(
                    [m.for_template() for m in body.messages],
                    add_generation_prompt=body.add_generation_prompt,
                )
                add_special = False
            else:
                text, add_special = body.prompt, body.add_special_tokens
            tokens = await asyncio.to_thread(tokenizer.encode, text, add_special)
            info = await front.info()
            return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        with _as_openai_errors():
            front = await _front_for(request, body.model)
            tokenizer = await front.tokenizer()
            return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

    @app.get("/ping")
    async def ping():
        """200 while the process answers (liveness: a front whose router is down is not
        restarted; /health, its readiness, says whether it can route)."""
        return JSONResponse({})

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/health")
    async def health(request: Request):
        """200 when the router reports SERVING (its workers are up), 503 otherwise."""
        async with _router_channel(request.app.state.front) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            except grpc.RpcError as exc:
                return error_response(503, f"router unreachable: {exc.code().name}")
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return error_response(503, "router not serving")
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(
            generate_latest(request.app.state.front.metrics.registry),
            media_type=CONTENT_TYPE_LATEST,
        )

    return app


class _GuardAndCount:
    """The API key check and the request counter, as a plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would hide the client's disconnect from the routes (which abort a request
    whose client left)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        counter = scope["app"].state.front.metrics.requests
        if self.expected is not None and path.startswith(GUARDED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                counter.labels(path, "401").inc()
                response = error_response(
                    401, "Unauthorized: send the API key as Authorization: Bearer <key>"
                )
                await response(scope, receive, send)
                return
        status = {"code": 500}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        # The client's W3C trace context (traceparent, tracestate) goes on to the router in each
        # request's trace_headers; with --otlp-traces-endpoint the front's own span sits between
        # (one per HTTP request, over its whole response: a stream's too).
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in TRACE_CONTEXT_HEADERS
        }
        with tracing.span(f"tandem.openai {path}", headers, **{"http.method": scope.get("method")}):
            token = trace_headers.set(headers)
            try:
                await self.app(scope, receive, send_counted)
            finally:
                trace_headers.reset(token)
                counter.labels(path, str(status["code"])).inc()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("tandem")
    except PackageNotFoundError:
        return "unknown"


def _router_channel(front: Front) -> grpc.aio.Channel:
    tls = front.tls
    credentials = channel_credentials(
        None, tls.get("root_certificates"), tls.get("certificate_chain"), tls.get("private_key")
    )
    if credentials is None:
        return grpc.aio.insecure_channel(front.target)
    options = (
        [("grpc.ssl_target_name_override", tls["tls_server_name"])]
        if tls.get("tls_server_name")
        else []
    )
    return grpc.aio.secure_channel(front.target, credentials, options=options)


def serve_openai(config: FrontConfig) -> None:
    """Serves until SIGTERM/SIGINT: then uvicorn stops accepting connections and waits for the
    requests in flight up to config.shutdown_timeout_s; those still running are cancelled (their
    generations aborted on the workers as their streams close) and the process exits."""
    import uvicorn

    uvicorn.run(
        build_app(config),
        host=config.host,
        port=config.port,
        log_level="info",
        log_config=None,  # uvicorn's lines through the process's handler (--log-format)
        timeout_graceful_shutdown=config.shutdown_timeout_s,
    )


async def _front_for(request: Request, model: str | None) -> Front:
    """The app's front, once the model a request names (if any) is one it serves."""
    front: Front = request.app.state.front
    if model is not None:
        await front.check_model(model)
    return front

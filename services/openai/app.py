"""The FastAPI app: OpenAI's routes, each a thin translation onto the router's AsyncLLM."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.client import AsyncLLM
from tandem.client.credentials import channel_credentials
from tandem.openai import responses as r
from tandem.openai.errors import OpenAIError, error_response, from_exception
from tandem.openai.metrics import FrontMetrics
from tandem.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.openai.streams import MergedStream, Snapshot

log = logging.getLogger("tandem.openai")
# How often a non-streaming request looks whether its client is still there.
DISCONNECT_POLL_S = 0.5
# The routes --api-key guards (as vLLM's: the API; /health, /metrics and /version stay open).
GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class Front:
    """What the routes share: the router client, the served model's name, the metrics."""

    def __init__(self, target: str, served_model_name: str | None, tls: dict | None = None):
        """tls: LLM's TLS keyword arguments for a TLS router (root_certificates, certificate_chain,
        private_key, tls_server_name)."""
        self.target = target
        self.tls = dict(tls or {})
        self.llm = AsyncLLM(target, **self.tls)
        self.metrics = FrontMetrics()
        self.started = r.now()
        self._served_model_name = served_model_name
        self._tokenizer = None

    async def info(self):
        return await asyncio.to_thread(self.llm._server_info)

    async def model_name(self) -> str:
        return self._served_model_name or Path((await self.info()).model).name

    async def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(lambda: self.llm.tokenizer)
        return self._tokenizer

    async def check_model(self, model: str) -> str:
        name = await self.model_name()
        if model != name:
            raise OpenAIError(
                404, f"The model `{model}` does not exist; this server serves `{name}`", "model"
            )
        return name

    def observe(
        self, endpoint: str, started: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)
        self.metrics.prompt_tokens.labels(endpoint).inc(prompt_tokens)
        self.metrics.generation_tokens.labels(endpoint).inc(completion_tokens)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _event_stream(
    front: Front, endpoint: str, stream: MergedStream, started: float, chunks, usage_chunk
) -> AsyncIterator[str]:
    """SSE framing, metrics and errors around a route's own chunk builder."""
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    first = True
    try:
        async for snapshot in stream:
            if first and any(d.token_ids for d in snapshot.deltas):
                front.metrics.ttft.labels(endpoint).observe(time.monotonic() - started)
                first = False
            prompt_tokens[snapshot.request] = len(snapshot.prompt_token_ids)
            completion_tokens += sum(len(d.token_ids) for d in snapshot.deltas)
            for chunk in chunks(snapshot):
                yield _sse(chunk)
        if usage_chunk is not None:
            yield _sse(usage_chunk(r.usage(sum(prompt_tokens.values()), completion_tokens)))
    except Exception as exc:  # noqa: BLE001 - the response has started: the error goes in the stream
        err = from_exception(exc)
        yield _sse(
            {"error": {"message": err.message, "type": "internal_error", "code": err.status}}
        )
    yield _sse("[DONE]")
    front.observe(endpoint, started, sum(prompt_tokens.values()), completion_tokens)


async def _generate(front: Front, prompts: list, params, stream: bool, http: Request | None = None):
    results = [front.llm.generate_async(p, params, streaming=stream) for p in prompts]
    if stream:
        merged = MergedStream(results)
        await merged.open()
        return merged
    return await _unless_gone(http, results)


async def _unless_gone(http: Request | None, results: list):
    """The results, unless the client goes away first: then they are aborted (their workers stop)
    and the route answers nobody (499, nginx's "client closed request")."""
    done = asyncio.ensure_future(asyncio.gather(*results))
    while True:
        finished, _ = await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
        if finished:
            return done.result()
        if http is not None and await http.is_disconnected():
            for result in results:
                result.abort()
            done.cancel()
            await asyncio.gather(done, return_exceptions=True)
            raise OpenAIError(499, "the client closed the request")


def _log_ignored(endpoint: str, request) -> None:
    if request.ignored_fields:
        log.warning(
            "%s: ignoring fields tandem does not know: %s", endpoint, request.ignored_fields
        )


async def _within_context(
    front: Front, prompts: list, max_tokens: int | None, add_special: bool
) -> list:
    """The prompts, refused (400, naming the numbers, as vLLM does) when one plus max_tokens passes
    the model's context instead of being clipped and run. A text prompt counted here comes back
    as its token ids, so that the router does not tokenize it a second time."""
    if max_tokens is None:
        return prompts
    limit = (await front.info()).max_model_len
    tokenizer = await front.tokenizer()
    checked = []
    for prompt in prompts:
        if not isinstance(prompt, list):
            prompt = await asyncio.to_thread(tokenizer.encode, prompt, add_special)
        num = len(prompt)
        if num + max_tokens > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num + max_tokens} tokens ({num} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or of the completion.",
                "max_tokens",
            )
        checked.append(prompt)
    return checked


async def completions(front: Front, request: CompletionRequest, http: Request | None = None):
    started, endpoint = time.monotonic(), "/v1/completions"
    model = await front.check_model(request.model)
    _log_ignored(endpoint, request)
    tokenizer = await front.tokenizer()
    prompts = await _within_context(front, request.prompts, request.max_tokens, True)
    params = r.sampling_params(
        request, request.max_tokens, request.logprobs, add_special_tokens=True
    )
    response_id, created = r.new_id("cmpl"), r.now()
    outs = await _generate(front, prompts, params, request.stream, http)

    def logprobs(token_ids, entries, offset):
        if request.logprobs is None:
            return None
        return r.completion_logprobs(tokenizer, token_ids, entries, request.logprobs, offset)

    if request.stream:
        offsets: dict[tuple[int, int], int] = {}

        def chunks(snapshot: Snapshot):
            choices = []
            for d in snapshot.deltas:
                key = (snapshot.request, d.index)
                if d.text or d.finish_reason or d.token_ids:
                    choices.append(
                        {
                            "index": snapshot.request * request.n + d.index,
                            "text": d.text,
                            "logprobs": logprobs(d.token_ids, d.logprobs, offsets.get(key, 0)),
                            "finish_reason": r.FINISH_REASONS[d.finish_reason],
                            "stop_reason": d.stop_reason,
                        }
                    )
                offsets[key] = offsets.get(key, 0) + len(d.text)
            return (
                [r.envelope("text_completion", response_id, model, created, choices)]
                if choices
                else []
            )

        include_usage = request.stream_options is not None and request.stream_options.include_usage
        usage_chunk = (
            (lambda u: r.envelope("text_completion", response_id, model, created, [], usage=u))
            if include_usage
            else None
        )
        return StreamingResponse(
            _event_stream(front, endpoint, outs, started, chunks, usage_chunk),
            media_type="text/event-stream",
        )
    choices = [
        {
            "index": i * request.n + o.index,
            "text": o.text,
            "logprobs": logprobs(o.token_ids, o.logprobs, 0),
            "finish_reason": r.FINISH_REASONS[o.finish_reason],
            "stop_reason": o.stop_reason if o.finish_reason else None,
        }
        for i, out in enumerate(outs)
        for o in out.outputs
    ]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
    completion_tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    front.observe(endpoint, started, prompt_tokens, completion_tokens)
    return r.envelope(
        "text_completion",
        response_id,
        model,
        created,
        choices,
        usage=r.usage(prompt_tokens, completion_tokens),
    )


async def chat_completions(
    front: Front, request: ChatCompletionRequest, http: Request | None = None
):
    started, endpoint = time.monotonic(), "/v1/chat/completions"
    model = await front.check_model(request.model)
    _log_ignored(endpoint, request)
    tokenizer = await front.tokenizer()
    try:
        prompt = tokenizer.apply_chat_template(
            [m.for_template() for m in request.messages],
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt
            and not request.continue_final_message,
            continue_final_message=request.continue_final_message,
            **(request.chat_template_kwargs or {}),
        )
    except ImportError as exc:
        raise OpenAIError(500, str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError and ours: the request's fault
        raise OpenAIError(400, f"cannot apply the chat template: {exc}") from exc
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    # The rendered template holds its special tokens (transformers tokenizes it without adding any).
    params = r.sampling_params(
        request, request.max_new_tokens, num_logprobs, add_special_tokens=False
    )
    prompts = await _within_context(front, [prompt], request.max_new_tokens, False)
    response_id, created = r.new_id("chatcmpl"), r.now()
    outs = await _generate(front, prompts, params, request.stream, http)

    def logprobs(token_ids, entries):
        return (
            r.chat_logprobs(tokenizer, token_ids, entries, num_logprobs)
            if num_logprobs is not None
            else None
        )

    if request.stream:

        def chunk(choices, **extra):
            return r.envelope(
                "chat.completion.chunk", response_id, model, created, choices, **extra
            )

        started_roles: set[int] = set()

        def chunks(snapshot: Snapshot):
            out = []
            for d in snapshot.deltas:
                if d.index not in started_roles:
                    started_roles.add(d.index)
                    out.append(
                        chunk(
                            [
                                {
                                    "index": d.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                if d.text or d.finish_reason or d.token_ids:
                    out.append(
                        chunk(
                            [
                                {
                                    "index": d.index,
                                    "delta": {"content": d.text} if d.text else {},
                                    "logprobs": logprobs(d.token_ids, d.logprobs),
                                    "finish_reason": r.FINISH_REASONS[d.finish_reason],
                                    "stop_reason": d.stop_reason,
                                }
                            ]
                        )
                    )
            return out

        include_usage = request.stream_options is not None and request.stream_options.include_usage
        usage_chunk = (lambda u: chunk([], usage=u)) if include_usage else None
        return StreamingResponse(
            _event_stream(front, endpoint, outs, started, chunks, usage_chunk),
            media_type="text/event-stream",
        )
    out = outs[0]
    choices = [
        {
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": logprobs(o.token_ids, o.logprobs),
            "finish_reason": r.FINISH_REASONS[o.finish_reason],
            "stop_reason": o.stop_reason if o.finish_reason else None,
        }
        for o in out.outputs
    ]
    completion_tokens = sum(len(o.token_ids) for o in out.outputs)
    front.observe(endpoint, started, len(out.prompt_token_ids), completion_tokens)
    return r.envelope(
        "chat.completion",
        response_id,
        model,
        created,
        choices,
        usage=r.usage(len(out.prompt_token_ids), completion_tokens),
    )


@contextlib.contextmanager
def _as_openai_errors():
    """A route's failures (gRPC statuses above all) as OpenAIErrors, which the app renders."""
    try:
        yield
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure gets an OpenAI-style body
        raise from_exception(exc) from exc


def build_app(
    target: str,
    served_model_name: str | None = None,
    tls: dict | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The app for a router at `target` (host:port); tls as Front takes it; api_key: the bearer
    token the API's routes demand (None: open)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.front = Front(target, served_model_name, tls)
        try:
            yield
        finally:
            app.state.front.llm.close()

    app = FastAPI(title="tandem OpenAI-compatible API", lifespan=lifespan)

    app.add_middleware(_GuardAndCount, api_key=api_key)

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

    async def model_card(front: Front) -> dict:
        info = await front.info()
        return {
            "id": await front.model_name(),
            "object": "model",
            "created": front.started,
            "owned_by": "tandem",
            "root": info.model,
            "max_model_len": info.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [await model_card(request.app.state.front)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        with _as_openai_errors():
            front: Front = request.app.state.front
            await front.check_model(model_id)
            return await model_card(front)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        with _as_openai_errors():
            front: Front = request.app.state.front
            if body.model is not None:
                await front.check_model(body.model)
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
            front: Front = request.app.state.front
            if body.model is not None:
                await front.check_model(body.model)
            tokenizer = await front.tokenizer()
            return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

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

        try:
            await self.app(scope, receive, send_counted)
        finally:
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


def serve_openai(
    target: str,
    host: str,
    port: int,
    served_model_name: str | None = None,
    tls: dict | None = None,
    api_key: str | None = None,
) -> None:
    import uvicorn

    uvicorn.run(
        build_app(target, served_model_name, tls, api_key),
        host=host,
        port=port,
        log_level="info",
    )

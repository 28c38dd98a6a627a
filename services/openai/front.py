"""What the routes share: the router client and the served model (Front), and the request
plumbing around a generation (context-length check, disconnects, SSE framing, metrics)."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Request

from tandem.client import AsyncLLM, LoRARequest
from tandem.common.logs import bind
from tandem.openai import responses as r
from tandem.openai.config import FrontConfig
from tandem.openai.errors import OpenAIError, from_exception
from tandem.openai.metrics import FrontMetrics
from tandem.openai.streams import MergedStream

# The W3C trace context headers an HTTP client may send (https://www.w3.org/TR/trace-context/).
TRACE_CONTEXT_HEADERS = (b"traceparent", b"tracestate")
# The current HTTP request's trace context for the router (app.py sets it per request): the
# client's, or the front's own span's when the front traces.
trace_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "trace_headers", default=None
)

log = logging.getLogger("tandem.openai")
# How often a non-streaming request looks whether its client is still there.
DISCONNECT_POLL_S = 0.5


class Front:
    """What the routes share: the router client, the served model's name and its adapters, the
    metrics, the requests in flight (which shutdown waits for)."""

    def __init__(self, config: FrontConfig):
        self.config = config
        self.target = config.target
        self.tls = dict(config.tls)
        self.tool_call_parser = config.tool_call_parser
        self.adapters = config.adapters
        self.llm = AsyncLLM(config.target, **self.tls)
        self.metrics = FrontMetrics()
        self.started = r.now()
        self.num_in_flight = 0
        self._tokenizer = None

    async def info(self):
        return await asyncio.to_thread(self.llm._server_info)

    async def model_name(self) -> str:
        return self.config.served_model_name or Path((await self.info()).model).name

    async def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(lambda: self.llm.tokenizer)
        return self._tokenizer

    async def check_model(self, model: str) -> tuple[str, LoRARequest | None]:
        """The model a request names: the served model (no adapter) or one of --lora-modules'
        adapters; anything else is vLLM's 404."""
        if model in self.adapters:
            return model, self.adapters[model]
        name = await self.model_name()
        if model != name:
            served = ", ".join([name, *self.adapters])
            raise OpenAIError(
                404, f"The model `{model}` does not exist. This server serves: {served}", "model"
            )
        return name, None

    def observe(
        self, endpoint: str, started: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        self.metrics.latency.labels(endpoint).observe(time.monotonic() - started)
        self.metrics.prompt_tokens.labels(endpoint).inc(prompt_tokens)
        self.metrics.generation_tokens.labels(endpoint).inc(completion_tokens)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def event_stream(
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
                yield sse(chunk)
        if usage_chunk is not None:
            yield sse(usage_chunk(r.usage(sum(prompt_tokens.values()), completion_tokens)))
    except Exception as exc:  # noqa: BLE001 - the response has started: the error goes in the stream
        err = from_exception(exc)
        yield sse({"error": {"message": err.message, "type": "internal_error", "code": err.status}})
    yield sse("[DONE]")
    front.observe(endpoint, started, sum(prompt_tokens.values()), completion_tokens)


async def generate(
    front: Front,
    prompts: list,
    params,
    stream: bool,
    http: Request | None = None,
    lora_request: LoRARequest | None = None,
    response_id: str | None = None,
):
    """response_id: the OpenAI id (chatcmpl-...), which names the router's requests (its id, then
    the prompt's index) so that one id joins the front's, the router's and the workers' lines."""
    if response_id is not None:
        bind(request_id=response_id)
    results = [
        front.llm.generate_async(
            p,
            params,
            streaming=stream,
            lora_request=lora_request,
            request_id=f"{response_id}-{i}" if response_id is not None else None,
            trace_headers=trace_headers.get() or None,
        )
        for i, p in enumerate(prompts)
    ]
    if stream:
        merged = MergedStream(results)
        await merged.open()
        return merged
    return await unless_gone(http, results)


async def unless_gone(http: Request | None, results: list):
    """The results, unless the client goes away first: then they are aborted (their workers stop)
    and the route answers nobody (499, nginx's "client closed request")."""
    return await awaited_unless_gone(
        http, asyncio.gather(*results), lambda: [result.abort() for result in results]
    )


async def awaited_unless_gone(http: Request | None, awaitable, on_gone=lambda: None):
    """awaitable's result, unless the client goes away first: then on_gone() runs, the awaitable
    is cancelled (an RPC under it with it) and the route answers 499."""
    done = asyncio.ensure_future(awaitable)

    async def abort() -> None:
        on_gone()
        done.cancel()
        await asyncio.gather(done, return_exceptions=True)

    while True:
        try:
            finished, _ = await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
        except asyncio.CancelledError:
            # The route itself was cancelled (shutdown past its bound): the workers stop too.
            await asyncio.shield(abort())
            raise
        if finished:
            return done.result()
        if http is not None and await http.is_disconnected():
            await abort()
            raise OpenAIError(499, "the client closed the request")


def log_ignored(endpoint: str, request) -> None:
    if request.ignored_fields:
        log.warning(
            "%s: ignoring fields tandem does not know: %s", endpoint, request.ignored_fields
        )


async def within_context(
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

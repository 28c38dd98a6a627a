"""Cross-cutting server concerns: exception -> status mapping, readiness, and the handler
wrapping the others (auth, metrics, drain) share. server_calls.py applies them all as one
grpc.aio interceptor."""

from __future__ import annotations

import contextlib
import inspect
import logging

import grpc

from tandem.common.errors import RETRY_PUSHBACK_METADATA, retry_pushback_ms, status_for

log = logging.getLogger("tandem.rpc")
# grpc-retry-pushback-ms that forbids a retry.
NO_RETRY = "-1"


async def abort_for(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    pushback_ms = retry_pushback_ms(exc)
    # An answer the service decided on is not a router gone away: a negative pushback tells the
    # client's retry policy (gRFC A6; client/transport.py) not to send the call again elsewhere.
    # A refusal with a hint (busy: retry after it) keeps its hint.
    context.set_trailing_metadata(
        ((RETRY_PUSHBACK_METADATA, str(pushback_ms) if pushback_ms is not None else NO_RETRY),)
    )
    await context.abort(code, message)


class MalformedRequest:
    """What a request deserializer gives for bytes that are not the message: the handler
    answers INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self, error: Exception):
        self.error = error


def tolerant_deserializer(deserializer):
    """deserializer giving a MalformedRequest for bytes that do not parse."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - a client's bad bytes, answered by the handler
            return MalformedRequest(exc)

    return parse


async def refuse_if_malformed(context: grpc.aio.ServicerContext, method: str, request) -> None:
    if not isinstance(request, MalformedRequest):
        return
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{method}: the request is not a valid protobuf message ({request.error})",
    )


class Readiness:
    """Answers UNAVAILABLE until the service is ready (the port opens before the model is loaded)."""

    def __init__(self, is_ready, exempt: frozenset[str]):
        self._is_ready = is_ready
        self._exempt = exempt

    def lets_through(self, method: str) -> bool:
        return (
            self._is_ready()
            or method.rsplit("/", 1)[-1] in self._exempt
            or not method.startswith("/tandem.")
        )

    @staticmethod
    def refuse(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
        """What answers a call that came too early, in handler's place."""

        async def unavailable_unary(request, context):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model; retry shortly"
            )

        async def unavailable_stream(request, context):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model; retry shortly"
            )
            yield  # pragma: no cover

        if handler is not None and handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                unavailable_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler is not None and handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                unavailable_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler is not None and handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                unavailable_unary, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            unavailable_unary,
            handler.request_deserializer if handler else None,
            handler.response_serializer if handler else None,
        )


async def _no_check(request, context) -> None:
    return None


def wrap_handler(
    handler: grpc.RpcMethodHandler | None, guard, tolerant: bool = False, check=_no_check
) -> grpc.RpcMethodHandler | None:
    """The handler with guard(context), an async context manager, around every call, for each kind
    of handler grpc.aio has: unary, streams of responses or requests or both, as generators or as
    writer-API coroutines (context.write, as health's Watch). Every kind is wrapped: the guard is
    also the access check (auth.guarded). grpc tells the streaming kinds apart by the function's
    type, so a wrapper must be of the same type as what it wraps. tolerant: bytes that do not
    parse reach the handler as a MalformedRequest; check(request, context) runs inside the guard
    before the handler of a single request."""
    if handler is None:
        return None
    deserializer = (
        tolerant_deserializer(handler.request_deserializer)
        if tolerant
        else handler.request_deserializer
    )
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            async with guard(context):
                await check(request, context)
                return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream
        if inspect.iscoroutinefunction(inner_stream):

            async def unary_stream(request, context):
                async with guard(context):
                    await check(request, context)
                    await inner_stream(request, context)
        else:

            async def unary_stream(request, context):
                async with guard(context):
                    await check(request, context)
                    async for item in inner_stream(request, context):
                        yield item

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, deserializer, handler.response_serializer
        )
    # Streams of requests: check() looks at one request, so a stream's messages are the handler's
    # to check (the tolerant deserializer still hands it a MalformedRequest for bad bytes).
    if handler.stream_stream is not None:
        inner_bidi = handler.stream_stream
        if inspect.isasyncgenfunction(inner_bidi):

            async def stream_stream(requests, context):
                async with guard(context):
                    async for item in inner_bidi(requests, context):
                        yield item
        else:

            async def stream_stream(requests, context):
                async with guard(context):
                    await inner_bidi(requests, context)

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, deserializer, handler.response_serializer
        )
    inner_client_stream = handler.stream_unary

    async def stream_unary(requests, context):
        async with guard(context):
            return await inner_client_stream(requests, context)

    return grpc.stream_unary_rpc_method_handler(
        stream_unary, deserializer, handler.response_serializer
    )


def map_errors(method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """handler with exceptions escaping the servicer turned into the status status_for() names,
    and requests that do not parse answered INVALID_ARGUMENT."""

    @contextlib.asynccontextmanager
    async def mapped(context):
        try:
            yield
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await abort_for(context, method, exc)

    async def refuse_malformed(request, context):
        await refuse_if_malformed(context, method, request)

    return wrap_handler(handler, mapped, tolerant=True, check=refuse_malformed)

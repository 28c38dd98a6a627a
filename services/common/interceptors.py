"""Cross-cutting server concerns: exception -> status mapping, request ids in logs."""
from __future__ import annotations

import contextlib
import inspect
import logging

import grpc

from tandem.common.errors import status_for

log = logging.getLogger("tandem.rpc")


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    await context.abort(code, message)


class ReadinessInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAVAILABLE until the service is ready (the port opens before the model is loaded)."""

    def __init__(self, is_ready, exempt: frozenset[str]):
        self._is_ready = is_ready
        self._exempt = exempt

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if self._is_ready() or method.rsplit("/", 1)[-1] in self._exempt or not method.startswith("/tandem."):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)

        async def unavailable_unary(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model; retry shortly")

        async def unavailable_stream(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model; retry shortly")
            yield  # pragma: no cover

        if handler is not None and handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(unavailable_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(unavailable_unary, handler.request_deserializer if handler else None,
                                                   handler.response_serializer if handler else None)


def wrap_handler(handler: grpc.RpcMethodHandler | None, guard) -> grpc.RpcMethodHandler | None:
    """The handler with guard(context), an async context manager, around every call, for each kind
    of handler grpc.aio has: unary, server-streaming generators and writer-API streams (context.write,
    as health's Watch). grpc tells the streaming kinds apart by the function's type, so a wrapper
    must be of the same type as what it wraps."""
    if handler is None:
        return None
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            async with guard(context):
                return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream
        if inspect.iscoroutinefunction(inner_stream):
            async def unary_stream(request, context):
                async with guard(context):
                    await inner_stream(request, context)
        else:
            async def unary_stream(request, context):
                async with guard(context):
                    async for item in inner_stream(request, context):
                        yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a servicer into the status status_for() names."""

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method

        @contextlib.asynccontextmanager
        async def mapped(context):
            try:
                yield
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                await _abort(context, method, exc)

        return wrap_handler(await continuation(handler_call_details), mapped)

"""Cross-cutting server concerns: exception -> status mapping, request ids in logs."""
from __future__ import annotations

import logging

import grpc

from tandem.common.errors import status_for

log = logging.getLogger("tandem.rpc")


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    await context.abort(code, message)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a servicer into the status status_for() names."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                    await _abort(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    await _abort(context, method, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler

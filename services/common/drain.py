"""Graceful drain: the calls a stopping server waits for.

On SIGTERM a tandem process turns its health NOT_SERVING (kubelet's readiness probe and the
router's health polls stop sending it work), keeps serving what it has, and exits once
nothing holds the drain or the drain window (`--drain-seconds`) is over. What holds it:
tandem RPCs in flight (counted here) and whatever the process adds (a prefill's KV leases).
"""

from __future__ import annotations

import inspect

import grpc

# Seconds a stopping process drains by default (Kubernetes' default termination grace is 30 s).
DEFAULT_DRAIN_SECONDS = 30.0
# Subscriptions (and sessions, whose requests hold the drain themselves:
# worker/session_server.py, and a prefill's stream of handoffs to a decode) end only when their
# client leaves: a drain never waits for them.
SUBSCRIPTIONS = frozenset(
    {"StreamStats", "StreamKvCacheEvents", "SubscribeKvBlocks", "Session", "HandOff"}
)


def holds_drain(method: str) -> bool:
    """Health checks and reflection never hold a drain, nor do subscriptions; every other tandem RPC does."""
    service, _, name = method.rpartition("/")
    return service.startswith("/tandem.") and name not in SUBSCRIPTIONS


class InFlightCalls:
    """Counts the RPCs that hold a drain while they are being served (server_calls.py wraps them)."""

    def __init__(self):
        self.count = 0

    def wrap(
        self, method: str, handler: grpc.RpcMethodHandler | None
    ) -> grpc.RpcMethodHandler | None:
        if handler is None or not holds_drain(method):
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                self.count += 1
                try:
                    return await inner(request, context)
                finally:
                    self.count -= 1

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                self.count += 1
                stream = inner_stream(request, context)
                try:
                    async for item in stream:
                        yield item
                finally:
                    self.count -= 1
                    # Close the servicer's generator now (a cancelled call's cleanup: aborts, call.cancel())
                    # rather than whenever the garbage collector finalizes it.
                    await stream.aclose()

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler  # tandem's streams are async generators; its one bidi stream (Session) is a subscription

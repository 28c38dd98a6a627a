"""The one grpc.aio interceptor of a tandem server: around every call, outermost first, the RPC
count by status (metrics.py), the drain's in-flight count (drain.py), access control (auth.py),
readiness and error mapping (interceptors.py).

As five interceptors they cost each call five awaited intercept_service calls, five new handlers
and two async context managers, and each streamed message three generator hops. Here the usual
call (allowed, ready) gets one wrapper per method, built once, that counts, maps errors and
holds the drain in one generator; any other call (refused, not ready, a kind of handler the
wrapper does not cover) gets the concerns' own wrappers, composed in the same order.
"""

from __future__ import annotations

import inspect

import grpc

from tandem.common.auth import ALLOW, AccessPolicy, guarded
from tandem.common.drain import InFlightCalls, holds_drain
from tandem.common.interceptors import (
    Readiness,
    abort_for,
    map_errors,
    refuse_if_malformed,
    tolerant_deserializer,
)
from tandem.common.metrics import RpcCounts


class ServerCalls(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        policy: AccessPolicy,
        in_flight: InFlightCalls,
        readiness: Readiness | None = None,
        rpc_counts: RpcCounts | None = None,
    ):
        self.policy = policy
        self.in_flight = in_flight
        self.readiness = readiness
        self.rpc_counts = rpc_counts
        # method -> (the servicer's handler, its one-wrapper form)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        verdict = self.policy.decide(method, dict(handler_call_details.invocation_metadata or ()))
        ready = self.readiness is None or self.readiness.lets_through(method)
        if verdict is ALLOW and ready:
            cached = self._wrapped.get(method)
            if cached is not None and cached[0] is handler:
                return cached[1]
            wrapped = self._one_wrapper(method, handler)
            if wrapped is not None:
                self._wrapped[method] = (handler, wrapped)
                return wrapped
        return self._layered(method, handler, verdict, ready)

    def _layered(
        self, method: str, handler: grpc.RpcMethodHandler, verdict, ready: bool
    ) -> grpc.RpcMethodHandler:
        """The concerns' own wrappers, innermost first."""
        handler = map_errors(method, handler)
        if not ready:
            handler = Readiness.refuse(handler)
        if verdict is not ALLOW:
            handler = guarded(handler, verdict)
        handler = self.in_flight.wrap(method, handler)
        return self.rpc_counts.wrap(method, handler) if self.rpc_counts is not None else handler

    def _one_wrapper(
        self, method: str, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler | None:
        """What _layered gives an allowed call of a ready server, as one wrapper; None for the
        kinds it does not cover (writer-API streams, client streams)."""
        in_flight = self.in_flight
        count = self.rpc_counts.count if self.rpc_counts is not None else _uncounted
        holds = holds_drain(method)
        deserializer = tolerant_deserializer(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                if holds:
                    in_flight.count += 1
                try:
                    try:
                        await refuse_if_malformed(context, method, request)
                        reply = await inner(request, context)
                    except grpc.aio.AbortError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                        await abort_for(context, method, exc)
                        reply = None  # pragma: no cover - abort_for raises
                    finally:
                        if holds:
                            in_flight.count -= 1
                except BaseException as exc:
                    count(method, context, exc)
                    raise
                count(method, context, None)
                return reply

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                if holds:
                    in_flight.count += 1
                stream = None
                try:
                    try:
                        await refuse_if_malformed(context, method, request)
                        stream = inner_stream(request, context)
                        async for item in stream:
                            yield item
                    except grpc.aio.AbortError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                        await abort_for(context, method, exc)
                    finally:
                        if holds:
                            in_flight.count -= 1
                        if stream is not None:
                            # Close the servicer's generator now (a cancelled call's cleanup: aborts,
                            # call.cancel()) rather than whenever the garbage collector finalizes it.
                            await stream.aclose()
                except BaseException as exc:
                    count(method, context, exc)
                    raise
                count(method, context, None)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, deserializer, handler.response_serializer
            )
        return None


def _uncounted(method: str, context, exc: BaseException | None) -> None:
    """The RPC count of a server without metrics."""

"""Bearer-token check for admin RPCs (weights, memory, pause, collective_rpc, shutdown)."""
from __future__ import annotations

import hmac

import grpc

ADMIN_METHODS = frozenset({
    "PauseGeneration", "ResumeGeneration", "Release", "Resume", "UpdateWeights", "CollectiveRpc", "Shutdown",
    "ReleaseKv",
})


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class AdminAuthInterceptor(grpc.aio.ServerInterceptor):
    """Admin RPCs need `authorization: Bearer <token>` when a token is configured:
    none given is UNAUTHENTICATED, a wrong one PERMISSION_DENIED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if method not in ADMIN_METHODS:
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if given is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED,
                         f"{method} is an admin call: send 'authorization: Bearer <token>' metadata")
        if not hmac.compare_digest(given.encode(), self._expected):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, f"{method}: the admin token is wrong")
        return await continuation(handler_call_details)


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(code, message)
    return grpc.unary_unary_rpc_method_handler(abort)

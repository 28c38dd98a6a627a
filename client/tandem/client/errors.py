"""The errors a tensorrt_llm user catches, raised for what the server refuses.

tensorrt_llm raises `RequestError(RuntimeError)` (tensorrt_llm/executor/utils.py) for a
request that failed, and ValueError for bad input. Here every refused call raises a
RequestError that also carries the gRPC status: `err.code` (grpc.StatusCode) and
`err.details` (the server's message). Bad input is also a ValueError, a feature this
build lacks also a NotImplementedError, so code written for either catches it.
"""

from __future__ import annotations

import grpc


class RequestError(RuntimeError):
    """A call the server refused or could not run."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None):
        super().__init__(f"{details} [{code.name}]")
        self.code = code
        self.details = details
        # The server's hint (grpc-retry-pushback-ms) when the refusal is temporary, e.g. a
        # client's unpulled KV handoffs fill its share of a prefill worker's pool.
        self.retry_after_s = retry_after_s


class InvalidRequestError(RequestError, ValueError):
    """Bad input: INVALID_ARGUMENT, OUT_OF_RANGE, or a prompt that can never fit (RESOURCE_EXHAUSTED)."""


class UnsupportedRequestError(RequestError, NotImplementedError):
    """UNIMPLEMENTED: the request asks for a feature this build does not have (the message names it)."""


class RequestTimeoutError(RequestError, TimeoutError):
    """DEADLINE_EXCEEDED: the call ran past its timeout."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidRequestError,
    grpc.StatusCode.UNIMPLEMENTED: UnsupportedRequestError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestTimeoutError,
}


def from_rpc_error(exc: grpc.RpcError) -> RequestError:
    """The RequestError for a failed gRPC call (grpc.aio.AioRpcError or a sync grpc.Call)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    pushback = (
        dict(exc.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        if hasattr(exc, "trailing_metadata")
        else None
    )
    # A negative pushback means "do not retry" (gRFC A6): no retry-after hint.
    retry_after = int(pushback) / 1000 if pushback and int(pushback) >= 0 else None
    error = _BY_CODE.get(code, RequestError)(code, details, retry_after)
    error.__cause__ = exc
    return error

"""Exceptions that carry a gRPC status, and the mapping of every other exception onto one.

Kept free of torch so the router and the client side can import it.
"""

from __future__ import annotations

import contextlib

import grpc

from tandem.common.exceptions import PreconditionError, ResourceExhaustedError, RetryLaterError  # noqa: F401

# gRPC's server pushback trailer: how long the client should wait before it retries.
RETRY_PUSHBACK_METADATA = "grpc-retry-pushback-ms"


class RpcError(Exception):
    """Raise inside a servicer to answer with this status and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# Trailing metadata of a request's failure that says what failed, for a caller that acts on it
# (the router retries a KV load failure on another prefill/decode pair).
FAILURE_REASON_METADATA = "tandem-failure-reason"
# The reason a decode under --kv-load-failure-policy fail ends a request with (":" and why).
KV_LOAD_FAILED = "kv_load_failed"


class KvLoadFailedError(RpcError):
    """A decode could not load a handoff's KV and its policy is to fail rather than compute the
    prompt itself: UNAVAILABLE, with the reason for the router (failure_reason)."""

    def __init__(self, message: str, why: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.failure_reason = f"{KV_LOAD_FAILED}:{why}"


# The reason an announced generation_only request (SessionSubmit.awaits_handoff) fails with when it
# failed before its handoff came: nothing of the handoff was used, so the caller may send the
# whole request again (the router does, to a decode it picks afresh).
BEFORE_HANDOFF = "before_handoff"


@contextlib.contextmanager
def failing_before_handoff(active: bool):
    """While active, an exception leaving the block becomes its status (status_for) with the
    reason BEFORE_HANDOFF."""
    try:
        yield
    except Exception as exc:
        if not active:
            raise
        code, details = status_for(exc)
        error = RpcError(code, details)
        error.failure_reason = BEFORE_HANDOFF
        raise error from exc


def failure_reason(exc: BaseException) -> str:
    """What exc says failed (FAILURE_REASON_METADATA): its own, or a downstream worker's."""
    if isinstance(exc, grpc.aio.AioRpcError):
        for key, value in exc.trailing_metadata() or ():
            if key == FAILURE_REASON_METADATA:
                return value
        return ""
    return getattr(exc, "failure_reason", "")


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unavailable(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, message)


_BY_TYPE: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a servicer answers with for exc. User mistakes are never INTERNAL."""
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        # A downstream worker's status passes through unchanged (the router relays it).
        return exc.code(), exc.details() or ""
    for exc_type, code in _BY_TYPE:
        if isinstance(exc, exc_type):
            return code, str(exc) or exc_type.__name__
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def retry_pushback_ms(exc: BaseException) -> int | None:
    """The retry hint exc carries: its own, or the one a downstream worker sent (relayed as is)."""
    if isinstance(exc, RetryLaterError):
        return int(exc.retry_after_s * 1000)
    if isinstance(exc, grpc.aio.AioRpcError):
        for key, value in exc.trailing_metadata() or ():
            if key == RETRY_PUSHBACK_METADATA and int(value) >= 0:
                return int(value)
    return None

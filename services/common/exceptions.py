"""Exception types every layer raises, free of grpc and torch: the engine raises them, and
common.errors maps them onto gRPC statuses at the service edge."""

from __future__ import annotations


class ResourceExhaustedError(RuntimeError):
    """A request that can never fit (RESOURCE_EXHAUSTED)."""


class RetryLaterError(ResourceExhaustedError):
    """A request over a bound that frees up with time (RESOURCE_EXHAUSTED, with the seconds
    to wait in the message and in the grpc-retry-pushback-ms trailer)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(f"{message}; retry in {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class PreconditionError(RuntimeError):
    """The call is fine but the server is not in a state to run it (FAILED_PRECONDITION)."""


class IncompatibleHandoffError(PreconditionError):
    """A KV handoff between workers with different layouts (FAILED_PRECONDITION)."""

"""Exception types every layer raises, free of grpc and torch: the engine raises them, and
common.errors maps them onto gRPC statuses at the service edge."""
from __future__ import annotations


class ResourceExhaustedError(RuntimeError):
    """A request that can never fit (RESOURCE_EXHAUSTED)."""


class PreconditionError(RuntimeError):
    """The call is fine but the server is not in a state to run it (FAILED_PRECONDITION)."""


class IncompatibleHandoffError(PreconditionError):
    """A KV handoff between workers with different layouts (FAILED_PRECONDITION)."""

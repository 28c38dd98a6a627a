"""A request's outputs in the router as its session's reader hands them over (session_client.py),
and what each says to the relay that reads them (message_of): a message, the end, or the error its
own Generate call would have given. The messages are built here, once, from the worker's EngineOutput entries
(common/engine_messages.OutputBuilder): the entries that arrive while the relay is busy fold
into one message (a lagging client gets fewer, larger messages)."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from tandem.common.engine_messages import OutputBuilder
from tandem.common.errors import FAILURE_REASON_METADATA, RETRY_PUSHBACK_METADATA
from tandem.v1 import internal_pb2, types_pb2, worker_pb2

# Put on a request's inbox after its last output.
ENDED = object()
# Put on a request's inbox when its relay is cut here (Abort found nothing to abort, the
# watchdog found the worker hung): reading it raises CancelledError, as a cancelled call does.
CUT = object()


def stream_failure(
    code: grpc.StatusCode, details: str, retry_pushback_ms: int = 0, reason: str = ""
) -> grpc.aio.AioRpcError:
    """What a request that failed on its session raises: the error its own call would have
    (its retry hint and what failed in its trailing metadata)."""
    trailing = ((RETRY_PUSHBACK_METADATA, str(retry_pushback_ms)),) if retry_pushback_ms else ()
    if reason:
        trailing += ((FAILURE_REASON_METADATA, reason),)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class SessionBroken(grpc.aio.AioRpcError):
    """The session a request ran on ended under it (the worker went away, or the stream broke):
    the request cannot go on there, whatever the worker's health says, so failover moves it on
    (router/relay.py). UNAVAILABLE to a client when no worker is left to move it to."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            f"the session with the worker ended ({code.name}: {details})",
        )


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def failure_error(failure: worker_pb2.SessionFailure) -> grpc.aio.AioRpcError:
    code = _CODES.get(failure.code, grpc.StatusCode.UNKNOWN)
    return stream_failure(code, failure.details, failure.retry_pushback_ms, failure.reason)


class Inbox:
    """A request's outputs as the session reader hands them over; the relay takes all there are at
    once. Entries that come one after another fold into one message as they come: what the inbox
    holds stays one message however far its client lags."""

    __slots__ = ("items", "request_id", "_waiter")

    def __init__(self, request_id: str = ""):
        self.items: deque = deque()
        # The id the request's messages carry (the one it was submitted with).
        self.request_id = request_id
        self._waiter: asyncio.Future | None = None

    def put_entry(self, entry: internal_pb2.EngineOutput) -> None:
        items = self.items
        if items and items[-1].__class__ is OutputBuilder:
            items[-1].add(entry)
            return  # the relay was woken by the builder's first entry
        builder = OutputBuilder(self.request_id)
        builder.add(entry)
        self.put(builder)

    def put(self, item) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self.items)
        self.items.clear()
        return items


def message_of(item) -> types_pb2.RequestOutput | None:
    """What an item taken from an inbox says, as iterating the request's own call would: its
    message (the entries that piled up while the relay was busy, as one), None at the request's
    end; its error status raised, CancelledError once its relay was cut."""
    if item.__class__ is OutputBuilder:
        return item.build()
    if item is ENDED:
        return None
    if item is CUT:
        raise asyncio.CancelledError()
    raise item  # the request failed, or the session broke

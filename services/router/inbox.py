"""A request's outputs in the router as its session's reader hands them over (sessions.py), and
the stream the relay reads from them: the messages, the end, or the error its own Generate call
would have given."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from tandem.common.errors import RETRY_PUSHBACK_METADATA
from tandem.common.outputs import merge_outputs, merged
from tandem.v1 import types_pb2, worker_pb2

# Put on a request's inbox after its last output.
ENDED = object()
# Put on a request's inbox when its relay is cut here (Abort found nothing to abort, the
# watchdog found the worker hung): reading it raises CancelledError, as a cancelled call does.
CUT = object()
# Outputs an inbox holds before it merges them into one (its client lags behind the worker).
MAX_PENDING_OUTPUTS = 64


def stream_failure(
    code: grpc.StatusCode, details: str, retry_pushback_ms: int = 0
) -> grpc.aio.AioRpcError:
    """What a request that failed on its session raises: the error its own call would have."""
    trailing = ((RETRY_PUSHBACK_METADATA, str(retry_pushback_ms)),) if retry_pushback_ms else ()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class SessionBroken(grpc.aio.AioRpcError):
    """The session a request ran on ended under it (the worker went away, or the stream broke):
    the request cannot go on there, whatever the worker's health says, so failover moves it on
    (router/failover.py). UNAVAILABLE to a client when no worker is left to move it to."""

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
    return stream_failure(code, failure.details, failure.retry_pushback_ms)


class Inbox:
    """A request's outputs as the session reader hands them over; the relay takes all there are at once."""

    __slots__ = ("items", "request_id", "_waiter")

    def __init__(self):
        self.items: deque = deque()
        # The request id the worker's messages carry, from the first (a lone token's message is
        # built with it: the worker sends lone tokens only after a request's first message).
        self.request_id = ""
        self._waiter: asyncio.Future | None = None

    def put_token(self, token_id: int, cumulative_logprob: float) -> None:
        """A lone token (OutputBatch.tokens): the message the worker would have sent for it."""
        self.put(
            types_pb2.RequestOutput(
                request_id=self.request_id,
                outputs=[
                    types_pb2.CompletionOutput(
                        index=0, token_ids=[token_id], cumulative_logprob=cumulative_logprob
                    )
                ],
            )
        )

    def put(self, item) -> None:
        if not self.request_id and item.__class__ is types_pb2.RequestOutput:
            self.request_id = item.request_id
        items = self.items
        items.append(item)
        if len(items) >= MAX_PENDING_OUTPUTS and all(
            i.__class__ is types_pb2.RequestOutput for i in items
        ):
            # A client that lags holds one merged message here, not one per engine step.
            one = merge_outputs(list(items))
            items.clear()
            items.append(one)
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


async def streamed_outputs(inbox: Inbox):
    """The messages of a request whose outputs come on a session, as iterating its own call would
    give them: its error status raised, CancelledError once its relay was cut. Outputs that piled
    up while the consumer was busy go on as one message (a lagging client gets fewer, larger
    messages)."""
    while True:
        pending: list[types_pb2.RequestOutput] = []
        for item in await inbox.take():
            if item.__class__ is types_pb2.RequestOutput:
                pending.append(item)
                continue
            if pending:
                yield merged(pending)
                pending = []
            if item is ENDED:
                return
            if item is CUT:
                raise asyncio.CancelledError()
            raise item  # the request failed, or the session broke
        if pending:
            yield merged(pending)

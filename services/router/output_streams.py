"""The router's end of its workers' output streams (Worker.StreamOutputs, worker/output_streams.py):
one stream per worker carries the outputs of every Generate the router runs there, a batch
per engine step. Route.relay reads a request's outputs from the inbox its tag names here.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Callable

import grpc

from tandem.common.callers import UNKNOWN_OUTPUT_STREAM
from tandem.common.outputs import merge_outputs, merged
from tandem.v1 import types_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.router.output_streams")

# Put on a request's inbox after its last output.
ENDED = object()
# Outputs an inbox holds before it merges them into one (its client lags behind the worker).
MAX_PENDING_OUTPUTS = 64
# Seconds after a failed open before the next try (meanwhile calls stream their own outputs).
RETRY_OPEN_S = 1.0


def is_unknown_output_stream(exc: grpc.aio.AioRpcError) -> bool:
    """The worker refused a Generate for naming a stream it does not hold (worker/output_streams.py)."""
    return exc.code() is grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith(UNKNOWN_OUTPUT_STREAM)


def stream_failure(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What a request whose output stream broke raises: the error its own call would have."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Inbox:
    """A request's outputs as the stream reader hands them over; the relay takes all there are at once."""
    __slots__ = ("items", "request_id", "_waiter")

    def __init__(self):
        self.items: deque = deque()
        # The request id the worker's messages carry, from the first (a lone token's message is
        # built with it: the worker sends lone tokens only after a request's first message).
        self.request_id = ""
        self._waiter: asyncio.Future | None = None

    def put_token(self, token_id: int, cumulative_logprob: float) -> None:
        """A lone token (OutputBatch.tokens): the message the worker would have sent for it."""
        self.put(types_pb2.RequestOutput(request_id=self.request_id, outputs=[types_pb2.CompletionOutput(
            index=0, token_ids=[token_id], cumulative_logprob=cumulative_logprob)]))

    def put(self, item) -> None:
        if not self.request_id and item.__class__ is types_pb2.RequestOutput:
            self.request_id = item.request_id
        items = self.items
        items.append(item)
        if len(items) >= MAX_PENDING_OUTPUTS and all(i.__class__ is types_pb2.RequestOutput for i in items):
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
    """The messages of a Generate whose worker writes them on an output stream, as iterating its
    call would give them (report_end hands the call's own end over): its error status raised,
    CancelledError once the call is cancelled. Outputs that piled up while the consumer was busy
    go on as one message (a lagging client gets fewer, larger messages)."""
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
            if isinstance(item, grpc.aio.Call):
                # The call ended: reading it raises its error status, or CancelledError if it
                # was cancelled; one that ended well says nothing (the stream's end mark comes).
                async for _ in item:
                    pass
                continue
            raise item  # the stream broke
        if pending:
            yield merged(pending)


def report_end(call: grpc.aio.UnaryStreamCall, inbox: Inbox) -> None:
    """Hands the call's own end (the call, once done) to the inbox, where streamed_outputs reads
    it. A done callback, not a task reading the call (a task and a receive per call: 60-140 us of
    CPU, bench/grpc_call_end.py). The call carries no message (worker.proto: a Generate that
    names a stream sends its outputs there), so its status comes without one being read."""
    call.add_done_callback(inbox.put)


class _OpenStream:
    """One StreamOutputs call and the queues of the requests whose outputs it carries."""

    def __init__(self, call, stream_id: str, on_orphan: Callable[[types_pb2.RequestOutput], None] | None = None):
        self.call = call
        self.stream_id = stream_id
        # Called with an output whose relay is over (a cancelled or failed call's stragglers).
        self.on_orphan = on_orphan
        self.inboxes: dict[int, Inbox] = {}
        self.failure: tuple[grpc.StatusCode, str] | None = None
        self._next_tag = 0
        self._reader = asyncio.create_task(self._read())

    def attach(self) -> tuple[int, Inbox] | None:
        """A tag and its inbox; None once the stream has failed (its failure was sent to the
        inboxes it had: a new one would never hear of it)."""
        if self.failure is not None:
            return None
        self._next_tag += 1
        inbox = self.inboxes[self._next_tag] = Inbox()
        return self._next_tag, inbox

    def detach(self, tag: int) -> None:
        self.inboxes.pop(tag, None)

    async def _read(self) -> None:
        inboxes = self.inboxes
        failure = (grpc.StatusCode.UNAVAILABLE, "the worker closed its output stream")
        try:
            # read(), as _open's first read: grpc.aio refuses a call read both ways.
            while (batch := await self.call.read()) is not grpc.aio.EOF:
                if batch.tokens:
                    self._deliver_mixed(batch)
                else:
                    for tag, output in zip(batch.tags, batch.outputs):
                        self._deliver(inboxes.get(tag), output)
                for tag in batch.ended:
                    inbox = inboxes.get(tag)
                    if inbox is not None:
                        inbox.put(ENDED)
        except grpc.aio.AioRpcError as exc:
            failure = (exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            failure = (grpc.StatusCode.UNAVAILABLE, "the router closed its output stream")
            raise
        except Exception as exc:  # noqa: BLE001 - a bad batch ends the stream; its requests fail over
            log.exception("output stream %s failed", self.stream_id)
            failure = (grpc.StatusCode.INTERNAL, f"the output stream broke: {exc}")
        finally:
            self.failure = failure
            self.call.cancel()  # the worker's side ends too, whatever ended ours
            log.info("output stream %s ended: %s %s", self.stream_id, failure[0].name, failure[1])
            for inbox in inboxes.values():
                inbox.put(stream_failure(*failure))

    def _deliver(self, inbox: Inbox | None, output: types_pb2.RequestOutput) -> None:
        if inbox is not None:
            inbox.put(output)
        elif self.on_orphan is not None:  # its relay is over (a cancelled call's stragglers)
            self.on_orphan(output)

    def _deliver_mixed(self, batch: worker_pb2.OutputBatch) -> None:
        """A batch with lone tokens: entry i is batch.tokens[i], or the next full output where that is -1."""
        tags, tokens = batch.tags, batch.tokens
        if len(tokens) != len(tags) or len(batch.cumulative_logprobs) != len(tags) \
                or sum(1 for t in tokens if t < 0) != len(batch.outputs):
            raise ValueError(f"malformed output batch: {len(tags)} tags, {len(tokens)} tokens, "
                             f"{len(batch.cumulative_logprobs)} logprobs, {len(batch.outputs)} outputs")
        inboxes = self.inboxes
        outputs = iter(batch.outputs)
        for tag, token, cumulative in zip(tags, tokens, batch.cumulative_logprobs):
            inbox = inboxes.get(tag)
            if token < 0:
                self._deliver(inbox, next(outputs))
            elif inbox is not None:  # a lone token whose relay is over is nobody's (it holds no handoff)
                inbox.put_token(token, cumulative)

    def close(self) -> None:
        self._reader.cancel()
        self.call.cancel()


class WorkerOutputs:
    """One worker's output stream, opened on first use and again after it broke."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str,
                 on_orphan: Callable[[types_pb2.RequestOutput], None] | None = None):
        self._stub = stub
        self._address = address
        self._on_orphan = on_orphan
        self._stream: _OpenStream | None = None
        self._opening: asyncio.Task | None = None
        # After a failed open, calls stream their own outputs until then (loop time).
        self._retry_at = 0.0
        # The worker has no StreamOutputs (an older version): its calls stream their own outputs.
        self.unsupported = False

    async def attach(self, timeout: float) -> tuple[_OpenStream, int, Inbox] | None:
        """(stream, tag, inbox) for one Generate's outputs, or None when the worker's stream
        cannot be had (the call then streams its outputs itself, as to any caller)."""
        if self.unsupported:
            return None
        stream = self._stream
        if stream is None or stream.failure is not None:
            if asyncio.get_running_loop().time() < self._retry_at:
                return None
            if self._opening is None:
                self._opening = asyncio.create_task(self._open(timeout))
            stream = await asyncio.shield(self._opening)
            if stream is None:
                return None
        attached = stream.attach()
        if attached is None:  # it failed meanwhile: this call streams its own outputs
            return None
        tag, inbox = attached
        return stream, tag, inbox

    async def _open(self, timeout: float) -> _OpenStream | None:
        try:
            return await self._open_call(timeout)
        finally:
            self._opening = None  # done, whoever still waits for it

    async def _open_call(self, timeout: float) -> _OpenStream | None:
        call = self._stub.StreamOutputs(worker_pb2.StreamOutputsRequest())
        try:
            first = await asyncio.wait_for(call.read(), timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            call.cancel()
            self._retry_at = asyncio.get_running_loop().time() + RETRY_OPEN_S
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
            log.info("no output stream from %s (%s); its calls stream their own outputs", self._address,
                     exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "timeout")
            return None
        if first is grpc.aio.EOF or not first.stream_id:
            call.cancel()
            self._retry_at = asyncio.get_running_loop().time() + RETRY_OPEN_S
            return None
        self._stream = _OpenStream(call, first.stream_id, self._on_orphan)
        return self._stream

    def reset(self, stream: _OpenStream) -> None:
        """The worker does not know stream: the next attach opens another (unless one already replaced it)."""
        if self._stream is stream:
            stream.close()
            self._stream = None

    def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self._stream is not None:
            self._stream.close()

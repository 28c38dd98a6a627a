"""Batched output channels (Worker.StreamOutputs): the router's Generate calls name one, and
their outputs travel on it, one message per engine step for all of them, instead of one
message per request per step on each call. gRPC's cost is per message, on both ends: at a
batch of 256 a step cost the worker and the router 256 sends and reads; here it costs one.

A request still has its own Generate call: it carries the request in, its status and its
cancellation; only its outputs move. Its call ends after its last output is written here, so
the caller has every output once it sees the call end well (or this stream fail).
"""
from __future__ import annotations

import asyncio
import uuid

import grpc

from tandem.common.callers import OUTPUT_STREAM_METADATA, UNKNOWN_OUTPUT_STREAM
from tandem.common.errors import RpcError, unavailable
from tandem.v1 import types_pb2, worker_pb2


class OutputStream:
    """One caller's channel. Senders append to the pending batch and wait until the batch that
    holds their output is written: a request has at most one output waiting here, and while the
    caller reads slowly the engine's outputs pile up in the request's own queue, where the
    next message takes them all (fewer, larger messages when the caller lags)."""

    def __init__(self, owner: str):
        self.stream_id = uuid.uuid4().hex
        self.owner = owner
        self._tags: list[int] = []
        self._outputs: list[types_pb2.RequestOutput] = []
        self._ended: list[int] = []
        # Resolved once the pending batch is written; and the one of the batch being written.
        self._written: asyncio.Future | None = None
        self._writing: asyncio.Future | None = None
        self._wake = asyncio.Event()
        self._error: RpcError | None = None

    async def send(self, tag: int, msg: types_pb2.RequestOutput) -> None:
        """Queues msg in the next batch and returns once that batch is written. A finished msg
        is the request's last: its end goes in the same batch."""
        if self._error is not None:
            raise self._error
        self._tags.append(tag)
        self._outputs.append(msg)
        if msg.finished:
            self._ended.append(tag)
        await asyncio.shield(self._pending_batch())

    def end(self, tag: int) -> None:
        """The request of tag has sent its last output, not a finished one (its end goes in the next batch)."""
        if self._error is None:
            self._ended.append(tag)
            self._pending_batch()

    def _pending_batch(self) -> asyncio.Future:
        if self._written is None:
            self._written = asyncio.get_running_loop().create_future()
            self._wake.set()
        return self._written

    async def batches(self):
        """The StreamOutputs call's messages: the stream id, then a batch whenever outputs are pending."""
        yield worker_pb2.OutputBatch(stream_id=self.stream_id)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch = worker_pb2.OutputBatch(tags=self._tags, outputs=self._outputs, ended=self._ended)
                self._writing, self._written = self._written, None
                self._tags, self._outputs, self._ended = [], [], []
                yield batch
                self._writing.set_result(None)
                self._writing = None
        finally:
            self._error = unavailable(f"output stream {self.stream_id} closed (its caller went away)")
            for future in (self._written, self._writing):
                if future is not None and not future.done():
                    future.set_exception(self._error)
                    future.exception()  # a sender cancelled meanwhile would leave it unretrieved


class OutputStreams:
    """The worker's open output streams, by id."""

    def __init__(self, max_streams: int = 64):
        self.max_streams = max_streams
        self._streams: dict[str, OutputStream] = {}

    @property
    def num_open(self) -> int:
        return len(self._streams)

    async def serve(self, owner: str):
        """Opens a stream for owner (the caller's identity) and yields its messages until the caller leaves."""
        if len(self._streams) >= self.max_streams:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{len(self._streams)} output streams are open on this worker (at most {self.max_streams}); "
                           f"close one first")
        stream = OutputStream(owner)
        self._streams[stream.stream_id] = stream
        try:
            async for batch in stream.batches():
                yield batch
        finally:
            self._streams.pop(stream.stream_id, None)

    def named(self, value: str, caller: str) -> tuple[OutputStream, int]:
        """The stream and tag a Generate's metadata names; only the stream's owner may name it."""
        stream_id, sep, tag = value.partition(":")
        if not sep or not tag.isdigit() or len(tag) > 20 or int(tag) >= 1 << 64:
            raise ValueError(f"metadata {OUTPUT_STREAM_METADATA} must be '<stream id>:<tag>', got {value[:80]!r}")
        stream = self._streams.get(stream_id)
        if stream is None or stream.owner != caller:
            # Also what a caller whose stream just closed sees: it retries on a new one.
            raise unavailable(f"{UNKNOWN_OUTPUT_STREAM}: {stream_id[:40]!r} is not open on this connection; open "
                              f"one with StreamOutputs")
        return stream, int(tag)

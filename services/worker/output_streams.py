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
from typing import Callable

import grpc

from tandem.common.callers import OUTPUT_STREAM_METADATA, UNKNOWN_OUTPUT_STREAM
from tandem.common.errors import RpcError, unavailable
from tandem.v1 import types_pb2, worker_pb2


class OutputStream:
    """One caller's channel. Outputs are pushed onto the pending batch (with a callback run once
    the batch that holds them is written, or the stream fails), and the StreamOutputs call
    writes whatever is pending as one message whenever it can: while the caller reads slowly,
    the batches grow (fewer, larger messages when the caller lags)."""

    def __init__(self, owner: str):
        self.stream_id = uuid.uuid4().hex
        self.owner = owner
        self._tags: list[int] = []
        self._outputs: list[types_pb2.RequestOutput] = []
        # Per entry of _tags: -1 (a full message, in _outputs) or a lone token (push_token).
        self._tokens: list[int] = []
        self._cumulative: list[float] = []
        self._num_tokens = 0
        self._ended: list[int] = []
        # Run (with None, or the stream's error) once the pending batch is written.
        self._callbacks: list[Callable[[BaseException | None], None]] = []
        # The callbacks of the batch being written.
        self._writing: list[Callable[[BaseException | None], None]] = []
        self._wake = asyncio.Event()
        self._error: RpcError | None = None

    def push(self, tag: int, msg: types_pb2.RequestOutput,
             on_written: Callable[[BaseException | None], None] | None = None) -> None:
        """Puts msg in the next batch. A finished msg is the request's last: its end goes in the
        same batch. on_written(None) runs once that batch is written, on_written(error) if the
        stream closes first."""
        if self._error is not None:
            raise self._error
        self._tags.append(tag)
        self._outputs.append(msg)
        self._tokens.append(-1)
        self._cumulative.append(0.0)
        if msg.finished:
            self._ended.append(tag)
        if on_written is not None:
            self._callbacks.append(on_written)
        self._wake.set()

    def push_token(self, tag: int, token_id: int, cumulative_logprob: float,
                   on_written: Callable[[BaseException | None], None]) -> None:
        """push of a message that holds one token of sequence 0 and nothing else (not the
        request's last), sent as two numbers instead of a RequestOutput (OutputBatch.tokens)."""
        if self._error is not None:
            raise self._error
        self._tags.append(tag)
        self._tokens.append(token_id)
        self._cumulative.append(cumulative_logprob)
        self._num_tokens += 1
        self._callbacks.append(on_written)
        self._wake.set()

    async def send(self, tag: int, msg: types_pb2.RequestOutput) -> None:
        """push, then wait until the batch holding msg is written."""
        written = asyncio.get_running_loop().create_future()
        self.push(tag, msg, lambda error: _resolve(written, error))
        await asyncio.shield(written)

    def end(self, tag: int) -> None:
        """The request of tag has sent its last output, not a finished one (its end goes in the next batch)."""
        if self._error is None:
            self._ended.append(tag)
            self._wake.set()

    async def batches(self):
        """The StreamOutputs call's messages: the stream id, then a batch whenever outputs are pending."""
        yield worker_pb2.OutputBatch(stream_id=self.stream_id)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._error is not None:
                    return
                if not self._tags and not self._ended:
                    continue
                batch = worker_pb2.OutputBatch(tags=self._tags, outputs=self._outputs, ended=self._ended)
                if self._num_tokens:
                    batch.tokens.extend(self._tokens)
                    batch.cumulative_logprobs.extend(self._cumulative)
                self._writing, self._callbacks = self._callbacks, []
                self._tags, self._outputs, self._ended = [], [], []
                self._tokens, self._cumulative, self._num_tokens = [], [], 0
                yield batch
                writing, self._writing = self._writing, []
                for callback in writing:
                    callback(None)
        finally:
            self.close()

    def close(self) -> None:
        """Fails what was pushed and not written; later pushes raise. Idempotent."""
        if self._error is None:
            self._error = unavailable(f"output stream {self.stream_id} closed (its caller went away)")
        callbacks = self._writing + self._callbacks
        self._writing, self._callbacks = [], []
        self._wake.set()  # the writer returns
        for callback in callbacks:
            callback(self._error)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
        future.exception()  # a sender cancelled meanwhile would leave it unretrieved


class OutputStreams:
    """The worker's open output streams, by id."""

    def __init__(self, max_streams: int = 64):
        self.max_streams = max_streams
        self._streams: dict[str, OutputStream] = {}

    @property
    def num_open(self) -> int:
        return len(self._streams)

    async def serve(self, owner: str, context=None):
        """Opens a stream for owner (the caller's identity) and yields its messages until the caller
        leaves. With the call's context, the stream closes as soon as the call ends (a generator
        suspended in a write is finalized only later)."""
        if len(self._streams) >= self.max_streams:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{len(self._streams)} output streams are open on this worker (at most {self.max_streams}); "
                           f"close one first")
        stream = OutputStream(owner)
        self._streams[stream.stream_id] = stream
        if context is not None:
            context.add_done_callback(lambda _: self._close(stream))
        try:
            async for batch in stream.batches():
                yield batch
        finally:
            self._close(stream)

    def _close(self, stream: OutputStream) -> None:
        self._streams.pop(stream.stream_id, None)
        stream.close()

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

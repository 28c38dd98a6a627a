"""A context phase's handoff sent straight to the decode worker the router announced its request
to (SessionSubmit.hand_off_to), over the authenticated internal plane (Worker/HandOff), beside
the reply to the router: the decode starts its pull without the hop through the router (the
prefill's reply reaching the router, then the router's handoff reaching the decode). One stream
per decode, kept open: a message costs less than a call. Best effort: the router's handoff
follows on its session whatever happens here, so a stream that fails is only logged (the next
handoff to that decode opens another), and one that holds MAX_QUEUED_BYTES not yet written drops
the next ones.

Addresses come only from the router's session (the authenticated internal plane): a client
cannot make a prefill dial out. The channels to the decodes are kept (at most MAX_PEERS, the
least recently used closed first).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import grpc

from tandem.common.channels import ClusterCredentials
from tandem.common.engine_messages import kv_params
from tandem.v1 import types_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.prefill.handoff_push")

MAX_PEERS = 64
# What a stream may hold not yet written (a decode that does not read: the router's handoffs go on).
MAX_QUEUED_BYTES = 16 << 20


class _Stream:
    """The kept HandOff stream to one decode: what send() queues goes out in order."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued_bytes = 0
        self.call = stub.HandOff(self._requests())
        self.watch: asyncio.Task | None = None

    async def _requests(self):
        while (request := await self.queue.get()) is not None:
            self.queued_bytes -= request.ByteSize()
            yield request

    def put(self, request: worker_pb2.HandOffRequest) -> None:
        size = request.ByteSize()
        if self.queued_bytes + size <= MAX_QUEUED_BYTES:
            self.queued_bytes += size
            self.queue.put_nowait(request)

    def end(self) -> None:
        """No more requests: the stream closes after those queued (and a consumer gRPC left
        waiting on a call that ended returns)."""
        self.queue.put_nowait(None)


class HandoffPush:
    def __init__(self, credentials: ClusterCredentials):
        self.credentials = credentials
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._streams: dict[str, _Stream] = {}
        self._closed = False

    def send(
        self, endpoint: str, disagg_request_id: int, params: types_pb2.DisaggregatedParams
    ) -> None:
        """Queues params (copied now) for the decode at endpoint; returns at once and never
        raises (the caller is a context phase's reply)."""
        if self._closed:
            return
        try:
            self._stream(endpoint).put(
                worker_pb2.HandOffRequest(
                    disagg_request_id=disagg_request_id, kv_params=kv_params(params)
                )
            )
        except Exception:  # noqa: BLE001 - the router's handoff goes on; the reply must not fail
            log.exception("HandOff(%d) to %s not sent", disagg_request_id, endpoint)

    def _stream(self, endpoint: str) -> _Stream:
        stream = self._streams.get(endpoint)
        if stream is not None:
            self._channels.move_to_end(endpoint)
            return stream
        channel = self._channels.get(endpoint)
        if channel is None:
            if len(self._channels) >= MAX_PEERS:
                oldest, old_channel = self._channels.popitem(last=False)
                self._end(oldest)
                asyncio.ensure_future(old_channel.close())
            channel = self._channels[endpoint] = self.credentials.open(endpoint)
        self._channels.move_to_end(endpoint)
        stream = self._streams[endpoint] = _Stream(
            self.credentials.stub(worker_pb2_grpc.WorkerStub, channel)
        )
        stream.watch = asyncio.ensure_future(self._watch(endpoint, stream))
        return stream

    async def _watch(self, endpoint: str, stream: _Stream) -> None:
        """Until the stream's call ends; then the next send to that decode opens another."""
        try:
            await stream.call
        except grpc.aio.AioRpcError as exc:
            log.info(
                "the HandOff stream to %s ended: %s %s (its queued handoffs go by the router)",
                endpoint,
                exc.code().name,
                exc.details(),
            )
        except asyncio.CancelledError:
            pass
        finally:
            stream.end()
            if self._streams.get(endpoint) is stream:
                del self._streams[endpoint]

    def _end(self, endpoint: str) -> None:
        stream = self._streams.pop(endpoint, None)
        if stream is not None:
            stream.end()

    async def close(self) -> None:
        self._closed = True
        for endpoint in list(self._streams):
            self._end(endpoint)
        channels = list(self._channels.values())
        self._channels.clear()
        for channel in channels:
            await channel.close()

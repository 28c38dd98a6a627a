"""A context phase's handoff sent straight to the decode worker the router announced its request
to (SessionSubmit.hand_off_to), over the authenticated internal plane (Worker/HandOff), beside
the reply to the router: the decode starts its pull without the hop through the router (the
prefill's reply reaching the router, then the router's handoff reaching the decode). One stream
per decode, kept open: a message costs less than a call. Best effort: the router's handoff
follows on its session whatever happens here, so a stream that fails is only logged (the next
handoff to that decode opens another), and one that lags MAX_QUEUED handoffs behind drops the
next ones.

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
MAX_QUEUED = 1024


class _Stream:
    """The kept HandOff stream to one decode: what send() queues goes out in order."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.call = stub.HandOff(self._requests())

    async def _requests(self):
        while (request := await self.queue.get()) is not None:
            yield request


class HandoffPush:
    def __init__(self, credentials: ClusterCredentials):
        self.credentials = credentials
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._streams: dict[str, _Stream] = {}

    def send(
        self, endpoint: str, disagg_request_id: int, params: types_pb2.DisaggregatedParams
    ) -> None:
        """Queues params (copied now) for the decode at endpoint; returns at once."""
        request = worker_pb2.HandOffRequest(
            disagg_request_id=disagg_request_id, kv_params=kv_params(params)
        )
        queue = self._stream(endpoint).queue
        if queue.qsize() < MAX_QUEUED:
            queue.put_nowait(request)

    def _stream(self, endpoint: str) -> _Stream:
        stream = self._streams.get(endpoint)
        if stream is not None and not stream.call.done():
            self._channels.move_to_end(endpoint)
            return stream
        channel = self._channels.get(endpoint)
        if channel is None:
            if len(self._channels) >= MAX_PEERS:
                oldest, channel = self._channels.popitem(last=False)
                self._end(oldest)
                asyncio.ensure_future(channel.close())
            channel = self._channels[endpoint] = self.credentials.open(endpoint)
        self._channels.move_to_end(endpoint)
        stream = self._streams[endpoint] = _Stream(
            self.credentials.stub(worker_pb2_grpc.WorkerStub, channel)
        )
        stream.call.add_done_callback(lambda call: self._ended(endpoint, call))
        return stream

    @staticmethod
    def _ended(endpoint: str, call) -> None:
        if call.cancelled():
            return
        code = call.code()
        if code != grpc.StatusCode.OK:
            log.info(
                "the HandOff stream to %s ended: %s (handoffs queued on it go by the router)",
                endpoint,
                code.name,
            )

    def _end(self, endpoint: str) -> None:
        stream = self._streams.pop(endpoint, None)
        if stream is not None:
            stream.queue.put_nowait(None)

    async def close(self) -> None:
        for endpoint in list(self._streams):
            self._end(endpoint)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

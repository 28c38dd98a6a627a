"""The prefill workers a decode worker has pulled from: each one's transceiver state (NIXL agent
metadata and pool layout) is fetched once, over gRPC, and loaded into our agent; again only
when the prefill comes back under a new agent (a restart, a released and resumed pool)."""
from __future__ import annotations

import asyncio

import grpc

from tandem.common.server import CHANNEL_OPTIONS
from tandem.kvtransfer.poller import TransferPoller
from tandem.v1 import llm_pb2, llm_pb2_grpc, worker_pb2


class PeerCache:
    def __init__(self, poller: TransferPoller):
        self.poller = poller
        self._agents: dict[str, str] = {}  # prefill endpoint -> its agent's name
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()

    async def agent_for(self, handoff: worker_pb2.KvHandoff) -> str:
        """The name under which our agent knows the handoff's prefill, loading its state if needed."""
        endpoint = handoff.ctx_endpoint
        if self._agents.get(endpoint) == handoff.agent_name:
            return handoff.agent_name
        async with self._lock:
            if self._agents.get(endpoint) != handoff.agent_name:
                channel = self._channels.get(endpoint)
                if channel is None:
                    channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
                reply = await llm_pb2_grpc.AsyncLLMStub(channel).GetDataTransceiverState(
                    llm_pb2.GetDataTransceiverStateRequest(), timeout=10)
                state = await self.poller.call(lambda transceiver: transceiver.add_peer(reply.state))
                self._agents[endpoint] = state.agent_name
        return self._agents[endpoint]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

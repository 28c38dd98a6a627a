"""The prefill workers a decode worker has pulled from: each one's transceiver state (NIXL agent
metadata and pool layout) is fetched once, over gRPC, and loaded into our agent; again only
when the prefill comes back under a new agent (a restart, a released and resumed pool). The
same channel, authenticated like every call between tandem processes, confirms leases.

Endpoints come only from handoffs whose signature verified, or from a router's prefix source
(SessionSubmit.prefix_source, on the authenticated internal plane): a client cannot make us dial
out.
"""

from __future__ import annotations

import asyncio
import enum
import logging

import grpc

from tandem.common.channels import ClusterCredentials
from tandem.kvtransfer.poller import TransferPoller
from tandem.v1 import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.decode.peers")

CONFIRM_TIMEOUT_S = 5.0
# A peer that does not answer LeasePrefix this fast is not worth waiting for: the prompt is computed.
LEASE_PREFIX_TIMEOUT_S = 2.0
# A lease the decode ends without reading it (ConfirmLease(pulled=false)) is tried this many
# times while its prefill does not answer, backing off: the router relies on the decode to end it.
END_LEASE_ATTEMPTS = 3
END_LEASE_BACKOFF_S = 0.5


class LeaseAnswer(enum.Enum):
    """What ConfirmLease said of a handoff's lease."""

    CONFIRMED = "confirmed"  # live until now, ended by this call: the KV read is the handoff's
    ENDED = "ended"  # it had ended already (a replayed or stale handoff)
    UNREACHABLE = "unreachable"  # no answer (an error status): the lease may still be live


class PeerCache:
    def __init__(self, poller: TransferPoller, credentials: ClusterCredentials):
        self.poller = poller
        self.credentials = credentials
        self._agents: dict[str, str] = {}  # prefill endpoint -> its agent's name
        # prefill endpoint -> (agent name, within this host, device pools on both sides): the
        # pull's lane, a new one when the prefill comes back under a new agent.
        self._lanes: dict[str, tuple[str, bool, bool]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peer_stubs: dict[str, tuple] = {}
        self._lock = asyncio.Lock()

    def _stubs(self, endpoint: str) -> tuple[llm_pb2_grpc.AsyncLLMStub, worker_pb2_grpc.WorkerStub]:
        """The prefill's two services over one authenticated channel."""
        if endpoint not in self._channels:
            channel = self._channels[endpoint] = self.credentials.open(endpoint)
            self._peer_stubs[endpoint] = (
                self.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel),
                self.credentials.stub(worker_pb2_grpc.WorkerStub, channel),
            )
        return self._peer_stubs[endpoint]

    async def agent_for(self, handoff: worker_pb2.KvHandoff) -> str:
        """The name under which our agent knows the handoff's prefill, loading its state if needed."""
        endpoint = handoff.ctx_endpoint
        if self._agents.get(endpoint) == handoff.agent_name:
            return handoff.agent_name
        async with self._lock:
            if self._agents.get(endpoint) != handoff.agent_name:
                llm, _ = self._stubs(endpoint)
                reply = await llm.GetDataTransceiverState(
                    llm_pb2.GetDataTransceiverStateRequest(), timeout=10
                )
                state = await self.poller.add_peer(reply.state)
                local = self.poller.transceiver.local_state
                self._lanes[endpoint] = (
                    state.agent_name,
                    state.same_host(local),
                    state.memory_type == local.memory_type == "VRAM",
                )
                self._agents[endpoint] = state.agent_name
        return self._agents[endpoint]

    def lane(self, endpoint: str) -> tuple[str, bool, bool]:
        """(agent name, within this host, device pools on both sides) of a prefill agent_for()
        has loaded."""
        return self._lanes[endpoint]

    async def lease_prefix(
        self, endpoint: str, token_ids: list[int], cache_salt: str | None
    ) -> worker_pb2.LeasePrefixResponse:
        """Asks the peer at endpoint to lease the leading blocks of token_ids it holds
        (Worker/LeasePrefix); raises grpc.aio.AioRpcError when it does not answer."""
        _, worker = self._stubs(endpoint)
        request = worker_pb2.LeasePrefixRequest(token_ids=token_ids)
        if cache_salt is not None:
            request.cache_salt = cache_salt
        return await worker.LeasePrefix(request, timeout=LEASE_PREFIX_TIMEOUT_S)

    async def confirm_lease(self, handoff: worker_pb2.KvHandoff, pulled: bool) -> LeaseAnswer:
        """Ends the handoff's lease on its prefill (see Worker/ConfirmLease), once."""
        try:
            _, worker = self._stubs(handoff.ctx_endpoint)
            reply = await worker.ConfirmLease(
                worker_pb2.ConfirmLeaseRequest(
                    ctx_request_id=handoff.ctx_request_id, pulled=pulled
                ),
                timeout=CONFIRM_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            log.info(
                "ConfirmLease(%d) on %s: %s %s",
                handoff.ctx_request_id,
                handoff.ctx_endpoint,
                exc.code().name,
                exc.details(),
            )
            return LeaseAnswer.UNREACHABLE
        return LeaseAnswer.CONFIRMED if reply.confirmed else LeaseAnswer.ENDED

    async def end_lease(self, handoff: worker_pb2.KvHandoff) -> None:
        """Ends the handoff's lease without reading it, trying again while its prefill does not
        answer (after the last try the lease ends by expiring, or died with its prefill)."""
        for attempt in range(END_LEASE_ATTEMPTS):
            if await self.confirm_lease(handoff, pulled=False) is not LeaseAnswer.UNREACHABLE:
                return
            if attempt + 1 < END_LEASE_ATTEMPTS:
                await asyncio.sleep(END_LEASE_BACKOFF_S * 2**attempt)
        log.warning(
            "could not end lease %d on %s (no answer after %d tries); it ends when it expires",
            handoff.ctx_request_id,
            handoff.ctx_endpoint,
            END_LEASE_ATTEMPTS,
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

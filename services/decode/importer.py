"""The decode side of a handoff: checks the layout, learns each prefill's
transceiver state once, pulls the prompt's KV with a NIXL READ (which notifies
the prefill to free its lease)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

import grpc

from tandem.common.errors import IncompatibleHandoffError, PreconditionError, unavailable
from tandem.common.server import CHANNEL_OPTIONS
from tandem.engine.kv_layout import describe_mismatch
from tandem.kvtransfer import KvTransceiver, TransferError
from tandem.prefill.handoff import prompt_digest, release_message, sign
from tandem.v1 import llm_pb2, llm_pb2_grpc, worker_pb2

log = logging.getLogger("tandem.decode")


def parse_handoff(opaque_state: bytes, layout: dict, layout_hash: str, prompt_token_ids: list[int],
                  cache_salt: str | None, signing_key: bytes | None) -> worker_pb2.KvHandoff:
    """The handoff of a generation_only request, refused (FAILED_PRECONDITION) when its KV layout is
    not ours, when it belongs to another prompt, or when its signature does not verify."""
    handoff = worker_pb2.KvHandoff()
    try:
        handoff.ParseFromString(opaque_state)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError
        raise ValueError(f"disaggregated_params.opaque_state is not a tandem KV handoff: {exc}") from None
    if handoff.version != 1 or not handoff.ctx_endpoint or not handoff.block_ids:
        raise ValueError("disaggregated_params.opaque_state is not a tandem KV handoff (version 1 with blocks and "
                         "an endpoint); pass the context_only response's disaggregated_params unchanged")
    if handoff.layout_hash != layout_hash:
        theirs = json.loads(handoff.layout_json) if handoff.layout_json else {}
        raise IncompatibleHandoffError(
            f"KV handoff from {handoff.ctx_endpoint} is incompatible with this decode worker: "
            f"{describe_mismatch(layout, theirs)}")
    if signing_key and not hmac.compare_digest(handoff.signature, sign(handoff, signing_key)):
        raise PreconditionError("the KV handoff's signature does not verify: pass the context_only response's "
                                "disaggregated_params unchanged")
    if (handoff.num_prompt_tokens != len(prompt_token_ids)
            or handoff.prompt_digest != prompt_digest(prompt_token_ids, cache_salt)):
        raise PreconditionError("the KV handoff belongs to another prompt (or cache_salt): send generation_only "
                                "with the context phase's prompt_token_ids and cache_salt")
    return handoff


async def _settle(transfer, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while not transfer.done():
            if time.monotonic() > deadline:
                log.warning("a cancelled KV pull did not settle in %.1f s; releasing it anyway", timeout_s)
                break
            await asyncio.sleep(0.001)
    except Exception:  # noqa: BLE001 - a failed READ has settled too
        pass
    transfer.abort()


class KvImporter:
    def __init__(self, transceiver: KvTransceiver):
        self.transceiver = transceiver
        self._peers: dict[str, str] = {}  # prefill endpoint -> agent name
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lock = asyncio.Lock()
        self.num_bytes_received = 0

    async def _peer(self, handoff: worker_pb2.KvHandoff) -> str:
        """The prefill's agent, registered once per peer (again if the prefill restarted under a new agent)."""
        endpoint = handoff.ctx_endpoint
        if self._peers.get(endpoint) == handoff.agent_name:
            return handoff.agent_name
        async with self._lock:
            if self._peers.get(endpoint) != handoff.agent_name:
                channel = self._channels.get(endpoint)
                if channel is None:
                    channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
                reply = await llm_pb2_grpc.AsyncLLMStub(channel).GetDataTransceiverState(
                    llm_pb2.GetDataTransceiverStateRequest(), timeout=10)
                state = self.transceiver.add_peer(reply.state)
                self._peers[endpoint] = state.agent_name
        return self._peers[endpoint]

    async def pull(self, handoff: worker_pb2.KvHandoff, plan, timeout_s: float = 30.0) -> tuple[int, float]:
        """READs the handoff's blocks the plan (an engine ImportPlan) does not have cached; returns
        (bytes, seconds). The READ's notification tells the prefill to free its lease."""
        started = time.perf_counter()
        agent = await self._peer(handoff)
        transfer = self.transceiver.read_blocks(agent, list(handoff.block_ids)[plan.num_cached_blocks:],
                                                plan.block_ids, release_message(handoff.ctx_request_id))
        deadline = time.monotonic() + timeout_s
        try:
            while not transfer.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"KV pull from {handoff.ctx_endpoint} took over {timeout_s} s")
                await asyncio.sleep(0.0002)
        except TransferError as exc:
            transfer.abort()
            raise unavailable(f"pulling the KV from {handoff.ctx_endpoint} failed (the prefill worker is gone "
                              f"or released its KV cache): {exc}") from None
        except BaseException:
            # Cancelled (or timed out) mid-READ: the caller frees our blocks next, so let the
            # READ land first rather than have it write into blocks another request now owns.
            await _settle(transfer)
            raise
        self.num_bytes_received += transfer.nbytes
        return transfer.nbytes, time.perf_counter() - started

    async def release_remote(self, handoff: worker_pb2.KvHandoff) -> None:
        """Tells the prefill to free the handoff's blocks without reading them (best effort)."""
        try:
            agent = await self._peer(handoff)
            self.transceiver.read_blocks(agent, [], [], release_message(handoff.ctx_request_id))
        except Exception as exc:  # noqa: BLE001 - the lease expires anyway
            log.info("could not release lease %d on %s: %s", handoff.ctx_request_id, handoff.ctx_endpoint, exc)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

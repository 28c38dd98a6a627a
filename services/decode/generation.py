"""The generation phase (generation_only with a handoff): check the handoff, reserve blocks,
pull the prompt's KV from the prefill worker with a NIXL READ, then decode. When the pool has
no room (or the lease no time) for the pull, the prompt is computed here instead and the
prefill is told to free its copy.

While its KV is on the way the request is WAITING_FOR_REMOTE_KV in the engine: its blocks
are reserved, the scheduler does not run it.
"""
from __future__ import annotations

import asyncio
import logging
import time

from tandem.common.errors import unavailable
from tandem.engine.messages import AddRequest, RemoteKvArrived
from tandem.engine.sequence import Phase
from tandem.kvtransfer.errors import TransferError, TransferTimeoutError
from tandem.kvtransfer.handoff import HandoffFormat, release_message
from tandem.kvtransfer.poller import PendingRead, TransferPoller
from tandem.decode.peers import PeerCache
from tandem.v1 import types_pb2, worker_pb2

log = logging.getLogger("tandem.decode")

# Seconds of lease a KV pull needs left to start; with less the decode computes the prompt itself.
LEASE_SAFETY_MARGIN_S = 1.0
PULL_TIMEOUT_S = 30.0


class GenerationPhase:
    def __init__(self, poller: TransferPoller, peers: PeerCache, handoff_format: HandoffFormat):
        self.poller = poller
        self.peers = peers
        self.handoff_format = handoff_format
        self.num_bytes_received = 0
        self._releases: set[asyncio.Task] = set()

    def verify(self, params: types_pb2.DisaggregatedParams, prompt_token_ids: list[int],
               cache_salt: str | None) -> worker_pb2.KvHandoff:
        """The request's handoff, or the error that refuses it (before anything is reserved)."""
        if not params.first_gen_tokens:
            raise ValueError("generation_only needs disaggregated_params.first_gen_tokens from the context phase")
        return self.handoff_format.parse(params.opaque_state, prompt_token_ids, cache_salt)

    def start(self, request, handoff: worker_pb2.KvHandoff) -> None:
        """request: a worker.request.WorkerRequest of one sequence."""
        if request.finish_if_first_tokens_end():  # nothing to generate: the prefill may free the KV now
            task = asyncio.create_task(self._release_remote(handoff))  # outlives the request
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
            return
        request.tasks.append(asyncio.create_task(self._run(request, handoff)))

    async def _run(self, request, handoff: worker_pb2.KvHandoff) -> None:
        core = request.core
        state = request.only_sequence
        rid = state.engine_id
        first = request.first_gen_tokens
        pending: PendingRead | None = None
        try:
            plan = None
            # A lease about to run out may be freed (and its blocks reused) while we read.
            if handoff.lease_expires_at - time.time() > LEASE_SAFETY_MARGIN_S:
                plan = await core.call(AddRequest(rid, request.prompt_token_ids, state.options, Phase.GENERATION_ONLY,
                                                  request.priority, request.cache_salt, first, remote_kv=True))
            if plan is None:
                # No room for the prompt's KV now (or no time): compute it here, and let the
                # prefill free its copy at once.
                request.submit(Phase.GENERATION_ONLY, output_token_ids=first)
                await self._release_remote(handoff)
                return
            core.register(rid, request.stream)
            started = time.perf_counter()
            agent = await self.peers.agent_for(handoff)
            pending = self.poller.read(agent, list(handoff.block_ids)[plan.num_cached_blocks:], plan.block_ids,
                                       release_message(handoff.ctx_request_id, pulled=True), PULL_TIMEOUT_S)
            nbytes = await pending.done
            self.num_bytes_received += nbytes
            request.metrics.kv_transfer_bytes = nbytes
            request.metrics.kv_transfer_s = time.perf_counter() - started
            request.metrics.num_cached_prompt_tokens = len(request.prompt_token_ids)
            core.send(RemoteKvArrived(rid))
        except asyncio.CancelledError:
            # Cancelled mid-READ: the abort frees our blocks, so let the READ land first rather than
            # have it write into blocks another request owns by then.
            if pending is not None:
                await self.poller.settle(pending)
            core.abort(rid)
            raise
        except TransferTimeoutError:
            core.abort(rid)
            request.fail(TimeoutError(f"KV pull from {handoff.ctx_endpoint} took over {PULL_TIMEOUT_S} s"))
        except TransferError as exc:
            core.abort(rid)
            request.fail(unavailable(f"pulling the KV from {handoff.ctx_endpoint} failed (the prefill worker is "
                                     f"gone or released its KV cache): {exc}"))
        except Exception as exc:  # noqa: BLE001 - the request fails with exc's status
            core.abort(rid)
            request.fail(exc)

    async def _release_remote(self, handoff: worker_pb2.KvHandoff) -> None:
        """Tells the prefill to free the handoff's blocks without reading them (best effort)."""
        try:
            agent = await self.peers.agent_for(handoff)
            message = release_message(handoff.ctx_request_id, pulled=False)
            await self.poller.call(lambda transceiver: transceiver.read_blocks(agent, [], [], message))
        except Exception as exc:  # noqa: BLE001 - the lease expires anyway
            log.info("could not release lease %d on %s: %s", handoff.ctx_request_id, handoff.ctx_endpoint, exc)

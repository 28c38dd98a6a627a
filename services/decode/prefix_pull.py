"""Cross-worker prefix pulls (--kv-prefix-pulls): a request the router sent here with a prefix
source (SessionSubmit.prefix_source: a peer whose prefix cache holds more of the prompt than
ours, and the router's cost model says reading it beats computing it) first leases that prefix
on the peer (Worker/LeasePrefix), pulls it the way a decode pulls a handoff (the same handoff
format and verification, the same chunked NIXL READs, the same ConfirmLease rule: the KV counts
only if the lease still confirms after the READ), and the engine computes only the rest of the
prompt. The pulled blocks are hashed into our prefix cache as computed ones are (KV events too).

Any failure (the peer gone or holding nothing now, another layout or weights, no room here, a
READ that failed, a confirm refused) runs the prompt exactly as it would have run without the
hint: the request never fails because of a pull. Every lease taken ends once: by the confirm
after the READ, or by ConfirmLease(pulled=false) on every other way out. Each pull's outcome is
counted (WorkerState.prefix_pull_outcomes, tandem:kv_prefix_pulls) and kept on the request
(RequestMetrics.prefix_pull); one that fell back is logged once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from tandem.common.exceptions import PreconditionError
from tandem.decode.generation import pull_blocks
from tandem.decode.peers import LeaseAnswer, PeerCache
from tandem.engine.messages import AddRequest, RemoteKvArrived
from tandem.engine.sequence import Phase
from tandem.kvtransfer.errors import TransferError
from tandem.kvtransfer.handoff import HandoffFormat
from tandem.kvtransfer.poller import PendingRead, TransferPoller
from tandem.v1 import types_pb2, worker_pb2

log = logging.getLogger("tandem.decode.prefix_pull")

# The phases a prefix pull runs before: a prompt computed here from the start.
PULLABLE_PHASES = (Phase.CONTEXT_AND_GENERATION, Phase.CONTEXT_ONLY)


class PrefixPulls:
    def __init__(
        self,
        endpoint: str,
        block_size: int,
        poller: TransferPoller,
        peers: PeerCache,
        handoff_format: HandoffFormat,
        weights_id: Callable[[], str] = lambda: "",
        on_outcome: Callable[[str, str], None] = lambda outcome, reason: None,
    ):
        """endpoint: this worker's address (never its own source); on_outcome(outcome, reason):
        each pull's end (the worker's counts and metrics)."""
        self.endpoint = endpoint
        self.block_size = block_size
        self.poller = poller
        self.peers = peers
        self.handoff_format = handoff_format
        self.weights_id = weights_id
        self.on_outcome = on_outcome
        self._releases: set[asyncio.Task] = set()

    def attach(self, request, source: worker_pb2.PrefixSource) -> None:
        """Makes request (a WorkerRequest) load its prefix from source when it is submitted, where
        a pull can apply: one sequence computed from its prompt, no adapter, no prompt logprobs
        (those need every prompt position computed), and at least one block besides the last
        token's, which is always computed here. Otherwise the hint is ignored."""
        if not source.address or source.address == self.endpoint or source.num_blocks <= 0:
            return
        options = request.options
        if (
            request.phase not in PULLABLE_PHASES
            or len(request.sequences) != 1
            or request.beam_search
            or request.adapter is not None
            or options.prompt_logprobs is not None
            or options.return_context_logits
        ):
            return
        num_blocks = min(source.num_blocks, (len(request.prompt_token_ids) - 1) // self.block_size)
        if num_blocks < 1:
            return
        request.load_prefix = lambda phase: self._run(request, source.address, num_blocks, phase)

    async def _run(self, request, source: str, num_blocks: int, phase: Phase) -> None:
        core = request.core
        rid = request.only_sequence.engine_id
        prefix = request.prompt_token_ids[: num_blocks * self.block_size]
        handoff: worker_pb2.KvHandoff | None = None
        lease_open = False
        in_engine = False
        reads: list[PendingRead] = []
        try:
            try:
                reply = await self.peers.lease_prefix(source, prefix, request.cache_salt)
            except grpc.aio.AioRpcError as exc:
                return self._compute(request, phase, source, "peer_unreachable", exc.code().name)
            if not reply.num_blocks:
                return self._compute(request, phase, source, "nothing_leased")
            leased = prefix[: reply.num_blocks * self.block_size]
            try:
                handoff = self.handoff_format.parse(reply.opaque_state, leased, request.cache_salt)
            except (ValueError, PreconditionError) as exc:
                # Not a lease we can use (another layout, a bad reply): nothing we could end
                # either without a verified id; the peer's lease expires.
                return self._compute(request, phase, source, "incompatible", str(exc))
            lease_open = True
            ours = self.weights_id()
            if handoff.weights_id and ours and handoff.weights_id != ours:
                return self._compute(request, phase, source, "weights_mismatch")
            plan = await core.call(
                AddRequest(
                    rid,
                    request.prompt_token_ids,
                    request.only_sequence.options,
                    phase,
                    request.priority,
                    request.cache_salt,
                    remote_kv=True,
                )
            )
            if plan is None:
                return self._compute(request, phase, source, "no_room")
            in_engine = True
            core.register(rid, request.stream)
            remote = list(handoff.block_ids)[plan.num_cached_blocks :]
            if not remote:  # our own cache holds as much: nothing to read
                self._end_lease(handoff)
                lease_open = False
                return self._loaded(
                    request, source, "computed", "cached", 0, plan.num_cached_blocks
                )
            agent = await self.peers.agent_for(handoff)
            num_landed, nbytes, _, error = await pull_blocks(
                self.poller, agent, remote, plan.block_ids[: len(remote)], reads
            )
            if not num_landed:  # nothing to confirm: the lease ends unread (finally)
                core.abort(rid)
                in_engine = False
                return self._compute(request, phase, source, "pull_failed", str(error))
            answer = await self.peers.confirm_lease(handoff, pulled=True)
            lease_open = answer is LeaseAnswer.UNREACHABLE
            if answer is not LeaseAnswer.CONFIRMED:
                why = "unconfirmed" if answer is LeaseAnswer.ENDED else "peer_unreachable"
                core.abort(rid)  # what was read is dropped uncached: the blocks go back as they are
                in_engine = False
                return self._compute(request, phase, source, why)
            request.metrics.kv_transfer_bytes += nbytes
            outcome = "pulled" if error is None else "partly_pulled"
            if error is not None:
                log.info(
                    "prefix pull for %s from %s failed after %d of %d blocks: %s",
                    rid,
                    source,
                    num_landed,
                    len(remote),
                    error,
                )
            self._loaded(request, source, outcome, "", num_landed, plan.num_cached_blocks)
        except asyncio.CancelledError:
            for read in reads:  # the abort frees our blocks: let a READ into them land first
                await self.poller.settle(read)
            core.abort(rid)  # (also when cancelled inside the reservation's call)
            self._record(request, source, "cancelled", "", 0, 0)
            raise
        except (TransferError, grpc.aio.AioRpcError) as exc:  # the peer's state could not be had
            for read in reads:
                await self.poller.settle(read)
            if in_engine:
                core.abort(rid)
            return self._compute(request, phase, source, "peer_unreachable", str(exc))
        except Exception as exc:  # noqa: BLE001 - the request fails with exc's status
            # (the engine refused the reservation, its core is gone): not left waiting.
            for read in reads:
                await self.poller.settle(read)
            if in_engine:
                core.abort(rid)
            self._record(request, source, "failed", type(exc).__name__, 0, 0)
            request.fail(exc)
        finally:
            if lease_open:
                self._end_lease(handoff)

    def _loaded(
        self, request, source: str, outcome: str, reason: str, num_pulled: int, num_cached: int
    ) -> None:
        """The prefix is in the reserved blocks (ours and the pulled ones): the engine computes
        the rest of the prompt from there."""
        self._record(request, source, outcome, reason, num_pulled, num_cached)
        request.core.send(RemoteKvArrived(request.only_sequence.engine_id, num_cached + num_pulled))

    def _compute(self, request, phase: Phase, source: str, reason: str, detail: str = "") -> None:
        """No pull: the prompt runs as it would have without the hint."""
        log.info(
            "prefix pull for %s from %s not used (%s%s): computing the prompt",
            request.request_id,
            source,
            reason,
            f": {detail}" if detail else "",
        )
        self._record(request, source, "computed", reason, 0, 0)
        request.submit(phase)

    def _record(
        self, request, source: str, outcome: str, reason: str, num_pulled: int, num_cached: int
    ) -> None:
        self.on_outcome(outcome, reason)
        request.metrics.prefix_pull = types_pb2.PrefixPullMetrics(
            outcome=outcome,
            reason=reason,
            source=source,
            num_pulled_blocks=num_pulled,
            num_cached_blocks=num_cached,
        )

    def _end_lease(self, handoff: worker_pb2.KvHandoff) -> None:
        """ConfirmLease(pulled=false) on the peer, detached from the request (which may end first)."""
        task = asyncio.ensure_future(self.peers.end_lease(handoff))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

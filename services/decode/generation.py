"""The generation phase (generation_only with a handoff): check the handoff, reserve blocks,
pull the prompt's KV from the prefill worker with a NIXL READ, confirm the lease, then decode.
When the pool has no room for the pull, the handoff waits for room (--kv-room-wait-seconds,
within its lease: requests finishing free blocks); when there is still none (or the lease has
no time left), the prompt is computed here instead and the prefill is told to free its copy;
when the pull fails (the prefill died or hangs, or released its pool), the prompt is computed
here too: the request has its prompt and first token, so nothing is lost with the prefill. A
pull is several READs (PULL_CHUNK_BLOCKS each): when the first ones landed and the lease still
confirms, only the rest of the prompt is computed. That is --kv-load-failure-policy recompute (the
default; vLLM's name); under fail the request ends UNAVAILABLE instead, naming why, and the
router retries it once on another prefill/decode pair. Either way the outcome is counted and
logged (outcomes.py).

Once a handoff verified here, its lease is the decode's to end, on every way the phase can end
but a cancel or a failure of the request (which the router, seeing no normal end, ends itself):
pulled and confirmed, computed here (no room, no time, a failed READ: ConfirmLease(pulled=false)),
or ended by the first tokens. So a split that ends normally costs the router no ReleaseKv.

The confirm (Worker/ConfirmLease, after the READ) is what makes the KV ours to use: a lease
still live once the READ completed was live during it, so the blocks read were the handoff's.
A replayed or stale handoff (its lease ended, its blocks perhaps another request's by now)
fails the confirm, and what was read is dropped, never cached: the prompt is computed here.
A whole pull's sequence is scheduled while the confirm is on the way (RemoteKvArrived with
confirmed=False), so its first step hides the round trip: until the answer its outputs wait in
HeldOutputs and the engine caches none of its blocks (KvConfirmed lets them in); a refused
confirm aborts it and drops what it drew before the prompt is computed.

While its KV is on the way the request is WAITING_FOR_REMOTE_KV in the engine: its blocks
are reserved, the scheduler does not run it. A request the router announced (it comes while its
prefill runs, its handoff later) has its blocks reserved then, when the pool has room to spare
and no handoff waits for room (early_reservation.py): its handoff then pulls without the
reserve's round trip to the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc

from tandem.common import tracing
from tandem.common.errors import KvLoadFailedError, PreconditionError
from tandem.decode.early_reservation import EarlyReservation
from tandem.decode.outcomes import LOAD_FAILURE_POLICIES, HandoffOutcomes, Outcome, Reason
from tandem.decode.peers import LeaseAnswer, PeerCache
from tandem.decode.pull_links import PullLinks
from tandem.engine.messages import (
    AbortRequest,
    AddRequest,
    ImportPlan,
    KvConfirmed,
    RemoteKvArrived,
)
from tandem.engine.sequence import Phase
from tandem.kvtransfer.errors import TransferError
from tandem.kvtransfer.handoff import HandoffFormat
from tandem.kvtransfer.poller import PendingRead, TransferPoller
from tandem.v1 import types_pb2, worker_pb2

log = logging.getLogger("tandem.decode")

# Seconds of lease a KV pull needs left to start beyond the time it should take (PULL_TIME_FACTOR
# times what the peer's earlier pulls of that many bytes took); with less the decode computes
# the prompt itself: a lease that ends mid-READ may hand its blocks to another request.
LEASE_SAFETY_MARGIN_S = 1.0
PULL_TIME_FACTOR = 2.0
PULL_TIMEOUT_S = 30.0
# Blocks a READ of a pull moves at most: a pull that fails part-way keeps the KV of the READs
# before the failure (the engine computes only the rest of the prompt).
PULL_CHUNK_BLOCKS = 128
# Test-only: "BLOCKS:INDEX" pulls BLOCKS blocks a READ and fails READ number INDEX (from 0) as a
# NIXL failure would, so a test can see a pull fail part-way. Unset: PULL_CHUNK_BLOCKS, none fails.
PULL_FAULT_ENV = "TANDEM_TEST_KV_PULL_FAULT"
# A handoff waiting for room in the pool asks again after this long, then twice as long, up to the max.
ROOM_POLL_FIRST_S = 0.005
ROOM_POLL_MAX_S = 0.1


def check_adapter(handoff: worker_pb2.KvHandoff, adapter) -> None:
    """KV computed under one LoRA adapter (or none) only continues under the same one."""
    theirs = handoff.lora_request.lora_name if handoff.HasField("lora_request") else None
    ours = adapter.fingerprint if adapter is not None else ""
    if handoff.lora_fingerprint == ours:
        return
    computed = (
        f"LoRA adapter {theirs!r} (lora_int_id {handoff.lora_request.lora_int_id})"
        if theirs
        else "the base model (no adapter)"
    )
    asked = adapter.describe() if adapter is not None else "no adapter"
    same_name = adapter is not None and theirs == adapter.name
    raise PreconditionError(
        f"the KV handoff was computed with {computed}; this request runs with {asked}"
        + (
            "; the adapter's files differ between the prefill and this worker"
            if same_name
            else "; send generation_only with the context phase's lora_request"
        )
    )


class GenerationPhase:
    def __init__(
        self,
        poller: TransferPoller,
        peers: PeerCache,
        handoff_format: HandoffFormat,
        links: PullLinks,
        outcomes: HandoffOutcomes,
        on_pulled: Callable[[int, float], None] = lambda num_bytes, seconds: None,
        load_failure_policy: str = "recompute",
        weights_id: Callable[[], str] = lambda: "",
        room_wait_s: float = 10.0,
        early_reserve: bool = True,
    ):
        """weights_id: the weights this worker serves now (a handoff of others is not used);
        room_wait_s: how long a handoff waits for room in the pool (within its lease);
        early_reserve: an announced request's blocks are reserved before its handoff comes."""
        self.weights_id = weights_id
        self.room_wait_s = room_wait_s
        self.early_reserve = early_reserve
        # The announced requests' reservations no pull took yet, by request id.
        self._reservations: dict[str, EarlyReservation] = {}
        # The handoffs waiting for room in the pool, in the order they came (the head asks).
        self._room_line: deque[asyncio.Event] = deque()
        if load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, got "
                f"{load_failure_policy!r}"
            )
        self.load_failure_policy = load_failure_policy
        self.poller = poller
        self.peers = peers
        self.handoff_format = handoff_format
        # The rate of each prefill's pulls (the READ alone), kept by the worker.
        self.links = links
        # How each handoff ended here, kept by the worker.
        self.outcomes = outcomes
        self.num_bytes_received = 0
        # Told of each pull that landed: its bytes and seconds (the worker's metrics).
        self.on_pulled = on_pulled
        self._releases: set[asyncio.Task] = set()

    def verify(
        self,
        params: types_pb2.DisaggregatedParams,
        prompt_token_ids: list[int],
        cache_salt: str | None,
        adapter=None,
    ) -> worker_pb2.KvHandoff:
        """The request's handoff, or the error that refuses it (before anything is reserved).
        adapter: the request's LoRA adapter, loaded here already; the KV must have been computed with it."""
        if not params.first_gen_tokens:
            raise ValueError(
                "generation_only needs disaggregated_params.first_gen_tokens from the context phase"
            )
        handoff = self.handoff_format.parse(params.opaque_state, prompt_token_ids, cache_salt)
        check_adapter(handoff, adapter)
        return handoff

    def reserve_early(
        self,
        core,
        request_id: str,
        prompt_token_ids: list[int],
        options,
        priority: float,
        cache_salt: str | None,
        adapter=None,
    ) -> EarlyReservation | None:
        """An announced request's blocks, asked of the engine now (its handoff comes later), or
        None: off, a handoff waits for room (it goes first), not one sequence, or the id has a
        reservation already. options: the generation phase's (for_generation_phase). The request
        passes it to start() with its handoff, or drops it."""
        if (
            not self.early_reserve
            or self._room_line
            or options.n != 1
            or request_id in self._reservations
        ):
            return None
        add = AddRequest(
            request_id,
            prompt_token_ids,
            options,
            Phase.GENERATION_ONLY,
            priority,
            cache_salt,
            remote_kv=True,
            adapter=adapter,
            ahead_of_handoff=True,
        )
        return EarlyReservation(
            core, request_id, self.weights_id(), core.submit(add), self._reservations
        )

    def reservation_for(self, request_id: str) -> EarlyReservation | None:
        """The pending reservation of that request id, if any."""
        return self._reservations.get(request_id)

    def drop_reservations(self) -> None:
        """Drops every reservation no pull took yet (a pause); their handoffs reserve anew."""
        for reservation in list(self._reservations.values()):
            reservation.drop()

    def start(
        self,
        request,
        handoff: worker_pb2.KvHandoff,
        reservation: EarlyReservation | None = None,
    ) -> None:
        """request: a worker.output_processor.WorkerRequest of one sequence; reservation: its
        blocks reserved before the handoff came (its caller drops it when the pull does not take
        it)."""
        if request.finish_if_first_tokens_end():  # nothing to generate: the prefill may free the KV
            self._end(request, handoff, Outcome.RELEASED)
            self._release_remote(handoff)
            return
        request.tasks.append(asyncio.create_task(self._run(request, handoff, reservation)))

    async def _run(
        self, request, handoff: worker_pb2.KvHandoff, reservation: EarlyReservation | None
    ) -> None:
        core = request.core
        state = request.only_sequence
        rid = state.engine_id
        first = request.first_gen_tokens
        # The READs of the pull, once posted (each settled before our blocks can go).
        reads: list[PendingRead] = []
        # Set when the pull is cancelled: a READ landing after that tells the engine nothing.
        cancelled = threading.Event()
        ours = self.weights_id()
        try:
            # The blocks reserved at the announcement, ours now (None: reserved below).
            reserved = await reservation.take(ours) if reservation is not None else None
            if handoff.weights_id and ours and handoff.weights_id != ours:
                # KV of other weights must not continue here (an update reached one worker only).
                log.warning(
                    "request %s: prefill %s computed its KV with weights %s; this decode serves %s",
                    rid,
                    handoff.ctx_endpoint,
                    handoff.weights_id,
                    ours,
                )
                if reserved is not None:
                    core.abort(rid)
                self._release_remote(handoff)
                self._not_loaded(request, handoff, Reason.WEIGHTS_MISMATCH)
                return
            add = AddRequest(
                rid,
                request.prompt_token_ids,
                state.options,
                Phase.GENERATION_ONLY,
                request.priority,
                request.cache_salt,
                first,
                remote_kv=True,
                # A decode that does not speculate ignores them (a speculating prefill's).
                draft_token_ids=list(request.disagg_in.draft_tokens)
                if core.facts.limits.num_speculative_tokens
                else [],
                adapter=request.adapter,
            )
            plan, reason, waited = await self._reserve(core, add, handoff, reserved)
            request.metrics.room_wait_s = waited
            if plan is not None and plan is reserved:
                # Its first tokens come with the arrival: checked here as the AddRequest would be.
                core.facts.limits.check_prompt(len(request.prompt_token_ids) + len(first), first)
                request.metrics.reserved_early = True
            if plan is None:
                # No room for the prompt's KV now (or no time): the prefill may free its copy at
                # once, and the prompt is computed here (or the request fails, by the policy).
                self._release_remote(handoff)
                self._not_loaded(request, handoff, reason)
                return
            # Outputs wait here until the lease is confirmed (the first step runs meanwhile).
            held = HeldOutputs(request.stream)
            core.register(rid, held)
            started = time.perf_counter()
            request.metrics.kv_transfer_start = time.time()
            agent = await self.peers.agent_for(handoff)
            remote = list(handoff.block_ids)[plan.num_cached_blocks :]
            with tracing.span(
                "tandem.kv_pull",
                dict(request.trace_headers),
                **{"tandem.prefill": handoff.ctx_endpoint, "tandem.num_blocks": len(remote)},
            ):
                # The engine schedules the sequence the moment the last READ lands (told from the
                # poller's thread: one hop fewer), its lease confirm on the way meanwhile.
                num_landed, nbytes, seconds, error = await pull_blocks(
                    self.poller,
                    agent,
                    remote,
                    plan.block_ids,
                    reads,
                    lambda: core.send(
                        RemoteKvArrived(rid, None, False, first, add.draft_token_ids)
                    ),
                    cancelled,
                )
            self.num_bytes_received += nbytes
            if error is not None and (not num_landed or self.load_failure_policy == "fail"):
                raise error
            if error is None:
                self.links.observe(
                    handoff.ctx_endpoint, *self.peers.lane(handoff.ctx_endpoint), nbytes, seconds
                )
            # The confirm ends the lease; a live one proves the blocks read were the handoff's. A
            # whole pull runs its first step while the confirm is on the way: its blocks stay
            # out of the cache and its outputs in `held` until the answer.
            provisional = error is None  # (the engine has it: pull_blocks' on_landed)
            answer = await self.peers.confirm_lease(handoff, pulled=True)
            if answer is not LeaseAnswer.CONFIRMED:
                if provisional:  # what the step computed came from KV that may not be ours
                    core.abort(rid)
                    await core.submit(AbortRequest(rid))  # its outputs already sent are in held
                    held.discard()
                self._recompute(request, handoff, answer)
                return
            if error is not None:  # part of the prompt's KV landed: the rest is computed here
                held.release()
                self._partly_pulled(request, handoff, plan, num_landed, nbytes, error)
                return
            request.metrics.kv_transfer_bytes = nbytes
            request.metrics.kv_transfer_s = time.perf_counter() - started
            request.metrics.kv_transfer_end = time.time()
            self.on_pulled(nbytes, request.metrics.kv_transfer_s)
            request.metrics.num_cached_prompt_tokens = len(request.prompt_token_ids)
            self._end(
                request,
                handoff,
                Outcome.PULLED,
                num_pulled=len(handoff.block_ids) - plan.num_cached_blocks,
                num_cached=plan.num_cached_blocks,
            )
            core.send(KvConfirmed(rid))
            held.release()
        except asyncio.CancelledError:
            # Cancelled mid-READ: the abort frees our blocks, so let the READ land first rather than
            # have it write into blocks another request owns by then.
            cancelled.set()
            for read in reads:
                await self.poller.settle(read)
            core.abort(rid)
            self._end(request, handoff, Outcome.CANCELLED)
            # The lease is ours to end here too: a client's own generation_only (no router
            # behind it to release) cancelled while waiting for room or mid-pull would otherwise
            # hold the prefill's blocks until the lease expired. Ending one already confirmed or
            # released is a no-op at the prefill.
            self._release_remote(handoff)
            raise
        except (TransferError, grpc.aio.AioRpcError) as exc:
            # TransferError: the READ failed or timed out; AioRpcError: the prefill's transceiver
            # state could not be fetched. Either way its KV is out of reach: compute it here.
            for read in reads:
                await self.poller.settle(read)
            core.abort(rid)
            log.info(
                "KV pull for %s from %s failed: %s",
                rid,
                handoff.ctx_endpoint,
                exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc,
            )
            self._release_remote(handoff)  # the lease is ours to end, whatever its prefill's state
            self._not_loaded(
                request,
                handoff,
                Reason.PULL_FAILED if reads else Reason.PEER_UNREACHABLE,
            )
        except Exception as exc:  # noqa: BLE001 - the request fails with exc's status
            core.abort(rid)
            self._end(request, handoff, Outcome.FAILED)
            request.fail(exc)

    def _partly_pulled(self, request, handoff, plan, num_landed: int, nbytes: int, error) -> None:
        """A pull whose first num_landed blocks landed (and whose lease was confirmed): the
        engine computes the rest of the prompt from there (recomputed, pull_failed, with the
        blocks it did pull), not the whole of it."""
        rid = request.only_sequence.engine_id
        num_valid = plan.num_cached_blocks + num_landed
        log.info(
            "KV pull for %s from %s failed after %d of %d blocks: %s",
            rid,
            handoff.ctx_endpoint,
            num_landed,
            len(handoff.block_ids) - plan.num_cached_blocks,
            error,
        )
        request.metrics.kv_transfer_bytes = nbytes  # (the engine's outputs count the tokens)
        self._end(
            request,
            handoff,
            Outcome.RECOMPUTED,
            Reason.PULL_FAILED,
            num_pulled=num_landed,
            num_cached=plan.num_cached_blocks,
        )
        # (The handed drafts follow a whole prompt only: none here.)
        request.core.send(RemoteKvArrived(rid, num_valid, True, request.first_gen_tokens))

    async def _reserve(
        self,
        core,
        add: AddRequest,
        handoff: worker_pb2.KvHandoff,
        reserved: ImportPlan | None = None,
    ):
        """(the ImportPlan, or None and why not, seconds waited for room): the prompt's blocks
        reserved in the engine (reserved: at the announcement already; aborted when the lease
        has no time left). A pool with no room now is asked again as requests finish, for up
        to room_wait_s: pulling once room frees is cheaper than computing the prompt, which
        would wait for the same room. The handoffs that wait do so in line, the one at its head
        asking (backing off) for all: room goes to them in the order they came. A lease about to
        run out may be freed (and its blocks reused) while we read: with less left than the pull
        should take (by the peer's earlier pulls, PULL_TIME_FACTOR over) plus the margin, it is
        not pulled; after a long wait for room that check is what stops a late pull."""
        pull_bytes = len(handoff.block_ids) * self.poller.transceiver.block_nbytes
        needed = LEASE_SAFETY_MARGIN_S + PULL_TIME_FACTOR * self.links.expected_seconds(
            handoff.ctx_endpoint, pull_bytes
        )

        def lease_left() -> bool:
            return handoff.lease_expires_at - time.time() > needed

        def ask():  # a command of its own each time: the engine's queue time is the call's
            return core.call(dataclasses.replace(add, enqueued_at=time.monotonic()))

        if not lease_left():
            if reserved is not None:
                core.abort(add.request_id)
            return None, Reason.LEASE_EXPIRING, 0.0
        if reserved is not None:
            return reserved, Reason.NONE, 0.0
        if not self._room_line:  # nobody waits: ask at once
            plan = await ask()
            if plan is not None or self.room_wait_s <= 0:
                return plan, Reason.NO_ROOM, 0.0
        refused_at = time.monotonic()
        me = asyncio.Event()
        self._room_line.append(me)
        if self._room_line[0] is me:
            me.set()
        try:
            try:
                await asyncio.wait_for(me.wait(), self.room_wait_s)
            except asyncio.TimeoutError:
                return None, Reason.NO_ROOM, time.monotonic() - refused_at
            delay = ROOM_POLL_FIRST_S
            while True:
                if not lease_left():
                    return None, Reason.LEASE_EXPIRING, time.monotonic() - refused_at
                plan = await ask()
                waited = time.monotonic() - refused_at
                if plan is not None or waited >= self.room_wait_s:
                    return plan, Reason.NO_ROOM, waited
                await asyncio.sleep(min(delay, self.room_wait_s - waited))
                delay = min(2 * delay, ROOM_POLL_MAX_S)
        finally:
            was_head = self._room_line[0] is me
            self._room_line.remove(me)
            if was_head and self._room_line:
                self._room_line[0].set()

    def _end(
        self,
        request,
        handoff: worker_pb2.KvHandoff,
        outcome: Outcome,
        reason: Reason = Reason.NONE,
        num_pulled: int = 0,
        num_cached: int = 0,
    ) -> None:
        """The handoff's one outcome: counted here (the worker's metrics and state) and kept on
        the request (its RequestMetrics and perf metrics: the router counts it per pair)."""
        self.outcomes.record(outcome, request.request_id, handoff.ctx_endpoint, reason)
        request.metrics.kv_handoff = types_pb2.KvHandoffMetrics(
            outcome=outcome.value,
            reason=reason.value,
            prefill=handoff.ctx_endpoint,
            decode=self.outcomes.decode,
            num_pulled_blocks=num_pulled,
            num_cached_blocks=num_cached,
            room_wait_s=request.metrics.room_wait_s,
            reserved_early=request.metrics.reserved_early,
            from_prefill=request.metrics.handoff_from_prefill,
        )

    def _not_loaded(self, request, handoff: worker_pb2.KvHandoff, reason: Reason) -> None:
        """The handoff's KV did not load here (nothing of the request is in the engine now): the
        prompt is computed here (recompute), or the request fails UNAVAILABLE (fail)."""
        if self.load_failure_policy == "fail":
            self._end(request, handoff, Outcome.FAILED, reason)
            request.fail(
                KvLoadFailedError(
                    f"decode worker {self.outcomes.decode} could not load the KV handed off by "
                    f"prefill worker {handoff.ctx_endpoint} ({reason.value}); under "
                    f"--kv-load-failure-policy fail it does not compute the prompt itself",
                    reason.value,
                )
            )
            return
        self._end(request, handoff, Outcome.RECOMPUTED, reason)
        request.submit(Phase.GENERATION_ONLY, output_token_ids=request.first_gen_tokens)

    def _recompute(self, request, handoff: worker_pb2.KvHandoff, answer: LeaseAnswer) -> None:
        """The READ landed but its lease was not confirmed: drop what it brought (the abort frees
        the reserved blocks uncached) and compute the prompt here. A lease that had ended was a
        replayed or stale handoff; one whose prefill did not answer may still be live: end it."""
        if answer is not LeaseAnswer.ENDED:
            self._release_remote(handoff)
        request.core.abort(request.only_sequence.engine_id)
        self._not_loaded(
            request,
            handoff,
            Reason.UNCONFIRMED if answer is LeaseAnswer.ENDED else Reason.PEER_UNREACHABLE,
        )

    def _release_remote(self, handoff: worker_pb2.KvHandoff) -> None:
        """Tells the prefill to free the handoff's blocks without reading them (best effort: the
        lease expires anyway). Detached from the request, which may finish, and cancel its
        tasks, before the prefill answers."""
        task = asyncio.ensure_future(self.peers.end_lease(handoff))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


class HeldOutputs:
    """A pulled sequence's outputs, kept from its stream until its lease is confirmed: the engine
    runs the sequence's first step while the decode asks (the step hides the confirm's round
    trip), and what that step drew reaches the caller only once the KV it read is known to be
    the handoff's. Registered with the engine in the stream's place (put_nowait, as a queue)."""

    __slots__ = ("stream", "items", "holding")

    def __init__(self, stream):
        self.stream = stream
        self.items: list = []
        self.holding = True

    def put_nowait(self, item) -> None:
        if self.holding:
            self.items.append(item)
        elif self.items is not None:
            self.stream.put_nowait(item)

    def release(self) -> None:
        """Passes on what was held, and from now on what comes."""
        if self.holding:
            self.holding = False
            items, self.items = self.items, []
            for item in items:
                self.stream.put_nowait(item)

    def discard(self) -> None:
        """Drops what was held, and whatever still comes (the sequence was aborted)."""
        self.holding, self.items = False, None


async def pull_blocks(
    poller: TransferPoller,
    agent: str,
    remote: list[int],
    local: list[int],
    reads: list[PendingRead],
    on_landed: Callable[[], None] | None = None,
    cancelled: threading.Event | None = None,
) -> tuple[int, int, float, BaseException | None]:
    """Reads a peer's blocks into ours, PULL_CHUNK_BLOCKS to a READ, all posted at once
    (appended to reads as they are), and waits for them all. Returns (how many blocks from
    the start landed, their bytes, the longest READ's seconds, the first READ's error or
    None). A READ that failed is settled here; one after it may have landed, but the KV the
    engine can use is the prefix before the first failure. Handoffs and prefix pulls
    (prefix_pull.py) both pull through here. on_landed: called once every READ has landed
    (on the poller's thread, before this returns; at once when there is nothing to read),
    never when one fails, nor once cancelled is set (the caller's pull was cancelled)."""
    chunk, fail_at = _pull_chunking()
    num_reads = -(-len(remote) // chunk)
    if on_landed is not None and not num_reads:
        on_landed()
    left = [num_reads]  # READs not landed yet; counted down on the poller's one thread

    def landed() -> None:
        left[0] -= 1
        if not left[0] and not (cancelled is not None and cancelled.is_set()):
            on_landed()

    for index, start in enumerate(range(0, len(remote), chunk)):
        if index == fail_at:  # test-only fault (TANDEM_TEST_KV_PULL_FAULT)
            reads.append(_failed_read(f"test fault in READ {index}"))
            continue
        reads.append(
            poller.read(
                agent,
                remote[start : start + chunk],
                local[start : start + chunk],
                b"",
                PULL_TIMEOUT_S,
                landed if on_landed is not None else None,
            )
        )
    results = await asyncio.gather(*(read.done for read in reads), return_exceptions=True)
    num_landed, nbytes, seconds, error = 0, 0, 0.0, None
    for index, result in enumerate(results):
        if isinstance(result, BaseException):
            error = result
            break
        num_landed = min(len(remote), (index + 1) * chunk)
        nbytes += result.nbytes
        seconds = max(seconds, result.seconds)
    if error is not None:
        for read in reads:
            await poller.settle(read)
    return num_landed, nbytes, seconds, error


def _pull_chunking() -> tuple[int, int]:
    """(blocks per READ, the READ that fails or -1), from PULL_FAULT_ENV in tests."""
    value = os.environ.get(PULL_FAULT_ENV)
    if not value:
        return PULL_CHUNK_BLOCKS, -1
    blocks, _, index = value.partition(":")
    if not blocks.isdigit() or not index.isdigit() or int(blocks) < 1:
        raise ValueError(f"{PULL_FAULT_ENV} must be BLOCKS:INDEX (whole numbers), got {value!r}")
    return int(blocks), int(index)


def _failed_read(why: str) -> PendingRead:
    """A READ that failed before anything was posted (nothing to settle)."""
    loop = asyncio.get_running_loop()
    done, settled = loop.create_future(), loop.create_future()
    done.set_exception(TransferError(why))
    settled.set_result(True)
    return PendingRead(done, settled, 0.0)

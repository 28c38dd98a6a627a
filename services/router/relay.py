"""The router's request path: one Relay per client request, a state machine that carries it from
the workers' output batches to the client's stream (token ids; the text front is around it).

    Relay.stream picks how the request runs:
      direct   a client's own context_only or generation_only request, or n > 1 on one worker:
               one leg on one worker, relayed as it comes (no migration)
      whole    one sequence on one worker (an aggregated one, else a decode or prefill worker
               that computes the prompt too)                                    -> GENERATE
      split    prefill/decode (pool.should_split; whole instead when it says no)  -> CONTEXT
               (unless --no-announce-decode, its generation phase goes to a decode worker now,
               awaiting its handoff: the decode takes it in while the prompt is computed, and
               the handoff alone crosses after the context phase)
      n > 1    over a split: n single-sequence splits, one child Relay each (seed + i)

    CONTEXT    context_only on a prefill worker; one that dies or hangs before its reply is
               replaced while another remains; none left: the request runs whole -> GENERATE
    HANDOFF    the first token goes to the client before the KV moves; finished in the context
               phase (max_tokens=1, EOS, cancelled): END; aborted or stopped meanwhile: END
    GENERATE   generation_only on a decode worker that pulls the KV (no decode left: another
               worker computes it again): the announced request's handoff, or the request whole;
               an announced decode that failed before its handoff gets the request whole
               (another decode if one is ready); a decode that could not load the KV (and ended
               its lease) is retried once on another prefill/decode pair -> CONTEXT, GENERATE
    MIGRATE    a worker that dies or hangs mid-stream (worker_gone): the stream goes on on
               another worker as generation_only with every token streamed so far and no KV (it
               recomputes them), at most MAX_MIGRATIONS times: the client sees one continuous
               stream, no token lost or repeated (a seeded request's randomness depends only on
               (seed, token index))
    END        the last message or an error status; the prefill's lease is released here
               unless the decode ended it itself (every normal end of its phase)

Stop strings (the text front calls stop) and Abort (abort) end a request wherever it is: on its
worker, or, when the worker does not know it yet, by cutting its leg here. A leg (legs.py) is one
request on one worker's session (session_client.py), read from its inbox (inbox.py) by the
relay's one generator: a streamed token passes no other generator between the session's reader
and the call's handler, which runs the text front.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from tandem.common.background import spawn
from tandem.common.errors import BEFORE_HANDOFF, KV_LOAD_FAILED, RpcError, failure_reason
from tandem.common.logs import bind
from tandem.common.outputs import cancelled_output, merge_outputs
from tandem.common.roles import Role
from tandem.common.sampling import check_several_returns
from tandem.common.streams import closing, merge
from tandem.router import perf_merge
from tandem.router.inbox import SessionBroken
from tandem.router.legs import Leg, WorkerStalledError
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import Placement
from tandem.router.workers import LOCAL_ROLES, WorkerHandle, WorkerPool
from tandem.v1 import llm_pb2, types_pb2, worker_pb2

log = logging.getLogger("tandem.router.relay")

# Workers a stream may move off (died or hung under it) before its error reaches the client.
MAX_MIGRATIONS = 2
# Where the generation phase of a split can go on: a decode worker (pulling the KV, or
# recomputing it after a migration), else any worker that recomputes it.
GENERATION_ROLES = (Role.DECODE, Role.BOTH, Role.PREFILL)
# How a decode phase that ended its handoff's lease itself ends.
_NORMAL_ENDS = (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)


@dataclass(slots=True)
class Progress:
    """What a single-sequence stream has produced so far: all a migration needs to carry it on."""

    prompt_token_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    # cumulative_logprob of `tokens` that no current worker sampled (the context phase's first
    # token, tokens before a migration): added to what the current worker reports.
    logprob_base: float = 0.0
    # A migration moved the stream after some of its tokens: the current worker recomputed them.
    is_recomputed: bool = False
    # Workers the stream moved off (died or hung under it).
    num_migrations: int = 0


@dataclass(slots=True)
class _Split:
    """A split request past its context phase: the handoff its decode phase presents."""

    prefill: WorkerHandle
    # The context_only request (a retry after a failed KV load sends it again).
    ctx: llm_pb2.GenerateRequest
    # The context phase's reply as the client gets it (its first token).
    first: types_pb2.RequestOutput
    handoff: types_pb2.DisaggregatedParams
    started: float
    first_token_s: float = 0.0
    # The prefill's share of the metrics the client gets on the last message.
    prefill_metrics: types_pb2.RequestMetrics = field(default_factory=types_pb2.RequestMetrics)
    prefill_perf: types_pb2.PerfMetrics = field(default_factory=types_pb2.PerfMetrics)
    decode: WorkerHandle | None = None
    # The decode pulls the prefill's KV (else it computes the prompt again).
    pulls: bool = False
    # The decode ends the lease of a handoff it was given on every way its phase ends normally
    # (decode/generation.py); the relay ends it on the others (abort, stop, error, migration).
    decode_ended_lease: bool = False


@dataclass(slots=True)
class _Sequence:
    """A single sequence's generation phase (a whole run, or a split's decode side): where it
    runs now and what it has produced."""

    # What the phase asks for: the client's request, a handoff's generation_only, or a resume.
    request: llm_pb2.GenerateRequest
    worker: WorkerHandle
    # Where a migration may move it.
    migrate_to: tuple[Role, ...]
    progress: Progress
    wants_perf: bool
    split: _Split | None = None
    # What its worker was sent: request, or a resume after a migration.
    current: llm_pb2.GenerateRequest | None = None
    # The workers it moved off since the phase (re)started, and how many times it moved.
    tried: set[str] = field(default_factory=set)
    num_moves: int = 0
    # The cumulative logprob of every token so far: the next worker's logprob_base.
    last_cumulative: float = 0.0
    is_handoff_retried: bool = False
    # A whole run's start as the router saw it (its perf metrics when a migration recomputed it).
    sent_time: float = 0.0
    first_token_time: float = 0.0

    def __post_init__(self) -> None:
        self.restart(self.worker)

    def restart(self, worker: WorkerHandle) -> None:
        """The phase (again) from its request, on worker: migrations count afresh."""
        self.worker, self.current, self.tried, self.num_moves = worker, self.request, set(), 0
        self.last_cumulative = self.progress.logprob_base


class Relay:
    """One client request as the router carries it: the worker it runs on now (Abort follows it
    from the prefill to the decode worker, and to the worker a migration moves it to), the
    workers it went through, its progress, and the transitions that move or stop it."""

    def __init__(
        self,
        pool: WorkerPool,
        request_id: str,
        metrics: RouterMetrics,
        client: str = "",
        progress_timeout_s: float = 10.0,
        placement: Placement | None = None,
        deadline: float | None = None,
        arrival_time: float | None = None,
    ):
        self.pool = pool
        # When the request reached the router (time.time(): the perf metrics' clock).
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # The client's deadline (time.monotonic()); every worker call carries what is left of it.
        self.deadline = deadline
        # What the pick policies know of the request (its prompt's blocks, adapter, conversation).
        self.placement = placement if placement is not None else Placement()
        self.request_id = request_id
        self.metrics = metrics
        # Who started the request (common/callers.py): named to the workers, the only one who may abort it.
        self.client = client
        # A stream quiet this long gets its worker probed (a hung worker's streams move on).
        self.progress_timeout_s = progress_timeout_s
        self.worker: WorkerHandle | None = None
        # The leg being read (Abort cuts it when the worker does not know the request yet).
        self.leg: Leg | None = None
        # Ended by the client (Abort) or by a stop string: whatever comes next is not streamed on.
        self.cancelled = False
        self.served_by: list[str] = []
        # n > 1 over a prefill/decode split: one child relay per sequence.
        self.children: list[Relay] = []
        # A split's decode leg announced while its context phase runs, until its handoff goes.
        self.announced: Leg | None = None

    def child(self, request_id: str) -> Relay:
        return Relay(
            self.pool,
            request_id,
            self.metrics,
            self.client,
            self.progress_timeout_s,
            dataclasses.replace(self.placement, overlap={}),
            self.deadline,
            self.arrival_time,
        )

    def stream(self, request: llm_pb2.GenerateRequest) -> AsyncIterator[types_pb2.RequestOutput]:
        """The messages of request, which asks the workers for streamed token ids. The worker of
        a direct request is picked here, at once."""
        pool, placement = self.pool, self.placement
        request_type = request.disaggregated_params.request_type
        if request_type == types_pb2.REQUEST_TYPE_CONTEXT_ONLY:
            return self.direct(pool.pick(Role.PREFILL, placement=placement), request)
        if request_type == types_pb2.REQUEST_TYPE_GENERATION_ONLY:
            # A handoff needs a decode worker's transceiver; a resume without one runs anywhere.
            roles = (
                (Role.DECODE,)
                if request.disaggregated_params.opaque_state
                else (Role.DECODE, Role.BOTH)
            )
            worker = pool.pick_any_of(roles, placement=placement)
            return self.direct(worker, request, return_first_gen_tokens=True)
        if pool.can_disaggregate and not request.sampling_params.use_beam_search:  # beams: whole
            if request.sampling_params.n > 1:
                return self._split_n(request)
            return self._sequence(request, can_split=True)
        if request.sampling_params.n > 1:
            return self.direct(pool.pick_any_of(LOCAL_ROLES, placement=placement), request)
        return self._sequence(request, can_split=False)

    # -- the legs -------------------------------------------------------------------------------

    async def _open(
        self,
        worker: WorkerHandle,
        request: llm_pb2.GenerateRequest,
        split: bool = False,
        return_first_gen_tokens: bool = False,
        hand_off_to: str = "",
    ) -> Leg:
        """Sends request to worker on its session: the leg to read it from (a request aborted
        while the session opened is not sent: its leg says cancelled). split: the context_only half of
        a request the router splits itself; return_first_gen_tokens: a client's own
        generation_only request, whose output starts with the tokens it carries; hand_off_to: see
        _context_with_retry."""
        self._follow(worker)
        return await Leg.open(self, worker, request, split, return_first_gen_tokens, hand_off_to)

    def _follow(self, worker: WorkerHandle) -> None:
        """The request runs on worker now (Abort and stop strings go there)."""
        self.worker = worker
        self.served_by.append(worker.address)
        bind(route=" -> ".join(self.served_by))

    def _announce(self, request: llm_pb2.GenerateRequest, split_id: int) -> Leg | None:
        """A split's generation phase sent to a decode worker as its context phase starts
        (awaits_handoff): the decode takes it in meanwhile and pulls the KV as soon as
        _hand_off sends the handoff. None when announcing is off, no decode is ready, or its
        session is not open, full or takes no announcements (the decode is then picked after
        the context phase, as unannounced). Nothing here waits. split_id: the split's
        disagg_request_id, under which the prefill may send the handoff to the decode itself."""
        if not self.pool.announce_decode or self.cancelled:
            return None
        decode = self._pick_or_none((Role.DECODE,), set())
        if decode is None:
            return None
        gen = llm_pb2.GenerateRequest()
        gen.CopyFrom(request)
        gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        gen.disaggregated_params.disagg_request_id = split_id
        try:
            return Leg.announce(self, decode, gen)
        except RpcError:  # larger than the worker takes: the request whole will say so
            return None

    async def direct(
        self,
        worker: WorkerHandle,
        request: llm_pb2.GenerateRequest,
        return_first_gen_tokens: bool = False,
    ):
        """One leg, relayed as it comes."""
        wants_perf = request.sampling_params.return_perf_metrics
        leg = await self._open(worker, request, return_first_gen_tokens=return_first_gen_tokens)
        try:
            while (msg := await leg.next()) is not None:
                if wants_perf:
                    perf_merge.stamp_arrival(msg, self.arrival_time)
                yield msg
        finally:
            leg.close()

    # -- CONTEXT and HANDOFF --------------------------------------------------------------------

    async def _context(self, request: llm_pb2.GenerateRequest, split_id: int) -> _Split | None:
        """The context phase of request on a prefill worker; None when no prefill is left. The
        prefill sends its handoff to the announced decode too (unless --no-direct-handoff)."""
        started = time.monotonic()
        ctx = llm_pb2.GenerateRequest()
        ctx.CopyFrom(request)
        ctx.streaming = False
        ctx.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_CONTEXT_ONLY
        ctx.disaggregated_params.disagg_request_id = split_id
        ctx.disaggregated_params.finish_in_context = True
        direct = self.announced is not None and self.pool.direct_handoff
        context = await self._context_with_retry(
            ctx, hand_off_to=self.announced.worker.address if direct else ""
        )
        if context is None:
            return None
        prefill, ctx_out = context
        handoff = types_pb2.DisaggregatedParams()
        handoff.CopyFrom(ctx_out.outputs[0].disaggregated_params)
        # The first token's logprob stays in Progress.logprob_base.
        handoff.ClearField("first_gen_log_probs")
        ctx_out.ClearField("disaggregated_params")
        for out in ctx_out.outputs:  # router-internal; the caller did not ask for a split
            out.ClearField("disaggregated_params")
            if out.finish_reason == types_pb2.FINISH_REASON_NOT_FINISHED:
                out.finish_reason = types_pb2.FINISH_REASON_UNSPECIFIED
        split = _Split(prefill, ctx, ctx_out, handoff, started)
        if not handoff.opaque_state:  # finished in the context phase: the reply is the whole
            return split
        split.first_token_s = time.monotonic() - started
        split.prefill_metrics.CopyFrom(ctx_out.metrics)
        ctx_out.ClearField("metrics")  # metrics come once, on the last message
        if request.sampling_params.return_perf_metrics:
            split.prefill_perf.CopyFrom(ctx_out.outputs[0].perf_metrics)
            # So do perf metrics: the decode's, combined with these.
            ctx_out.outputs[0].ClearField("perf_metrics")
        ctx_out.finished = False
        return split

    async def _context_with_retry(
        self, ctx: llm_pb2.GenerateRequest, tried: set[str] | None = None, hand_off_to: str = ""
    ) -> tuple[WorkerHandle, types_pb2.RequestOutput] | None:
        """Runs the context phase; a prefill that dies or hangs is replaced while others remain.
        Returns the prefill and its reply (one message), or None when no prefill is left to
        run it. tried: prefills not to use; hand_off_to: the announced decode, which the prefill
        sends its handoff to as well. A prefill that failed may have sent it one already (and
        the decode gone on from its first token): the announcement is dropped before another
        prefill runs the context phase, whose generation phase then goes to a decode picked
        after it."""
        tried = set(tried or ())
        while True:
            prefill = self._pick_or_none((Role.PREFILL,), tried)
            if prefill is None:
                return None
            out = None
            try:
                leg = await self._open(prefill, ctx, split=True, hand_off_to=hand_off_to)
                try:
                    # Its one message, or the messages its steps came in, merged.
                    while (msg := await leg.next()) is not None:
                        out = msg if out is None else merge_outputs([out, msg])
                finally:
                    leg.close()
                if self.cancelled and not _hands_off(out):
                    self._release_lost_handoff(prefill, ctx)
                return prefill, out
            except (grpc.aio.AioRpcError, WorkerStalledError) as exc:
                if not await worker_gone(prefill, exc, self.pool.health_timeout_s):
                    # The reply may have come on its own after all.
                    self._release_lost_handoff(prefill, ctx)
                    raise
                log.warning(
                    "prefill %s failed (%s); retrying %s elsewhere",
                    prefill.address,
                    _code(exc),
                    ctx.request_id,
                )
                self.pool.mark_down(prefill)
                tried.add(prefill.address)
                self.metrics.prefill_retried()
                if hand_off_to:
                    self._drop_announced()
                    hand_off_to = ""
            except BaseException:
                # Cancelled after the reply came: the handoff it carries is nobody else's to release.
                if _hands_off(out):
                    lease_id = out.outputs[0].disaggregated_params.ctx_request_id
                    spawn(release_lease(self.pool, prefill, lease_id))
                else:
                    self._release_lost_handoff(prefill, ctx)
                raise

    def _release_lost_handoff(self, prefill: WorkerHandle, ctx: llm_pb2.GenerateRequest) -> None:
        """The context call was cancelled before its reply was read: the prefill may have
        finished and sent a handoff that nobody will present. Its lease goes by the split's
        disagg_request_id (the request is aborted there if it still runs); without this it
        would wait for its expiry."""
        disagg_request_id = ctx.disaggregated_params.disagg_request_id
        spawn(release_lease(self.pool, prefill, 0, disagg_request_id))

    async def _another_pair(self, split: _Split) -> bool:
        """Another prefill/decode pair for a split whose decode could not load its KV: another
        prefill runs the context phase again (the same one if it is the only one) and another
        decode (the same one if it is the only one) will pull it; False when neither has
        another."""
        prefill, decode = split.prefill, split.decode
        other_prefill = self._pick_or_none((Role.PREFILL,), {prefill.address})
        other_decode = self._pick_or_none((Role.DECODE,), {decode.address})
        if other_prefill is None and other_decode is None:
            return False
        again = llm_pb2.GenerateRequest()
        again.CopyFrom(split.ctx)
        # An id of its own: the first context phase may still be closing on the same prefill.
        again.request_id = f"{split.ctx.request_id}#kv-retry"
        again.disaggregated_params.disagg_request_id = random.getrandbits(63)
        # Its first token is not the client's (the client has one already): it always hands off.
        again.disaggregated_params.finish_in_context = False
        tried = {prefill.address} if other_prefill is not None else set()
        context = await self._context_with_retry(again, tried)
        if context is None:
            return False
        new_prefill, out = context
        handoff = types_pb2.DisaggregatedParams()
        if out.outputs:
            handoff.CopyFrom(out.outputs[0].disaggregated_params)
        if not handoff.opaque_state:
            return False
        # The new lease is ended as the first one would have been.
        split.prefill, split.decode, split.handoff = new_prefill, other_decode or decode, handoff
        return True

    # -- GENERATE, MIGRATE, END: the one generator ----------------------------------------------

    async def _sequence(self, request: llm_pb2.GenerateRequest, can_split: bool):
        """One sequence, split over a prefill and a decode worker (can_split, unless conditional
        disaggregation says no) or whole on one worker. Every message its workers stream passes
        here, and only here, on its way to the text front."""
        wants_perf = request.sampling_params.return_perf_metrics
        split: _Split | None = None
        roles = LOCAL_ROLES  # where a whole run starts
        if can_split:
            is_split, reason = self.pool.should_split(self.placement)
            self.metrics.disagg_decided(is_split, reason)
            if is_split:
                split_id = random.getrandbits(63)  # the split's disagg_request_id
                self.announced = self._announce(request, split_id)
                try:
                    # None: no prefill left, it runs whole
                    split = await self._context(request, split_id)
                finally:
                    if split is None or not split.handoff.opaque_state:
                        self._drop_announced()  # failed, or no generation phase to announce
            else:
                roles = (Role.DECODE,) + LOCAL_ROLES
        if split is not None and not split.handoff.opaque_state:
            # Finished in the context phase (max_tokens=1, EOS, cancelled): its reply is all.
            split.first.metrics.served_by[:] = self.served_by
            yield self._stamped(split.first, wants_perf)
            return
        try:
            if split is not None:  # HANDOFF
                if not self.cancelled:
                    # The first token reaches the client before the KV moves.
                    yield self._stamped(split.first, wants_perf)
                if self.cancelled:  # aborted (or stopped by a stop string) before the decode
                    last = cancelled_output(request.request_id)
                    self._client_metrics(split, last.metrics)
                    if wants_perf:  # the prefill's record is the whole of it
                        last.outputs[0].perf_metrics.CopyFrom(split.prefill_perf)
                    yield self._stamped(last, wants_perf)
                    return
                seq = self._decode_phase(request, split)
            else:
                seq = _Sequence(
                    request,
                    self.pool.pick_any_of(roles, placement=self.placement),
                    LOCAL_ROLES,
                    Progress([]),
                    wants_perf,
                )
                # The start as the router saw it: the perf metrics of a stream a migration
                # recomputed.
                seq.sent_time = time.time() if wants_perf else 0.0
            while True:  # GENERATE; after a failed leg, MIGRATE (or the handoff once more)
                leg, failure = None, None
                try:
                    leg = self._hand_off(seq) or await self._open(seq.worker, seq.current)
                    progress = seq.progress
                    while (msg := await leg.next()) is not None:
                        # The worker sends what it generates, not the tokens the stream already
                        # has, and its own cumulative logprob.
                        for out in msg.outputs:
                            progress.tokens.extend(out.token_ids)
                            out.cumulative_logprob += progress.logprob_base
                            seq.last_cumulative = out.cumulative_logprob
                        if not progress.prompt_token_ids and msg.prompt_token_ids:
                            progress.prompt_token_ids = list(msg.prompt_token_ids)
                        self._present(seq, msg)
                        yield msg
                except (grpc.aio.AioRpcError, WorkerStalledError) as exc:
                    failure = exc
                finally:
                    if leg is not None:
                        leg.close()
                if failure is None:
                    return
                last = await self._recover(seq, failure)
                if last is not None:  # aborted meanwhile
                    yield last
                    return
        finally:  # END
            self._drop_announced()
            if split is not None and not split.decode_ended_lease:
                lease_id = split.handoff.ctx_request_id
                spawn(release_lease(self.pool, split.prefill, lease_id))

    def _decode_phase(self, request: llm_pb2.GenerateRequest, split: _Split) -> _Sequence:
        """The generation phase of a split: on a decode worker that pulls the KV, else (no decode
        worker is left) on another worker that computes the prompt again and carries on."""
        first = split.first
        progress = Progress(
            list(first.prompt_token_ids),
            list(split.handoff.first_gen_tokens),
            first.outputs[0].cumulative_logprob,
        )
        announced = self.announced
        if announced is not None and (announced.is_waiting or announced.failed_loading_kv):
            # (A decode that failed the pull of the prefill's own handoff keeps the request: its
            # failure is the pair's, counted and retried on another pair as any failed pull.)
            decode = announced.worker
        elif announced is not None:  # it failed, or its decode went down, meanwhile
            self._drop_announced("resent")
            decode = self._other_decode(announced.worker)
        else:
            decode = self._pick_or_none((Role.DECODE,), set())
        split.pulls = decode is not None
        if split.pulls:
            gen = llm_pb2.GenerateRequest()
            gen.CopyFrom(request)
            gen.prompt.token_ids.ids[:] = first.prompt_token_ids
            gen.disaggregated_params.CopyFrom(split.handoff)
            gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        else:
            decode = self.pool.pick_any_of(LOCAL_ROLES, placement=self.placement)
            gen = resume_request(request, progress.prompt_token_ids, progress.tokens)
        split.decode = decode
        wants_perf = request.sampling_params.return_perf_metrics
        return _Sequence(gen, decode, GENERATION_ROLES, progress, wants_perf, split)

    def _hand_off(self, seq: _Sequence) -> Leg | None:
        """The announced decode leg, now given its handoff (seq's request carries it); None when
        none was announced or it went already."""
        leg, self.announced = self.announced, None
        if leg is not None:
            self._follow(leg.worker)
            leg.hand_off(seq.current.disaggregated_params)
            self.metrics.announcement_ended("handed_off")
        return leg

    def _drop_announced(self, outcome: str = "dropped") -> None:
        """The announced decode leg, if any, is not used: the decode drops its request."""
        leg, self.announced = self.announced, None
        if leg is not None:
            leg.close()
            self.metrics.announcement_ended(outcome)

    def _other_decode(self, failed: WorkerHandle) -> WorkerHandle | None:
        """A decode worker other than failed (which refused a request), else failed itself if it
        is still the only one ready: the request whole meets what it would have unannounced."""
        return self._pick_or_none((Role.DECODE,), {failed.address}) or self._pick_or_none(
            (Role.DECODE,), set()
        )

    def _present(self, seq: _Sequence, msg: types_pb2.RequestOutput) -> None:
        """A message of the generation phase as the client gets it."""
        split = seq.split
        if split is not None:
            # No prompt (the first message had it); the split's metrics as one request's.
            msg.ClearField("prompt")
            del msg.prompt_token_ids[:]
            if seq.wants_perf:
                for out in msg.outputs:
                    if out.HasField("perf_metrics"):
                        perf_merge.combine_split(split.prefill_perf, out.perf_metrics)
            if msg.finished:
                self._client_metrics(split, msg.metrics)
                self._count_handoff(split, msg.metrics, seq.progress)
                split.decode_ended_lease = (
                    seq.request.disaggregated_params.opaque_state != b""
                    and not seq.progress.num_migrations
                    and bool(msg.outputs)
                    and msg.outputs[0].finish_reason in _NORMAL_ENDS
                )
        else:
            if seq.wants_perf:
                if not seq.first_token_time and any(out.token_ids for out in msg.outputs):
                    seq.first_token_time = time.time()
                if seq.progress.is_recomputed:
                    perf_merge.start_from_router(msg, seq.sent_time, seq.first_token_time)
            if msg.finished:
                msg.metrics.served_by[:] = self.served_by
        if seq.wants_perf:
            perf_merge.stamp_arrival(msg, self.arrival_time)

    def _stamped(self, msg: types_pb2.RequestOutput, wants_perf: bool) -> types_pb2.RequestOutput:
        """msg with the router's arrival time in its perf metrics (when asked for)."""
        if wants_perf:
            perf_merge.stamp_arrival(msg, self.arrival_time)
        return msg

    async def _recover(self, seq: _Sequence, exc: BaseException) -> types_pb2.RequestOutput | None:
        """After a failed leg: MIGRATE when its worker is gone, else, for a decode that could not
        load its KV, the handoff once more on another pair. Returns the last message when the
        request was aborted meanwhile; raises exc when the stream cannot go on."""
        if failure_reason(exc) == BEFORE_HANDOFF and seq.split is not None:
            # The announced decode failed before it took the handoff (nothing of it was used):
            # the request goes whole to a decode picked now, as it would have unannounced.
            self.metrics.announcement_ended("resent")
            decode = self._other_decode(seq.worker)
            if decode is not None:
                seq.restart(decode)
                seq.split.decode = decode
            return None
        try:
            return await self._migrate(seq, exc)
        except grpc.aio.AioRpcError as final:
            return await self._retry_handoff(seq, final)

    async def _migrate(self, seq: _Sequence, exc: BaseException) -> types_pb2.RequestOutput | None:
        """The stream goes on on another worker of seq.migrate_to (if its worker is gone, at most
        MAX_MIGRATIONS times), as generation_only with every token so far and no KV."""
        worker = seq.worker
        if seq.num_moves == MAX_MIGRATIONS or not await worker_gone(
            worker, exc, self.pool.health_timeout_s
        ):
            raise exc
        if self.cancelled:  # aborted while its worker died: nothing to carry on
            last = cancelled_output(seq.request.request_id)
            self._present(seq, last)
            return last
        progress = seq.progress
        log.warning(
            "worker %s failed under %s (%s) after %d tokens; migrating",
            worker.address,
            seq.request.request_id,
            _code(exc),
            len(progress.tokens),
        )
        self.pool.mark_down(worker)
        seq.tried.add(worker.address)
        self.metrics.migrated()
        progress.num_migrations += 1
        if progress.prompt_token_ids:
            seq.current = resume_request(seq.request, progress.prompt_token_ids, progress.tokens)
            progress.logprob_base = seq.last_cumulative
            progress.is_recomputed = progress.is_recomputed or bool(progress.tokens)
        # else nothing came back yet (not even the prompt's tokens): the request goes again as
        # it was
        seq.worker = self._pick_or_none(seq.migrate_to, seq.tried)
        if seq.worker is None:
            raise exc
        seq.num_moves += 1
        return None

    async def _retry_handoff(
        self, seq: _Sequence, exc: grpc.aio.AioRpcError
    ) -> types_pb2.RequestOutput | None:
        """A decode under --kv-load-failure-policy fail could not load the KV (and ended its
        lease): the request goes once more to another prefill/decode pair."""
        split, why = seq.split, failure_reason(exc)
        if split is None or not split.pulls or not why.startswith(KV_LOAD_FAILED + ":"):
            raise exc
        # Counted for the pair that failed, the retried one too (as its decode counts it).
        self.metrics.kv_handoff_ended(
            split.prefill.address, split.decode.address, "failed", why.partition(":")[2]
        )
        if seq.is_handoff_retried or not await self._another_pair(split):
            raise exc
        seq.is_handoff_retried = True
        log.warning(
            "request %s: decode could not load its KV (%s); retrying on prefill %s and decode %s",
            seq.request.request_id,
            why,
            split.prefill.address,
            split.decode.address,
        )
        if self.cancelled:
            last = cancelled_output(seq.request.request_id)
            self._client_metrics(split, last.metrics)
            return self._stamped(last, seq.wants_perf)
        gen, handoff = seq.request, split.handoff
        if list(handoff.first_gen_tokens) != list(seq.progress.tokens):
            # The new prefill's drafts followed its own first token, not the client's.
            handoff.ClearField("draft_tokens")
        handoff.first_gen_tokens[:] = seq.progress.tokens  # the tokens the client has
        handoff.ClearField("first_gen_log_probs")
        gen.disaggregated_params.CopyFrom(handoff)
        gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        seq.restart(split.decode)
        return None

    def _client_metrics(self, split: _Split, metrics: types_pb2.RequestMetrics) -> None:
        """The client's view: the whole request as the router saw it; the prompt was computed
        (or cached) on the prefill, the decode only pulled it."""
        metrics.served_by[:] = self.served_by
        metrics.time_to_first_token_s = split.first_token_s
        metrics.e2e_latency_s = time.monotonic() - split.started
        metrics.num_computed_prompt_tokens = split.prefill_metrics.num_computed_prompt_tokens
        metrics.num_cached_prompt_tokens = split.prefill_metrics.num_cached_prompt_tokens
        if split.prefill_metrics.HasField("prefix_pull"):
            metrics.prefix_pull.CopyFrom(split.prefill_metrics.prefix_pull)

    def _count_handoff(
        self, split: _Split, metrics: types_pb2.RequestMetrics, progress: Progress
    ) -> None:
        """The split's handoff outcome, per prefill->decode pair: as its decode reported it, or,
        where no decode used it, recomputed (the decode went away under the request: migrated;
        no decode worker was left to pull it: no_decode)."""
        if metrics.HasField("kv_handoff"):
            handoff = metrics.kv_handoff
            self.metrics.kv_handoff_ended(
                split.prefill.address,
                handoff.decode or split.decode.address,
                handoff.outcome,
                handoff.reason,
            )
        elif progress.num_migrations or not split.pulls:
            reason = "migrated" if split.pulls else "no_decode"
            self.metrics.kv_handoff_ended(
                split.prefill.address, split.decode.address, "recomputed", reason
            )

    async def _split_n(self, request: llm_pb2.GenerateRequest):
        """n > 1 over prefill/decode: n single-sequence splits (seed + i, as an aggregated worker
        seeds its n sequences), streamed together, outputs re-indexed, one final message."""
        check_several_returns(request.sampling_params)  # each split has n=1: refuse greedy n > 1
        n = request.sampling_params.n
        subs = []
        for i in range(n):
            sub = llm_pb2.GenerateRequest()
            sub.CopyFrom(request)
            sub.request_id = f"{request.request_id}/{i}"
            sub.sampling_params.n = 1
            if sub.sampling_params.HasField("seed"):
                sub.sampling_params.seed += i
            self.children.append(self.child(sub.request_id))
            subs.append(sub)
        first = True
        async with closing(
            merge([child._sequence(sub, True) for child, sub in zip(self.children, subs)])
        ) as items:
            async for index, item in items:
                item.request_id = request.request_id
                item.finished = False
                for out in item.outputs:
                    out.index = index
                if not first:
                    item.ClearField("prompt")
                    del item.prompt_token_ids[:]
                first = False
                yield item
        yield types_pb2.RequestOutput(request_id=request.request_id, finished=True)

    # -- stop strings and Abort -----------------------------------------------------------------

    async def abort(self) -> None:
        """Stops the request wherever it is: the worker aborts it, or (not registered there yet)
        its leg is cut."""
        self.cancelled = True
        for child in self.children:
            await child.abort()
        if self.worker is None:
            return
        try:
            reply = await self.worker.llm.Abort(
                llm_pb2.AbortRequest(request_id=self.request_id), timeout=5
            )
            aborted = reply.aborted
        except grpc.aio.AioRpcError:  # the worker is gone (a migration may be under way)
            aborted = False
        if not aborted and self.leg is not None:
            self.leg.cut()

    async def stop(self, index: int, handoff: types_pb2.DisaggregatedParams | None) -> None:
        """The text front found a stop string in sequence `index`: end it where it runs."""
        if self.children:
            await self.children[index].abort()
            return
        if handoff is not None and handoff.HasField("ctx_request_id"):
            # A context_only reply whose handoff the client will not get: its lease can go now.
            await release_lease(self.pool, self.worker, handoff.ctx_request_id)
            return
        if self.worker is None:
            return
        try:
            reply = await self.worker.internal.StopSequences(
                worker_pb2.StopSequencesRequest(request_id=self.request_id, indices=[index]),
                timeout=5,
            )
        except grpc.aio.AioRpcError as exc:
            # The sequence carries on where it is; the text front drops what it still produces.
            log.info(
                "StopSequences(%s) on %s: %s", self.request_id, self.worker.address, exc.code()
            )
            return
        if not reply.found:  # between workers (the context phase is over), or done: end it here
            await self.abort()

    def _pick_or_none(self, roles: tuple[Role, ...], exclude: set[str]) -> WorkerHandle | None:
        try:
            return self.pool.pick_any_of(roles, exclude, placement=self.placement)
        except RpcError:
            return None


def _hands_off(out: types_pb2.RequestOutput | None) -> bool:
    return (
        out is not None
        and bool(out.outputs)
        and bool(out.outputs[0].disaggregated_params.opaque_state)
    )


def _code(exc: BaseException) -> str:
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__


def resume_request(
    request: llm_pb2.GenerateRequest, prompt_token_ids, tokens_so_far: list[int]
) -> llm_pb2.GenerateRequest:
    """generation_only without a handoff: the worker recomputes the KV of prompt + tokens_so_far."""
    resumed = llm_pb2.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.prompt.token_ids.ids[:] = prompt_token_ids
    resumed.ClearField("disaggregated_params")
    resumed.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
    resumed.disaggregated_params.first_gen_tokens[:] = tokens_so_far
    return resumed


async def worker_gone(worker: WorkerHandle, exc: BaseException, timeout_s: float = 1.0) -> bool:
    """A dead worker's calls fail UNAVAILABLE, but so do a live one's refusals (paused,
    released): only a worker that no longer answers its health check is gone (or one whose
    stream stalled while it did not answer, or whose session with the router ended under the
    request: the request stopped there)."""
    if isinstance(exc, (WorkerStalledError, SessionBroken)):  # gone for the request
        return True
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    if failure_reason(exc):  # the worker said what failed: it answered, so it is there
        return False
    try:
        reply = await worker.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return True
    return reply.status != health_pb2.HealthCheckResponse.SERVING


async def release_lease(
    pool: WorkerPool, prefill: WorkerHandle, ctx_request_id: int, disagg_request_id: int = 0
) -> None:
    """Best effort, for a split whose decode phase did not end the lease (aborted, stopped,
    failed, migrated, or never started). disagg_request_id instead of ctx_request_id: the lease
    of the router's own split of that id (its reply was lost)."""
    request = worker_pb2.ReleaseKvRequest(
        ctx_request_id=ctx_request_id, disagg_request_id=disagg_request_id
    )
    try:
        await prefill.internal.ReleaseKv(request, timeout=5, metadata=pool.admin_metadata)
    except grpc.aio.AioRpcError as exc:
        log.info(
            "ReleaseKv(%d/%d) on %s: %s (the lease expires anyway)",
            ctx_request_id,
            disagg_request_id,
            prefill.address,
            exc.code(),
        )

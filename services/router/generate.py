"""How the router runs one Generate (token ids in, token ids out; the text front is around it):
on one worker, or split (context_only on a prefill worker, then generation_only on a decode
worker), or, for n > 1 over a split, as n single-sequence splits. A split whose prefill (or
decode) side has no ready worker left runs on one worker of another role instead."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator

import grpc

from tandem.common.background import spawn
from tandem.common.errors import KV_LOAD_FAILED, failure_reason
from tandem.common.outputs import cancelled_output
from tandem.common.roles import Role
from tandem.common.sampling import check_several_returns
from tandem.common.streams import closing, merge
from tandem.router import failover, perf_metrics
from tandem.router.failover import Progress
from tandem.router.route import Route, release_lease
from tandem.router.workers import LOCAL_ROLES
from tandem.v1 import llm_pb2, types_pb2

log = logging.getLogger("tandem.router.generate")

# Where the generation phase of a split can go on: a decode worker (pulling the KV, or
# recomputing it after a migration), else any worker that recomputes it.
GENERATION_ROLES = (Role.DECODE, Role.BOTH, Role.PREFILL)
# How a decode phase that ended its handoff's lease itself ends.
_NORMAL_ENDS = (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)


def stream(
    route: Route, request: llm_pb2.GenerateRequest
) -> AsyncIterator[types_pb2.RequestOutput]:
    """The messages of request, which asks the workers for streamed token ids. The worker of a
    relayed call is picked here, at once; the stream is the relay itself (no layer of its own, but
    for requests that ask for perf metrics: every layer costs each relayed message a generator hop)."""
    pool, placement = route.pool, route.placement
    request_type = request.disaggregated_params.request_type
    if request_type == types_pb2.REQUEST_TYPE_CONTEXT_ONLY:
        messages = route.relay(pool.pick(Role.PREFILL, placement=placement), request)
    elif request_type == types_pb2.REQUEST_TYPE_GENERATION_ONLY:
        # A handoff needs a decode worker's transceiver; a resume without one runs anywhere.
        roles = (
            (Role.DECODE,)
            if request.disaggregated_params.opaque_state
            else (Role.DECODE, Role.BOTH)
        )
        messages = route.relay(
            pool.pick_any_of(roles, placement=placement), request, return_first_gen_tokens=True
        )
    elif (
        pool.can_disaggregate and not request.sampling_params.use_beam_search
    ):  # beams: aggregated only
        messages = (
            split_n(route, request)
            if request.sampling_params.n > 1
            else disaggregated(route, request)
        )
    elif request.sampling_params.n > 1:
        messages = route.relay(pool.pick_any_of(LOCAL_ROLES, placement=placement), request)
    else:
        messages = local(route, request)
    if request.sampling_params.return_perf_metrics:  # the only requests that pay for a layer
        return _stamped(messages, route.arrival_time)
    return messages


async def _stamped(messages: AsyncIterator[types_pb2.RequestOutput], arrival_time: float):
    """messages with the router's arrival time in their perf metrics."""
    async with closing(messages) as messages:
        async for msg in messages:
            perf_metrics.stamp_arrival(msg, arrival_time)
            yield msg


async def local(
    route: Route, request: llm_pb2.GenerateRequest, roles: tuple[Role, ...] = LOCAL_ROLES
):
    """One sequence on one worker of roles (preferably an aggregated one); it moves to any worker
    that can run it whole if its worker dies."""
    worker = route.pool.pick_any_of(roles, placement=route.placement)
    progress = Progress([])
    # The start as the router saw it: the perf metrics of a stream a migration recomputed.
    wants_perf = request.sampling_params.return_perf_metrics
    sent_time, first_token_time = time.time() if wants_perf else 0.0, 0.0
    async with closing(
        failover.stream_with_migration(route, request, worker, LOCAL_ROLES, progress)
    ) as messages:
        async for msg in messages:
            if wants_perf:
                if not first_token_time and any(out.token_ids for out in msg.outputs):
                    first_token_time = time.time()
                if progress.is_recomputed:
                    perf_metrics.start_from_router(msg, sent_time, first_token_time)
            if msg.finished:
                msg.metrics.served_by[:] = route.served_by
            yield msg


async def disaggregated(route: Route, request: llm_pb2.GenerateRequest):
    """The client's messages for a request split over a prefill and a decode worker, or run whole
    on a decode worker when conditional disaggregation says so (pool.should_split)."""
    split, reason = route.pool.should_split(route.placement)
    route.metrics.disagg_decided(split, reason)
    if not split:
        async with closing(local(route, request, (Role.DECODE,) + LOCAL_ROLES)) as messages:
            async for msg in messages:
                yield msg
        return
    started = time.monotonic()
    ctx = llm_pb2.GenerateRequest()
    ctx.CopyFrom(request)
    ctx.streaming = False
    ctx.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_CONTEXT_ONLY
    ctx.disaggregated_params.disagg_request_id = random.getrandbits(63)
    ctx.disaggregated_params.finish_in_context = True
    context = await failover.context_with_retry(route, ctx)
    if context is None:  # no prefill worker is left: the whole request runs on one worker
        async with closing(local(route, request)) as messages:
            async for msg in messages:
                yield msg
        return
    prefill, ctx_out = context
    handoff = types_pb2.DisaggregatedParams()
    handoff.CopyFrom(ctx_out.outputs[0].disaggregated_params)
    handoff.ClearField(
        "first_gen_log_probs"
    )  # the first token's logprob stays in Progress.logprob_base
    ctx_out.ClearField("disaggregated_params")
    for out in ctx_out.outputs:  # router-internal; the caller did not ask for a split
        out.ClearField("disaggregated_params")
        if out.finish_reason == types_pb2.FINISH_REASON_NOT_FINISHED:
            out.finish_reason = types_pb2.FINISH_REASON_UNSPECIFIED
    if not handoff.opaque_state:  # finished in the context phase (max_tokens=1, EOS, cancelled)
        ctx_out.metrics.served_by[:] = route.served_by
        yield ctx_out
        return
    first_token_s = time.monotonic() - started
    prefill_metrics = types_pb2.RequestMetrics()
    prefill_metrics.CopyFrom(ctx_out.metrics)
    ctx_out.ClearField("metrics")  # metrics come once, on the last message
    wants_perf = request.sampling_params.return_perf_metrics
    prefill_perf = types_pb2.PerfMetrics()
    if wants_perf:
        prefill_perf.CopyFrom(ctx_out.outputs[0].perf_metrics)
        ctx_out.outputs[0].ClearField(
            "perf_metrics"
        )  # so do perf metrics: the decode's, combined with these

    def client_metrics(metrics: types_pb2.RequestMetrics) -> None:
        """The client's view: the whole request as the router saw it; the prompt was computed
        (or cached) on the prefill, the decode only pulled it."""
        metrics.served_by[:] = route.served_by
        metrics.time_to_first_token_s = first_token_s
        metrics.e2e_latency_s = time.monotonic() - started
        metrics.num_computed_prompt_tokens = prefill_metrics.num_computed_prompt_tokens
        metrics.num_cached_prompt_tokens = prefill_metrics.num_cached_prompt_tokens

    # The decode ends the lease of a handoff it was given on every way its phase ends normally
    # (decode/generation.py); the router ends it on the others (abort, stop, error, migration).
    decode_ended_lease = False
    try:
        ctx_out.finished = False
        if not route.cancelled:
            yield ctx_out  # the first token reaches the client before the KV moves
        if route.cancelled:  # aborted (or stopped by a stop string) before the decode phase
            last = cancelled_output(request.request_id)
            client_metrics(last.metrics)
            if wants_perf:  # the prefill's record is the whole of it
                last.outputs[0].perf_metrics.CopyFrom(prefill_perf)
            yield last
            return
        progress = Progress(
            list(ctx_out.prompt_token_ids),
            list(handoff.first_gen_tokens),
            ctx_out.outputs[0].cumulative_logprob,
        )
        decode = failover.pick_or_none(route, (Role.DECODE,), set())
        pulls = decode is not None
        if pulls:
            gen = llm_pb2.GenerateRequest()
            gen.CopyFrom(request)
            gen.prompt.token_ids.ids[:] = ctx_out.prompt_token_ids
            gen.disaggregated_params.CopyFrom(handoff)
            gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        else:  # no decode worker is left: another worker recomputes the prompt and carries on
            decode = route.pool.pick_any_of(LOCAL_ROLES, placement=route.placement)
            gen = failover.resume_request(request, progress.prompt_token_ids, progress.tokens)
        retried = False
        while True:
            try:
                async with closing(
                    failover.stream_with_migration(route, gen, decode, GENERATION_ROLES, progress)
                ) as messages:
                    async for msg in messages:
                        msg.ClearField("prompt")
                        del msg.prompt_token_ids[:]
                        if wants_perf:
                            for out in msg.outputs:
                                if out.HasField("perf_metrics"):
                                    perf_metrics.combine_split(prefill_perf, out.perf_metrics)
                        if msg.finished:
                            client_metrics(msg.metrics)
                            _count_handoff(route, prefill, decode, msg.metrics, progress, pulls)
                            decode_ended_lease = (
                                gen.disaggregated_params.opaque_state != b""
                                and not progress.num_migrations
                                and bool(msg.outputs)
                                and msg.outputs[0].finish_reason in _NORMAL_ENDS
                            )
                        yield msg
                return
            except grpc.aio.AioRpcError as exc:
                # A decode under --kv-load-failure-policy fail could not load the KV (and ended
                # its lease): the request goes once more to another prefill/decode pair.
                why = failure_reason(exc)
                if retried or not pulls or not why.startswith(KV_LOAD_FAILED + ":"):
                    raise
                route.metrics.kv_handoff_ended(
                    prefill.address, decode.address, "failed", why.partition(":")[2]
                )
                pair = await _another_pair(route, ctx, prefill, decode)
                if pair is None:
                    raise
                retried = True
                prefill, decode, handoff = pair  # the finally ends the new lease, if need be
                log.warning(
                    "request %s: decode could not load its KV (%s); retrying on prefill %s and "
                    "decode %s",
                    request.request_id,
                    why,
                    prefill.address,
                    decode.address,
                )
                if route.cancelled:
                    last = cancelled_output(request.request_id)
                    client_metrics(last.metrics)
                    yield last
                    return
                handoff.first_gen_tokens[:] = progress.tokens  # the tokens the client has
                handoff.ClearField("first_gen_log_probs")
                gen.disaggregated_params.CopyFrom(handoff)
                gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
    finally:
        if not decode_ended_lease:
            spawn(release_lease(route.pool, prefill, handoff.ctx_request_id))


async def _another_pair(route: Route, ctx: llm_pb2.GenerateRequest, prefill, decode):
    """(prefill, decode, handoff) for one more try of a split whose decode could not load its KV:
    another prefill runs the context phase again (the same one if it is the only one) and another
    decode (the same one if it is the only one) will pull it; None when neither has another."""
    other_prefill = failover.pick_or_none(route, (Role.PREFILL,), {prefill.address})
    other_decode = failover.pick_or_none(route, (Role.DECODE,), {decode.address})
    if other_prefill is None and other_decode is None:
        return None
    again = llm_pb2.GenerateRequest()
    again.CopyFrom(ctx)
    # An id of its own: the first context phase may still be closing on the same prefill.
    again.request_id = f"{ctx.request_id}#kv-retry"
    again.disaggregated_params.disagg_request_id = random.getrandbits(63)
    # Its first token is not the client's (the client has one already): it always hands off.
    again.disaggregated_params.finish_in_context = False
    tried = {prefill.address} if other_prefill is not None else set()
    context = await failover.context_with_retry(route, again, tried)
    if context is None:
        return None
    new_prefill, out = context
    handoff = types_pb2.DisaggregatedParams()
    if out.outputs:
        handoff.CopyFrom(out.outputs[0].disaggregated_params)
    if not handoff.opaque_state:
        return None
    return new_prefill, other_decode or decode, handoff


def _count_handoff(
    route: Route,
    prefill,
    decode,
    metrics: types_pb2.RequestMetrics,
    progress: Progress,
    pulls: bool,
) -> None:
    """The split's handoff outcome, per prefill->decode pair: as its decode reported it, or, where
    no decode used it, recomputed (the decode went away under the request: migrated; no decode
    worker was left to pull it: no_decode)."""
    if metrics.HasField("kv_handoff"):
        handoff = metrics.kv_handoff
        route.metrics.kv_handoff_ended(
            prefill.address, handoff.decode or decode.address, handoff.outcome, handoff.reason
        )
    elif progress.num_migrations or not pulls:
        reason = "migrated" if pulls else "no_decode"
        route.metrics.kv_handoff_ended(prefill.address, decode.address, "recomputed", reason)


async def split_n(route: Route, request: llm_pb2.GenerateRequest):
    """n > 1 over prefill/decode: n single-sequence splits (seed + i, as an aggregated worker
    seeds its n sequences), streamed together, outputs re-indexed, one final message."""
    check_several_returns(request.sampling_params)  # each split has n=1: refuse greedy n > 1 here
    n = request.sampling_params.n
    subs = []
    for i in range(n):
        sub = llm_pb2.GenerateRequest()
        sub.CopyFrom(request)
        sub.request_id = f"{request.request_id}/{i}"
        sub.sampling_params.n = 1
        if sub.sampling_params.HasField("seed"):
            sub.sampling_params.seed += i
        route.children.append(route.child(sub.request_id))
        subs.append(sub)
    first = True
    async with closing(
        merge([disaggregated(child, sub) for child, sub in zip(route.children, subs)])
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

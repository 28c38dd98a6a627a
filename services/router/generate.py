"""How the router runs one Generate: aggregated on one worker, or disaggregated
(context_only on a prefill worker, then generation_only on a decode worker)."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import grpc

from tandem.common.outputs import cancelled_output, merge_outputs
from tandem.router import failover
from tandem.router.workers import WorkerHandle, WorkerPool
from tandem.v1 import llm_pb2, types_pb2, worker_pb2

log = logging.getLogger("tandem.router.generate")


@dataclass
class Route:
    """Where a request is now; Abort follows it from the prefill to the decode worker."""
    worker: WorkerHandle
    cancelled: bool = False
    served_by: list[str] = field(default_factory=list)
    # The downstream Generate call in progress; Abort cancels it when the worker does not know
    # the request yet (its Generate is still on the way).
    call: grpc.aio.UnaryStreamCall | None = None
    # n > 1 on a split cluster: one child route per sequence.
    children: list["Route"] = field(default_factory=list)
    request_id: str = ""


async def abort(route: Route) -> None:
    """Stops a request wherever it is: the worker aborts it, or (not registered there yet) its call is cancelled."""
    route.cancelled = True
    for child in route.children:
        await abort(child)
    if route.worker is None:
        return
    try:
        reply = await route.worker.llm.Abort(llm_pb2.AbortRequest(request_id=route.request_id), timeout=5)
        aborted = reply.aborted
    except grpc.aio.AioRpcError:  # the worker is gone (a migration may be under way): cancel our side
        aborted = False
    if not aborted and route.call is not None:
        route.call.cancel()


class _Tracked:
    """Counts a worker's in-flight requests for the least-loaded pick."""

    def __init__(self, route: Route, worker: WorkerHandle):
        self.route, self.worker = route, worker

    def __enter__(self):
        self.route.worker = self.worker
        self.route.served_by.append(self.worker.address)
        self.worker.in_flight += 1
        return self.worker

    def __exit__(self, *exc):
        self.worker.in_flight -= 1


async def relay(worker: WorkerHandle, request: llm_pb2.GenerateRequest, route: Route):
    call = route.call = worker.llm.Generate(request)
    try:
        async for msg in call:
            yield msg
    except asyncio.CancelledError:
        if not route.cancelled:
            raise  # the client went away
        yield cancelled_output(request.request_id)  # Abort cancelled the call
    finally:
        call.cancel()
        route.call = None


async def _release_lease(pool: WorkerPool, prefill: WorkerHandle, ctx_request_id: int) -> None:
    """Best effort: the decode's NIXL notification normally released it already."""
    try:
        await prefill.internal.ReleaseKv(worker_pb2.ReleaseKvRequest(ctx_request_id=ctx_request_id), timeout=5,
                                         metadata=pool.admin_metadata)
    except grpc.aio.AioRpcError as exc:
        log.info("ReleaseKv(%d) on %s: %s (the lease expires anyway)", ctx_request_id, prefill.address, exc.code())


async def disaggregated(pool: WorkerPool, route: Route, request: llm_pb2.GenerateRequest):
    """Yields the client's messages for a request split over a prefill and a decode worker."""
    started = time.monotonic()
    ctx = llm_pb2.GenerateRequest()
    ctx.CopyFrom(request)
    ctx.streaming = False
    ctx.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_CONTEXT_ONLY
    ctx.disaggregated_params.disagg_request_id = random.getrandbits(63)
    prefill, ctx_out = await failover.context_with_retry(pool, route, ctx, _Tracked, relay)
    handoff = types_pb2.DisaggregatedParams()
    handoff.CopyFrom(ctx_out.outputs[0].disaggregated_params)
    for out in ctx_out.outputs:
        out.ClearField("disaggregated_params")  # router-internal; the caller did not ask for a split
    if not handoff.opaque_state:  # finished in the context phase (max_tokens=1, EOS, stop, cancelled)
        ctx_out.metrics.served_by[:] = route.served_by
        yield ctx_out
        return
    first_token_s = time.monotonic() - started
    prefill_metrics = types_pb2.RequestMetrics()
    prefill_metrics.CopyFrom(ctx_out.metrics)
    ctx_out.ClearField("metrics")  # metrics come once, on the last message
    try:
        if route.cancelled:
            yield cancelled_output(request.request_id)
            return
        ctx_out.finished = False
        yield ctx_out  # the first token reaches the client before the KV moves
        if route.cancelled:  # aborted while the first token was on its way
            yield cancelled_output(request.request_id)
            return
        gen = llm_pb2.GenerateRequest()
        gen.CopyFrom(request)
        gen.streaming = True
        gen.prompt.token_ids.ids[:] = ctx_out.prompt_token_ids
        gen.disaggregated_params.CopyFrom(handoff)
        gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        tokens_so_far = list(handoff.first_gen_tokens)
        async for msg in failover.stream_with_migration(pool, route, gen, pool.pick("decode"), "decode",
                                                        list(ctx_out.prompt_token_ids), tokens_so_far, _Tracked, relay,
                                                        logprob_base=ctx_out.outputs[0].cumulative_logprob):
            msg.ClearField("prompt")
            del msg.prompt_token_ids[:]
            if msg.finished:
                m = msg.metrics
                # The client's view: the whole request as the router saw it; the prompt was
                # computed (or cached) on the prefill, the decode only pulled it.
                m.served_by[:] = route.served_by
                m.time_to_first_token_s = first_token_s
                m.e2e_latency_s = time.monotonic() - started
                m.num_computed_prompt_tokens = prefill_metrics.num_computed_prompt_tokens
                m.num_cached_prompt_tokens = prefill_metrics.num_cached_prompt_tokens
            yield msg
    finally:
        asyncio.ensure_future(_release_lease(pool, prefill, handoff.ctx_request_id))


async def split_n(pool: WorkerPool, route: Route, request: llm_pb2.GenerateRequest):
    """n > 1 over prefill/decode: n single-sequence splits (seed + i, as an aggregated worker
    seeds its n sequences), streamed together, outputs re-indexed, one final message."""
    n = request.sampling_params.n
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def pump(index: int, sub: llm_pb2.GenerateRequest, child: Route) -> None:
        try:
            async for msg in disaggregated(pool, child, sub):
                await queue.put((index, msg))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, done_marker))

    tasks = []
    for i in range(n):
        sub = llm_pb2.GenerateRequest()
        sub.CopyFrom(request)
        sub.request_id = f"{request.request_id}/{i}"
        sub.sampling_params.n = 1
        if sub.sampling_params.HasField("seed"):
            sub.sampling_params.seed += i
        child = Route(worker=None, request_id=sub.request_id)
        route.children.append(child)
        tasks.append(asyncio.create_task(pump(i, sub, child)))
    try:
        num_done, first = 0, True
        while num_done < n:
            index, item = await queue.get()
            if item is done_marker:
                num_done += 1
                continue
            if isinstance(item, BaseException):
                raise item
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
    finally:
        for task in tasks:
            task.cancel()


async def run(pool: WorkerPool, route_table: dict[str, Route], request: llm_pb2.GenerateRequest):
    """The messages to send back for a Generate, streamed or merged into one."""
    phase = request.disaggregated_params.request_type
    if phase == types_pb2.REQUEST_TYPE_CONTEXT_ONLY:
        worker, split = pool.pick("prefill"), False
    elif phase == types_pb2.REQUEST_TYPE_GENERATION_ONLY:
        # A handoff needs a decode worker's transceiver; a resume without one runs anywhere.
        needs = ("decode",) if request.disaggregated_params.opaque_state else ("decode", "both")
        worker, split = pool.pick_any_of(needs), False
    elif pool.can_disaggregate:
        worker, split = None, True
    else:
        worker, split = pool.pick("both"), False
    route = Route(worker=worker, request_id=request.request_id)
    route_table[request.request_id] = route
    try:
        if split and request.sampling_params.n > 1:
            messages = split_n(pool, route, request)
        elif split:
            messages = disaggregated(pool, route, request)
        else:
            if request.sampling_params.n > 1 or phase != types_pb2.REQUEST_TYPE_CONTEXT_AND_GENERATION:
                async def direct():
                    with _Tracked(route, worker):
                        async for msg in relay(worker, request, route):
                            yield msg
                messages = direct()
            else:  # one sequence on one worker: it can move if the worker dies
                messages = failover.stream_with_migration(pool, route, request, worker, "both", [], [], _Tracked, relay)
        if request.streaming:
            async for msg in messages:
                yield msg
        else:
            yield merge_outputs([msg async for msg in messages])
    finally:
        route_table.pop(request.request_id, None)

"""How the router runs one Generate: aggregated on one worker, or disaggregated
(context_only on a prefill worker, then generation_only on a decode worker)."""
from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

import grpc

from tandem.common.outputs import merge_outputs
from tandem.router.workers import WorkerHandle, WorkerPool
from tandem.v1 import llm_pb2, types_pb2, worker_pb2

log = logging.getLogger("tandem.router.generate")


@dataclass
class Route:
    """Where a request is now; Abort follows it from the prefill to the decode worker."""
    worker: WorkerHandle
    cancelled: bool = False
    served_by: list[str] = field(default_factory=list)


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


async def relay(worker: WorkerHandle, request: llm_pb2.GenerateRequest):
    call = worker.llm.Generate(request)
    try:
        async for msg in call:
            yield msg
    finally:
        call.cancel()


def _cancelled_output(request_id: str) -> types_pb2.RequestOutput:
    out = types_pb2.RequestOutput(request_id=request_id, finished=True)
    out.outputs.add(index=0, finish_reason=types_pb2.FINISH_REASON_CANCELLED)
    return out


async def _release_lease(pool: WorkerPool, prefill: WorkerHandle, ctx_request_id: int) -> None:
    """Best effort: the decode's NIXL notification normally released it already."""
    try:
        await prefill.internal.ReleaseKv(worker_pb2.ReleaseKvRequest(ctx_request_id=ctx_request_id), timeout=5,
                                         metadata=pool.admin_metadata)
    except grpc.aio.AioRpcError as exc:
        log.info("ReleaseKv(%d) on %s: %s (the lease expires anyway)", ctx_request_id, prefill.address, exc.code())


async def disaggregated(pool: WorkerPool, route: Route, request: llm_pb2.GenerateRequest):
    """Yields the client's messages for a request split over a prefill and a decode worker."""
    ctx = llm_pb2.GenerateRequest()
    ctx.CopyFrom(request)
    ctx.streaming = False
    ctx.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_CONTEXT_ONLY
    ctx.disaggregated_params.disagg_request_id = random.getrandbits(63)
    prefill = pool.pick("prefill")
    with _Tracked(route, prefill):
        ctx_out = None
        async for ctx_out in relay(prefill, ctx):
            pass
    handoff = types_pb2.DisaggregatedParams()
    handoff.CopyFrom(ctx_out.outputs[0].disaggregated_params)
    for out in ctx_out.outputs:
        out.ClearField("disaggregated_params")  # router-internal; the caller did not ask for a split
    if not handoff.opaque_state:  # finished in the context phase (max_tokens=1, EOS, stop, cancelled)
        ctx_out.metrics.served_by[:] = route.served_by
        yield ctx_out
        return
    prefill_metrics = types_pb2.RequestMetrics()
    prefill_metrics.CopyFrom(ctx_out.metrics)
    ctx_out.ClearField("metrics")  # metrics come once, on the last message
    try:
        if route.cancelled:
            yield _cancelled_output(request.request_id)
            return
        ctx_out.finished = False
        yield ctx_out  # the first token reaches the client before the KV moves
        gen = llm_pb2.GenerateRequest()
        gen.CopyFrom(request)
        gen.streaming = True
        gen.prompt.token_ids.ids[:] = ctx_out.prompt_token_ids
        gen.disaggregated_params.CopyFrom(handoff)
        gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        decode = pool.pick("decode")
        with _Tracked(route, decode):
            async for msg in relay(decode, gen):
                msg.ClearField("prompt")
                del msg.prompt_token_ids[:]
                if msg.finished:
                    m = msg.metrics
                    m.served_by[:] = route.served_by
                    m.time_to_first_token_s = prefill_metrics.time_to_first_token_s
                    m.num_computed_prompt_tokens = prefill_metrics.num_computed_prompt_tokens
                yield msg
    finally:
        asyncio.ensure_future(_release_lease(pool, prefill, handoff.ctx_request_id))


async def run(pool: WorkerPool, route_table: dict[str, Route], request: llm_pb2.GenerateRequest):
    """The messages to send back for a Generate, streamed or merged into one."""
    phase = request.disaggregated_params.request_type
    if phase == types_pb2.REQUEST_TYPE_CONTEXT_ONLY:
        worker, split = pool.pick("prefill"), False
    elif phase == types_pb2.REQUEST_TYPE_GENERATION_ONLY:
        worker, split = pool.pick("decode"), False
    elif pool.can_disaggregate:
        worker, split = None, True
    else:
        worker, split = pool.pick("both"), False
    route = Route(worker=worker)
    route_table[request.request_id] = route
    try:
        if split:
            messages = disaggregated(pool, route, request)
        else:
            async def direct():
                with _Tracked(route, worker):
                    async for msg in relay(worker, request):
                        yield msg
            messages = direct()
        if request.streaming or not split:
            async for msg in messages:
                yield msg
        else:
            yield merge_outputs([msg async for msg in messages])
    finally:
        route_table.pop(request.request_id, None)

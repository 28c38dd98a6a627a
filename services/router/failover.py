"""What the router does when a worker dies under a request.

A prefill that fails before anything was streamed is retried on another prefill.
A worker that dies mid-stream is replaced: the request continues on another
worker as generation_only with every token streamed so far as its
first_gen_tokens and no KV (the new worker recomputes it), so the client sees one
continuous stream, no token lost or repeated; sampling continues exactly because
a seeded request's randomness depends only on (seed, token index).
"""
from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2

from tandem.common.outputs import cancelled_output
from tandem.router.workers import WorkerHandle, WorkerPool
from tandem.v1 import llm_pb2, types_pb2

log = logging.getLogger("tandem.router.failover")

MAX_MIGRATIONS = 2


async def worker_gone(worker: WorkerHandle, exc: BaseException) -> bool:
    """A dead worker's calls fail UNAVAILABLE, but so do a live one's refusals (paused,
    released): only a worker that no longer answers its health check is gone."""
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    try:
        reply = await worker.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.aio.AioRpcError:
        return True
    return reply.status != health_pb2.HealthCheckResponse.SERVING


async def context_with_retry(pool: WorkerPool, route, ctx: llm_pb2.GenerateRequest, tracked, relay):
    """Runs the context phase; a prefill that dies is replaced while others remain."""
    tried: set[str] = set()
    while True:
        prefill = pool.pick("prefill", exclude=tried)
        try:
            out = None
            with tracked(route, prefill):
                async for out in relay(prefill, ctx, route):
                    pass
            return prefill, out
        except grpc.aio.AioRpcError as exc:
            if not await worker_gone(prefill, exc):
                raise
            log.warning("prefill %s failed (%s); retrying %s elsewhere", prefill.address, exc.code().name, ctx.request_id)
            pool.mark_down(prefill)
            tried.add(prefill.address)


def resume_request(request: llm_pb2.GenerateRequest, prompt_token_ids, tokens_so_far: list[int]) -> llm_pb2.GenerateRequest:
    """generation_only without a handoff: the worker recomputes the KV of prompt + tokens_so_far."""
    resumed = llm_pb2.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.streaming = True
    resumed.prompt.token_ids.ids[:] = prompt_token_ids
    resumed.ClearField("disaggregated_params")
    resumed.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
    resumed.disaggregated_params.first_gen_tokens[:] = tokens_so_far
    return resumed


async def stream_with_migration(pool: WorkerPool, route, request: llm_pb2.GenerateRequest, first_worker: WorkerHandle,
                                need: str, prompt_token_ids, tokens_so_far: list[int], tracked, relay,
                                logprob_base: float = 0.0):
    """Relays a single-sequence stream; if its worker dies, continues it on another one.
    logprob_base: the cumulative logprob of tokens_so_far, which the worker did not sample."""
    worker, current, tried = first_worker, request, set()
    base = last_cumulative = logprob_base
    for attempt in range(MAX_MIGRATIONS + 1):
        try:
            with tracked(route, worker):
                async for msg in relay(worker, current, route):
                    for out in msg.outputs:
                        tokens_so_far.extend(out.token_ids)
                        out.cumulative_logprob += base
                        last_cumulative = out.cumulative_logprob
                    if not prompt_token_ids and msg.prompt_token_ids:
                        prompt_token_ids = list(msg.prompt_token_ids)
                    yield msg
            return
        except grpc.aio.AioRpcError as exc:
            if attempt == MAX_MIGRATIONS or not await worker_gone(worker, exc):
                raise
            if route.cancelled:  # aborted while its worker died: nothing to carry on
                yield cancelled_output(request.request_id)
                return
            log.warning("worker %s died under %s after %d tokens; migrating", worker.address, request.request_id,
                        len(tokens_so_far))
            pool.mark_down(worker)
            tried.add(worker.address)
            # Nothing came back yet (not even the prompt's tokens): send the request again as it was.
            current = resume_request(request, prompt_token_ids, tokens_so_far) if prompt_token_ids else request
            base = last_cumulative if prompt_token_ids else logprob_base
            worker = pool.pick_any_of((need, "both"), exclude=tried)

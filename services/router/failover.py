"""What the router does when a worker dies or hangs under a request.

A prefill that fails before anything was streamed is retried on another prefill, and with no
prefill left the whole request runs on one worker (a decode worker computes the prompt too).
A worker that dies mid-stream, or stops producing and does not answer a probe (route.py), is
replaced: the request continues on another worker as generation_only with every token
streamed so far as its first_gen_tokens and no KV (the new worker recomputes it), so the
client sees one continuous stream, no token lost or repeated; sampling continues exactly
because a seeded request's randomness depends only on (seed, token index).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from tandem.common.background import spawn
from tandem.common.errors import RpcError, failure_reason
from tandem.common.outputs import cancelled_output, merge_outputs
from tandem.common.roles import Role
from tandem.common.streams import closing
from tandem.router.inbox import SessionBroken
from tandem.router.route import Route, WorkerStalledError, release_lease
from tandem.router.workers import WorkerHandle
from tandem.v1 import llm_pb2, types_pb2

log = logging.getLogger("tandem.router.failover")

MAX_MIGRATIONS = 2


async def worker_gone(worker: WorkerHandle, exc: BaseException, timeout_s: float = 1.0) -> bool:
    """A dead worker's calls fail UNAVAILABLE, but so do a live one's refusals (paused,
    released): only a worker that no longer answers its health check is gone (or one whose
    stream stalled while it did not answer, or whose session with the router ended under the
    request: the request stopped there)."""
    if isinstance(
        exc, (WorkerStalledError, SessionBroken)
    ):  # gone for the request, whatever its health
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


def _code(exc: BaseException) -> str:
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__


def pick_or_none(route: Route, roles: tuple[Role, ...], exclude: set[str]) -> WorkerHandle | None:
    try:
        return route.pool.pick_any_of(roles, exclude, placement=route.placement)
    except RpcError:
        return None


async def context_with_retry(
    route: Route, ctx: llm_pb2.GenerateRequest, tried: set[str] | None = None
) -> tuple[WorkerHandle, llm_pb2.RequestOutput] | None:
    """Runs the context phase; a prefill that dies or hangs is replaced while others remain.
    Returns the prefill and its reply (one message), or None when no prefill is left to
    run it (the caller runs the request on one worker instead). tried: prefills not to use."""
    tried = set(tried or ())
    while True:
        prefill = pick_or_none(route, (Role.PREFILL,), tried)
        if prefill is None:
            return None
        out = None
        try:
            async with closing(route.relay(prefill, ctx, split=True)) as replies:
                async for reply in replies:
                    # Its one message, or the messages its steps came in (what the relay took at
                    # once folds into one), merged.
                    out = reply if out is None else merge_outputs([out, reply])
            if route.cancelled and not _hands_off(out):
                _release_lost_handoff(route, prefill, ctx)
            return prefill, out
        except (grpc.aio.AioRpcError, WorkerStalledError) as exc:
            if not await worker_gone(prefill, exc, route.pool.health_timeout_s):
                _release_lost_handoff(
                    route, prefill, ctx
                )  # the reply may have come on its own after all
                raise
            log.warning(
                "prefill %s failed (%s); retrying %s elsewhere",
                prefill.address,
                _code(exc),
                ctx.request_id,
            )
            route.pool.mark_down(prefill)
            tried.add(prefill.address)
            route.metrics.prefill_retried()
        except BaseException:
            # Cancelled after the reply came: the handoff it carries is nobody else's to release.
            if _hands_off(out):
                lease_id = out.outputs[0].disaggregated_params.ctx_request_id
                spawn(release_lease(route.pool, prefill, lease_id))
            else:
                _release_lost_handoff(route, prefill, ctx)
            raise


def _hands_off(out: types_pb2.RequestOutput | None) -> bool:
    return (
        out is not None
        and bool(out.outputs)
        and bool(out.outputs[0].disaggregated_params.opaque_state)
    )


def _release_lost_handoff(
    route: Route, prefill: WorkerHandle, ctx: llm_pb2.GenerateRequest
) -> None:
    """The context call was cancelled before its reply was read: the prefill may have finished
    and sent a handoff that nobody will present. Its lease goes by the split's disagg_request_id
    (the request is aborted there if it still runs); without this it would wait for its expiry."""
    spawn(release_lease(route.pool, prefill, 0, ctx.disaggregated_params.disagg_request_id))


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


@dataclass
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


async def stream_with_migration(
    route: Route,
    request: llm_pb2.GenerateRequest,
    worker: WorkerHandle,
    roles: tuple[Role, ...],
    progress: Progress,
):
    """Relays a single-sequence stream; if its worker dies or hangs, continues it on another
    one of roles."""
    current, tried = request, set()
    last_cumulative = progress.logprob_base
    for attempt in range(MAX_MIGRATIONS + 1):
        try:
            # The worker sends what it generates, not the first_gen_tokens this stream already has.
            async with closing(route.relay(worker, current)) as messages:
                async for msg in messages:
                    for out in msg.outputs:
                        progress.tokens.extend(out.token_ids)
                        out.cumulative_logprob += progress.logprob_base
                        last_cumulative = out.cumulative_logprob
                    if not progress.prompt_token_ids and msg.prompt_token_ids:
                        progress.prompt_token_ids = list(msg.prompt_token_ids)
                    yield msg
            return
        except (grpc.aio.AioRpcError, WorkerStalledError) as exc:
            if attempt == MAX_MIGRATIONS or not await worker_gone(
                worker, exc, route.pool.health_timeout_s
            ):
                raise
            if route.cancelled:  # aborted while its worker died: nothing to carry on
                yield cancelled_output(request.request_id)
                return
            log.warning(
                "worker %s failed under %s (%s) after %d tokens; migrating",
                worker.address,
                request.request_id,
                _code(exc),
                len(progress.tokens),
            )
            route.pool.mark_down(worker)
            tried.add(worker.address)
            route.metrics.migrated()
            progress.num_migrations += 1
            if progress.prompt_token_ids:
                current = resume_request(request, progress.prompt_token_ids, progress.tokens)
                progress.logprob_base = last_cumulative
                progress.is_recomputed = progress.is_recomputed or bool(progress.tokens)
            # else nothing came back yet (not even the prompt's tokens): send the request again as it was
            worker = pick_or_none(route, roles, tried)
            if worker is None:
                raise exc

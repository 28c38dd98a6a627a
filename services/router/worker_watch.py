"""How the router follows one worker: its health by grpc.health.v1 Watch (a change reaches the
router at once) with Check polls beside it (a worker whose loop hangs keeps its Watch stream
open and says nothing: only a poll with a timeout finds it; and a worker without Watch is
polled alone), its state (role, adapters, free blocks) by GetWorkerState polls, and its prefix
cache by the SubscribeKvBlocks feed into the router's KV index.

Each worker process has an instance id (common/health.py): a state poll records it with the
role, and the health answers carry it, so the router tells the process it knows from another
one that took the address over (a restart, a hot swap) before it trusts what it knew."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2

from tandem.common.health import instance_id_of
from tandem.common.roles import Role
from tandem.v1 import worker_pb2

if TYPE_CHECKING:
    from tandem.router.workers import WorkerHandle, WorkerPool

log = logging.getLogger("tandem.router.worker_watch")

SERVING = health_pb2.HealthCheckResponse.SERVING
# A Watch stream that lived shorter than this is reopened only after min(this, the health
# interval) (a proxy that cuts every stream at once must not make the router spin).
WATCH_REOPEN_MIN_S = 1.0


async def poll_forever(pool: WorkerPool, w: WorkerHandle) -> None:
    while True:
        w.poll_now.clear()
        await poll(pool, w)
        pool.notify()
        try:
            await asyncio.wait_for(w.poll_now.wait(), pool.health_interval_s)
        except asyncio.TimeoutError:
            pass


async def poll(pool: WorkerPool, w: WorkerHandle) -> None:
    checked_instance = ""
    try:
        call = w.health.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=pool.health_timeout_s
        )
        resp = await call
        checked_instance = instance_id_of(await call.initial_metadata())
        ready = resp.status == SERVING
    except grpc.aio.AioRpcError as exc:
        ready = False
        refused = exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        if refused and not w.refused:
            log.error(
                "worker %s refuses the router (%s: %s): give the router the cluster's --cluster-token",
                w.address,
                exc.code().name,
                exc.details(),
            )
        w.refused = refused
    if ready:
        w.open_state_poll()  # the report's window opens
        try:
            state = await w.internal.GetWorkerState(worker_pb2.WorkerStateRequest(), timeout=5.0)
            if state.instance_id != w.instance_id:
                pool.meet_new_process(w, state.instance_id)
            w.role = Role(state.role)
            w.lora_adapters = list(state.lora_adapters)
            w.num_free_blocks = state.num_free_blocks if state.num_total_blocks else None
            w.kv_layout_hash = state.kv_layout_hash
            w.leases_prefixes = state.leases_prefixes
            w.kv_block_bytes = (
                state.kv_cache_bytes // state.num_total_blocks if state.num_total_blocks else 0
            )
            # The report counts this router's own queued work too (it is counted fresh here):
            # what is left over is the other routers'. Taken off at its peak over the poll: work
            # of ours the report counted that finished before the reply came would otherwise
            # hold the worker as loaded by others until the next poll (a phantom that sent a
            # shared prefix's next users to a worker without its KV).
            w.read_state_report(state.num_queued_prompt_tokens)
        except grpc.aio.AioRpcError:
            # The state waits for the engine thread between steps; a slow step leaves the last
            # adapters in place. A worker whose role is still unknown cannot be picked yet, nor
            # another process than the one the last state poll saw (its Check says so): its role
            # is not known either.
            ready = w.role is not Role.UNKNOWN and checked_instance == w.instance_id
    set_ready(pool, w, ready)


def set_ready(pool: WorkerPool, w: WorkerHandle, ready: bool) -> None:
    if ready != w.ready:
        log.info(
            "worker %s (%s) is %s",
            w.address,
            w.role.label or "?",
            "ready" if ready else "not ready",
        )
        w.ready = ready
        pool.notify()


async def watch_health(pool: WorkerPool, w: WorkerHandle) -> None:
    """Follows the worker's Watch stream: NOT_SERVING stops picks at once, SERVING makes the
    state poll run now (it sets ready). The stream's end stops picks too: a worker that dies (or
    restarts) ends it at once, long before the next poll would fail, and a request sent there
    meanwhile would pay a failed call and a health check before it goes elsewhere. Then the Watch
    is opened again at once: a live worker whose stream was cut on the way (a proxy's idle
    timeout, a GOAWAY at max connection age) answers it with SERVING in one round trip and is
    picked again then, without waiting for a state poll that waits on its engine. Only that
    first reply of a stream reopened at once is trusted so, and only when its metadata names the
    process the last state poll saw: a dead worker refuses the reopen, and a new process on the
    address (a restart, maybe in another role) says NOT_SERVING first while it loads, is reached
    only after a wait, or, already serving there the instant the old one's stream ends (a hot
    swap over SO_REUSEPORT), names another instance; it is ready once a poll has looked at it.
    A worker without Watch is left to the polls."""
    loop = asyncio.get_running_loop()
    is_reopen = (
        False  # the last stream answered, lived >= WATCH_REOPEN_MIN_S and ended: reopened at once
    )
    while True:
        opened_at = loop.time()
        answered = False
        call = w.health.Watch(health_pb2.HealthCheckRequest(service=""))
        try:
            async for reply in call:
                answered = True
                if reply.status == SERVING:
                    if is_reopen and w.role is not Role.UNKNOWN and not w.refused:
                        # ('' == '': a worker that names no instance, an older one, is trusted as before.)
                        instance_id = instance_id_of(await call.initial_metadata())
                        if instance_id == w.instance_id:
                            set_ready(pool, w, True)
                        else:
                            log.info(
                                "worker %s answers as another process (instance %s, was %s): "
                                "ready once a state poll has looked at it",
                                w.address,
                                instance_id or "?",
                                w.instance_id or "?",
                            )
                    w.poll_now.set()
                else:
                    set_ready(pool, w, False)
                # Only a reopened stream's first reply stands for the process the last poll saw: a
                # new process on the address (a restart) says NOT_SERVING first, while it loads.
                is_reopen = False
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info(
                    "worker %s has no health Watch; polling it every %.1f s",
                    w.address,
                    pool.health_interval_s,
                )
                return
        finally:
            call.cancel()
        set_ready(pool, w, False)
        w.poll_now.set()
        # Trusted only when reopened at once: after a wait another process may be serving there.
        is_reopen = answered and loop.time() - opened_at >= WATCH_REOPEN_MIN_S
        if not answered:  # not open at all (down, refusing): the polls and the next try find it
            await asyncio.sleep(pool.health_interval_s)
        elif not is_reopen:  # cut again and again at once: do not spin
            await asyncio.sleep(min(pool.health_interval_s, WATCH_REOPEN_MIN_S))


async def follow_kv_blocks(pool: WorkerPool, w: WorkerHandle) -> None:
    """Feeds the worker's prefix cache into the KV index while it is ready; each (re)subscription
    starts with a snapshot that replaces what the index knew of it."""
    index = pool.kv_index
    while True:
        while not w.ready or w.role is Role.UNKNOWN:
            await pool.changed.wait()
        call = w.internal.SubscribeKvBlocks(worker_pb2.SubscribeKvBlocksRequest())
        try:
            async for update in call:
                index.apply(w.address, update)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
                log.warning(
                    "worker %s has no KV block feed: KV-aware routing sees no cache there",
                    w.address,
                )
                return
            log.info("KV block feed of %s ended (%s); resubscribing", w.address, exc.code().name)
        finally:
            call.cancel()
            index.forget(w.address)
        await asyncio.sleep(pool.health_interval_s)

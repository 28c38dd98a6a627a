"""One client request as the router carries it: the worker it runs on now (Abort follows it from
the prefill to the decode worker, and to the worker a migration moves it to), the workers it
went through, and the calls that stop it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from tandem.common.errors import RpcError
from tandem.common.logs import bind
from tandem.common.outputs import cancelled_output
from tandem.router.inbox import message_of
from tandem.router.metrics import RouterMetrics
from tandem.router.policies import Placement
from tandem.router.workers import WorkerHandle, WorkerPool
from tandem.v1 import llm_pb2, types_pb2, worker_pb2

# How long a request waits for its worker's session to open (once per worker, and again after
# it broke) before it fails UNAVAILABLE: a dead worker refuses at once, a hung one is waited for.
SESSION_OPEN_TIMEOUT_S = 5.0

log = logging.getLogger("tandem.router.route")


class WorkerStalledError(RpcError):
    """A stream's worker stopped producing and did not answer its probe: it is hung
    (UNAVAILABLE, when no other worker can carry the request on)."""

    def __init__(self, worker: WorkerHandle):
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"worker {worker.address} stopped producing and does not answer",
        )
        self.worker = worker


class Route:
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
        self._last_message_at = 0.0
        # Cuts the relay in progress here (cancels its call, or its request on the session); Abort
        # uses it when the worker does not know the request yet (it is still on the way).
        self.cut: Callable[[], None] | None = None
        # Ended by the client (Abort) or by a stop string: whatever comes next is not streamed on.
        self.cancelled = False
        self.served_by: list[str] = []
        # n > 1 over a prefill/decode split: one child route per sequence.
        self.children: list[Route] = []

    def child(self, request_id: str) -> Route:
        return Route(
            self.pool,
            request_id,
            self.metrics,
            self.client,
            self.progress_timeout_s,
            dataclasses.replace(self.placement, overlap={}),
            self.deadline,
            self.arrival_time,
        )

    async def relay(
        self,
        worker: WorkerHandle,
        request: llm_pb2.GenerateRequest,
        split: bool = False,
        return_first_gen_tokens: bool = False,
    ):
        """The worker's messages for request, read from its inbox on the worker's session, and
        counted in the worker's in-flight load while they flow. split: the context_only half of a
        request the router splits itself; return_first_gen_tokens: a client's own generation_only
        request, whose output starts with the tokens it carries. Raises the worker's error status,
        and WorkerStalledError when the worker hangs under the stream. One generator: a token
        passes no other layer between the session's reader and the caller."""
        self.worker = worker
        self.served_by.append(worker.address)
        bind(route=" -> ".join(self.served_by))
        # The load this puts on the worker, as the pick policies weigh it: the prompt tokens it
        # computes (until its first message) and the prompt's blocks (while the stream runs).
        block_size = self.pool.kv_index.block_size
        pulls = request.disaggregated_params.opaque_state != b""
        prefill_tokens = 0 if pulls else self.placement.uncached_tokens(worker.address, block_size)
        # What the worker's state report counts of it until its first message: the whole prompt.
        prompt_tokens = 0 if pulls else len(self.placement.token_ids)
        blocks = self.placement.num_blocks(block_size)
        worker.in_flight += 1
        worker.queue_prefill(prefill_tokens, prompt_tokens)
        worker.active_blocks += blocks
        try:
            session, tag, inbox = await worker.session.attach(
                max(self.pool.health_timeout_s, SESSION_OPEN_TIMEOUT_S)
            )
            if self.cancelled:  # aborted while the session opened: nothing was sent
                session.detach(tag)
                yield cancelled_output(request.request_id)
                return
            try:
                session.submit(
                    tag, request, self.client, split, self.deadline, return_first_gen_tokens
                )
            except BaseException:
                session.detach(tag)
                raise
            self.cut = lambda: session.cut(tag, inbox)
            self._last_message_at = time.monotonic()
            watchdog = asyncio.create_task(self._watch(worker))
            # The worker ended the request (its last message, or an error status): nothing to
            # stop there.
            ended = False
            try:
                while True:
                    for item in await inbox.take():
                        msg = message_of(item)
                        if msg is None:  # the worker's end of the request
                            return
                        self._last_message_at = time.monotonic()
                        if prefill_tokens or prompt_tokens:
                            worker.queue_prefill(-prefill_tokens, -prompt_tokens)
                            prefill_tokens = prompt_tokens = 0
                        ended = msg.finished
                        yield msg
            except grpc.aio.AioRpcError:
                ended = True
                raise
            except asyncio.CancelledError:
                if watchdog.done() and not watchdog.cancelled() and watchdog.result():
                    raise WorkerStalledError(worker) from None
                if not self.cancelled:
                    raise  # the client went away
                yield cancelled_output(request.request_id)  # Abort cut the relay
            finally:
                watchdog.cancel()
                if not ended:
                    # A request whose last message came is left to end by itself: cancelling it
                    # could reach the worker before it knew the message (a handoff) was delivered.
                    self.cut()
                else:
                    session.detach(tag)
                self.cut = None
        finally:
            worker.in_flight -= 1
            worker.queue_prefill(-prefill_tokens, -prompt_tokens)
            worker.active_blocks -= blocks

    async def _watch(self, worker: WorkerHandle) -> bool:
        """Cuts the relay (and returns True) once its worker has been quiet for the progress
        timeout and does not answer a probe; a busy worker that answers gets another period."""
        while True:
            quiet = time.monotonic() - self._last_message_at
            if quiet < self.progress_timeout_s:
                await asyncio.sleep(self.progress_timeout_s - quiet)
                continue
            if await self.pool.is_responsive(worker, self.progress_timeout_s):
                self._last_message_at = time.monotonic()
                continue
            log.warning(
                "worker %s stopped producing for %s (%.1f s) and does not answer; moving the request on",
                worker.address,
                self.request_id,
                time.monotonic() - self._last_message_at,
            )
            self.pool.mark_down(worker)
            self.cut()
            return True

    async def abort(self) -> None:
        """Stops the request wherever it is: the worker aborts it, or (not registered there yet) its relay is cut."""
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
        except (
            grpc.aio.AioRpcError
        ):  # the worker is gone (a migration may be under way): cancel our side
            aborted = False
        if not aborted and self.cut is not None:
            self.cut()

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
        if (
            not reply.found
        ):  # between workers (the context phase is over), or done: end the route here
            await self.abort()


async def release_lease(
    pool: WorkerPool, prefill: WorkerHandle, ctx_request_id: int, disagg_request_id: int = 0
) -> None:
    """Best effort, for a split whose decode phase did not end the lease (aborted, stopped, failed,
    migrated, or never started). disagg_request_id instead of ctx_request_id: the lease of the
    router's own split of that id (its reply was lost)."""
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

"""One request on one worker's session, as its relay (relay.py) reads it: the submit, the
request's inbox (inbox.py), the load it puts on the worker while it runs (as the pick policies
weigh it) and the watchdog that cuts it when the worker hangs."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from tandem.common.errors import KV_LOAD_FAILED, RpcError, failure_reason
from tandem.common.outputs import cancelled_output
from tandem.router.inbox import CUT, Inbox, message_of
from tandem.router.session_client import OpenSession
from tandem.router.workers import WorkerHandle
from tandem.v1 import llm_pb2, types_pb2

if TYPE_CHECKING:
    from tandem.router.relay import Relay

log = logging.getLogger("tandem.router.legs")

# How long a request waits for its worker's session to open (once per worker, and again after
# it broke) before it fails UNAVAILABLE: a dead worker refuses at once, a hung one is waited for.
SESSION_OPEN_TIMEOUT_S = 5.0


class WorkerStalledError(RpcError):
    """A stream's worker stopped producing and did not answer its probe: it is hung
    (UNAVAILABLE, when no other worker can carry the request on)."""

    def __init__(self, worker: WorkerHandle):
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"worker {worker.address} stopped producing and does not answer",
        )
        self.worker = worker


def _prefix_source(relay: Relay, worker: WorkerHandle, request: llm_pb2.GenerateRequest):
    """The peer the router's cost model picked to pull the prompt's prefix from (prefix_source.py),
    for a leg that computes the prompt from its start; None for any other leg."""
    if request.disaggregated_params.request_type not in PROMPT_TYPES:
        return None
    return relay.placement.prefix_source_for(worker.address)


# The request types whose worker computes the prompt from its start.
PROMPT_TYPES = (
    types_pb2.REQUEST_TYPE_CONTEXT_AND_GENERATION,
    types_pb2.REQUEST_TYPE_CONTEXT_ONLY,
)


class Leg:
    """One request on one worker's session: its inbox, the load it puts on the worker while it
    runs (as the pick policies weigh it), and the watchdog that cuts it when the worker hangs."""

    __slots__ = (
        "relay",
        "worker",
        "request_id",
        "session",
        "tag",
        "inbox",
        "watchdog",
        "ended",
        "last_message_at",
        "_items",
        "_is_over",
        "_prefill_tokens",
        "_prompt_tokens",
        "_blocks",
        "announced",
    )

    def __init__(
        self,
        relay: Relay,
        worker: WorkerHandle,
        request: llm_pb2.GenerateRequest,
        announced: bool = False,
    ):
        self.relay = relay
        self.worker = worker
        self.request_id = request.request_id
        self.session: OpenSession | None = None
        self.tag = 0
        self.inbox: Inbox | None = None
        self.watchdog: asyncio.Task | None = None
        # The worker ended the request (its last message, or an error status): nothing to stop there.
        self.ended = False
        self.last_message_at = 0.0
        self._items: list = []
        self._is_over = False
        # Sent with awaits_handoff, its handoff not yet (hand_off): not the relay's current leg.
        self.announced = announced
        # The prompt tokens the worker computes (until its first message), what its state report
        # counts of them (the whole prompt), and the prompt's blocks (while the leg runs).
        block_size = relay.pool.kv_index.block_size
        pulls = announced or request.disaggregated_params.opaque_state != b""
        placement = relay.placement
        self._prefill_tokens = 0 if pulls else placement.uncached_tokens(worker.address, block_size)
        self._prompt_tokens = 0 if pulls else len(placement.token_ids)
        self._blocks = placement.num_blocks(block_size)
        worker.in_flight += 1
        worker.queue_prefill(self._prefill_tokens, self._prompt_tokens)
        worker.active_blocks += self._blocks

    @classmethod
    async def open(
        cls,
        relay: Relay,
        worker: WorkerHandle,
        request: llm_pb2.GenerateRequest,
        split: bool,
        return_first_gen_tokens: bool,
        hand_off_to: str = "",
    ) -> Leg:
        """Sends request to worker on its session (opened within SESSION_OPEN_TIMEOUT_S, or the
        health timeout when longer): the leg to read it from. A request aborted while the
        session opened is not sent: its leg says cancelled. hand_off_to: a context phase's
        announced decode (SessionSubmit.hand_off_to)."""
        leg = cls(relay, worker, request)
        try:
            session, tag, inbox = await worker.session.attach(
                max(relay.pool.health_timeout_s, SESSION_OPEN_TIMEOUT_S)
            )
            if relay.cancelled:
                session.detach(tag)
                return leg
            try:
                session.submit(
                    tag,
                    request,
                    relay.client,
                    split,
                    relay.deadline,
                    return_first_gen_tokens,
                    _prefix_source(relay, worker, request),
                    hand_off_to=hand_off_to,
                )
            except BaseException:
                session.detach(tag)
                raise
        except BaseException:
            leg.unload()
            raise
        leg.start(session, tag, inbox)
        return leg

    @classmethod
    def announce(cls, relay: Relay, worker: WorkerHandle, request: llm_pb2.GenerateRequest):
        """A split's generation_only request sent to worker now, awaiting its handoff (hand_off):
        the leg, or None when the worker's session is not open, is full or takes no announced
        requests (nothing waits here: the context phase goes ahead either way)."""
        attached = worker.session.try_attach(
            max(relay.pool.health_timeout_s, SESSION_OPEN_TIMEOUT_S)
        )
        if attached is None:
            return None
        session, tag, inbox = attached
        leg = cls(relay, worker, request, announced=True)
        try:
            session.submit(tag, request, relay.client, False, relay.deadline, awaits_handoff=True)
        except BaseException:
            session.detach(tag)
            leg.unload()
            raise
        leg.start(session, tag, inbox)
        return leg

    def start(self, session: OpenSession, tag: int, inbox: Inbox) -> None:
        """Reads the request's inbox from now on; an announced leg is watched (and becomes the
        relay's current one) from its handoff on: until then its worker has nothing to send."""
        self.session, self.tag, self.inbox = session, tag, inbox
        if not self.announced:
            self._watch_from_now()

    def _watch_from_now(self) -> None:
        self.last_message_at = time.monotonic()
        self.watchdog = asyncio.create_task(self._watch())
        self.relay.leg = self

    @property
    def is_waiting(self) -> bool:
        """Announced, sent, and no failure back from a worker still ready: its handoff may go.
        One that has sent outputs already (its prefill handed off to it too) goes on there
        whatever its health says: it holds the KV, and the lease is likely ended (the
        watchdog still covers a hang)."""
        if not self.announced or self.session is None or self.session.failure is not None:
            return False
        items = self.inbox.items
        if any(item is CUT or isinstance(item, BaseException) for item in items):
            return False
        return bool(items) or self.worker.ready

    @property
    def failed_loading_kv(self) -> bool:
        """Announced, and its worker could not load the KV of the handoff the prefill sent it
        directly (it failed under --kv-load-failure-policy fail before the router's handoff
        came): a failed pull of this pair, not a failed announcement."""
        return self.announced and any(
            isinstance(item, BaseException)
            and failure_reason(item).startswith(KV_LOAD_FAILED + ":")
            for item in self.inbox.items
        )

    def hand_off(self, params: types_pb2.DisaggregatedParams) -> None:
        """The announced request's handoff: the worker pulls the KV and goes on; the leg is the
        relay's current one from now on. Nothing is sent to a worker that failed the pull of the
        prefill's own handoff already: next() raises that failure."""
        failed = self.failed_loading_kv
        self.announced = False
        if self.session is not None:  # (None: aborted while the session opened; nothing was sent)
            if not failed:
                self.session.hand_off(self.tag, params)
            self._watch_from_now()

    async def next(self) -> types_pb2.RequestOutput | None:
        """The leg's next message (what came since the last, as one), None after its last.
        Raises the worker's error status, and WorkerStalledError when the worker hangs; a leg
        Abort cut ends with a cancelled message."""
        if self._is_over:
            return None
        if self.session is None:  # aborted while the session opened: nothing was sent
            self._is_over = True
            return cancelled_output(self.request_id)
        try:
            if not self._items:
                self._items = await self.inbox.take()
            msg = message_of(self._items.pop(0))
        except grpc.aio.AioRpcError:
            self.ended = True
            raise
        except asyncio.CancelledError:
            watchdog = self.watchdog
            if (
                watchdog is not None
                and watchdog.done()
                and not watchdog.cancelled()
                and watchdog.result()
            ):
                raise WorkerStalledError(self.worker) from None
            if not self.relay.cancelled:
                raise  # the client went away
            self._is_over = True
            return cancelled_output(self.request_id)  # Abort cut the leg
        if msg is None:  # the worker's end of the request
            self._is_over = True
            return None
        self.last_message_at = time.monotonic()
        if self._prefill_tokens or self._prompt_tokens:
            self.worker.queue_prefill(-self._prefill_tokens, -self._prompt_tokens)
            self._prefill_tokens = self._prompt_tokens = 0
        self.ended = msg.finished
        return msg

    def cut(self) -> None:
        """Ends the leg here at once (its reader gets CancelledError) and stops the request on
        the worker."""
        self.session.cut(self.tag, self.inbox)

    def close(self) -> None:
        if self.session is not None:
            if self.watchdog is not None:
                self.watchdog.cancel()
            if not self.ended:
                # A request whose last message came is left to end by itself: cancelling it could
                # reach the worker before it knew the message (a handoff) was delivered.
                self.cut()
            else:
                self.session.detach(self.tag)
            if self.relay.leg is self:
                self.relay.leg = None
        self.unload()

    def unload(self) -> None:
        worker = self.worker
        worker.in_flight -= 1
        worker.queue_prefill(-self._prefill_tokens, -self._prompt_tokens)
        worker.active_blocks -= self._blocks

    async def _watch(self) -> bool:
        """Cuts the leg (and returns True) once its worker has been quiet for the progress
        timeout and does not answer a probe; a busy worker that answers gets another period."""
        relay, worker = self.relay, self.worker
        timeout_s = relay.progress_timeout_s
        while True:
            quiet = time.monotonic() - self.last_message_at
            if quiet < timeout_s:
                await asyncio.sleep(timeout_s - quiet)
                continue
            if await relay.pool.is_responsive(worker, timeout_s):
                self.last_message_at = time.monotonic()
                continue
            log.warning(
                "worker %s stopped producing for %s (%.1f s) and does not answer; moving the request on",
                worker.address,
                relay.request_id,
                time.monotonic() - self.last_message_at,
            )
            relay.pool.mark_down(worker)
            self.cut()
            return True

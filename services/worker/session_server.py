"""Worker.Session: the router's multiplexed channel to this worker. Its Generate requests come in
as entries of SessionRequest messages, not as a gRPC call each, and run as their calls would
(WorkerLLMServicer.run_submitted: the same checks, phases and messages); their outputs go out
batched on the session's OutputStream (output_streams.py).

A call costs both ends a gRPC call set-up, its metadata, an interceptor pass and a status; on
the 2-core CPU machine that was most of the router's 1.5-1.8 ms of CPU per request
(bench/router.py), and on a GPU host it is time the worker's event loop takes from the engine
thread's GIL. Here a request costs an entry on a message.

What gRPC and the server's interceptor give a call, a session gives each of its requests: a
task that a cancel or the session's end cancels (the request is aborted in the engine), a
deadline, the drain's in-flight count, the RPC count of Generate by status, and the status an
exception maps to (common/errors.status_for), sent after the request's last output. The
session's caller owns its requests (Abort); only a caller that may call Worker RPCs at all can
open one (the cluster credential, common/auth.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

import grpc

from tandem.common.drain import InFlightCalls
from tandem.common.errors import (
    RpcError,
    failure_reason,
    invalid,
    retry_pushback_ms,
    status_for,
)
from tandem.common.interceptors import MalformedRequest
from tandem.decode.awaited_handoffs import ArrivedHandoff
from tandem.v1 import worker_pb2
from tandem.worker.output_streams import OutputStream

log = logging.getLogger("tandem.worker.session_server")

# Sessions one worker serves at once (one per router is the usual number).
MAX_SESSIONS = 64
# Requests one session may run at once (told in its first message); past it a submit is refused
# (RESOURCE_EXHAUSTED, SessionFailure.refused; the router waits for room instead of passing it).
MAX_REQUESTS_PER_SESSION = 4096
# Cancels one message may carry (the router's, under 64 KiB, carry fewer than 7,000).
MAX_CANCELS_PER_MESSAGE = 65536
# The method a session's requests count under (tandem:grpc_server_handled): they are Generates.
GENERATE_METHOD = "/tandem.v1.AsyncLLM/Generate"

# (submit, its stream, the session's owner, the future its handoff comes in: awaits_handoff only)
RunSubmitted = Callable[
    [worker_pb2.SessionSubmit, OutputStream, str, "asyncio.Future | None"], Awaitable[None]
]
CountStatus = Callable[[str, grpc.StatusCode], None]


class Session:
    """One Session call: the requests it runs, by tag, and the stream their outputs go on."""

    def __init__(
        self,
        owner: str,
        run: RunSubmitted,
        in_flight: InFlightCalls,
        count: CountStatus,
        max_request_bytes: int,
    ):
        self.owner = owner
        self.stream = OutputStream(max_request_bytes, MAX_REQUESTS_PER_SESSION)
        self._run = run
        self._in_flight = in_flight
        self._count = count
        self.tasks: dict[int, asyncio.Task] = {}
        # Announced requests waiting for their handoff (SessionSubmit.awaits_handoff), by tag.
        self.handoffs: dict[int, asyncio.Future] = {}
        # Tags whose task has begun to run (_serve): until then a cancel frees the tag at once.
        self._started: set[int] = set()
        # Tasks cancelled before they ran, their tag freed already -> whether they were announced.
        self._freed: dict[asyncio.Task, bool] = {}

    async def read(self, requests) -> None:
        """Starts and stops requests as the caller's messages say; once the caller has sent its
        last message (half-close), the session ends after its last request."""
        async for message in requests:
            if isinstance(message, MalformedRequest):
                raise invalid(f"Session: a message is not a valid SessionRequest ({message.error})")
            # Bounded before any work: a message's entries are handled in one turn of the loop.
            if (
                len(message.submits) > MAX_REQUESTS_PER_SESSION
                or len(message.handoffs) > MAX_REQUESTS_PER_SESSION
                or len(message.cancels) > MAX_CANCELS_PER_MESSAGE
            ):
                raise invalid(
                    f"Session: a message carries {len(message.submits)} submits, "
                    f"{len(message.handoffs)} handoffs and {len(message.cancels)} cancels (at most "
                    f"{MAX_REQUESTS_PER_SESSION}, {MAX_REQUESTS_PER_SESSION} and "
                    f"{MAX_CANCELS_PER_MESSAGE})"
                )
            for submit in message.submits:
                self._start(submit)
            for handoff in message.handoffs:
                self._hand_off(handoff)
            for tag in message.cancels:
                task = self.tasks.get(tag)
                if task is not None:
                    task.cancel()
                    if tag not in self._started:
                        # It never ran (its submit came in this message): nothing of it can reach
                        # the stream, so its tag is free now for a next message's submit (its
                        # done callback, two loop turns away, does the rest).
                        del self.tasks[tag]
                        self._freed[task] = self.handoffs.pop(tag, None) is not None
        while self.tasks:
            await asyncio.wait(list(self.tasks.values()))
        self.stream.finish()

    def _hand_off(self, handoff: worker_pb2.SessionHandoff) -> None:
        """The router's handoff of an announced request. One its prefill sent ahead of it
        (decode/awaited_handoffs.py) is the same handoff; one that differs cancels the request:
        it could go on from a first token the router did not give its client."""
        waiting = self.handoffs.pop(handoff.tag, None)
        if waiting is None or waiting.cancelled():
            return
        if not waiting.done():
            waiting.set_result(ArrivedHandoff(handoff.kv_params, False))
        elif not _same_handoff(waiting.result().kv_params, handoff.kv_params):
            log.error(
                "tag %d: the router's handoff is not the one its prefill sent ahead of it; the "
                "request is cancelled",
                handoff.tag,
            )
            task = self.tasks.get(handoff.tag)
            if task is not None:
                task.cancel()

    def _start(self, submit: worker_pb2.SessionSubmit) -> None:
        tag = submit.tag
        if tag in self.tasks:
            # Its entries could not be told from the running request's: the caller is broken, and
            # the session ends (INVALID_ARGUMENT) with every request on it.
            raise invalid(
                f"Session: tag {tag} is already running on this session; tags must be unique"
            )
        if len(self.tasks) >= MAX_REQUESTS_PER_SESSION:
            # Nothing ran: the caller may send it again once a request of the session has ended.
            self._refuse(
                tag,
                RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{len(self.tasks)} requests run on this session (at most "
                    f"{MAX_REQUESTS_PER_SESSION}); wait for some to end",
                ),
                refused=True,
            )
        elif not math.isfinite(submit.timeout_s) or submit.timeout_s < 0:
            self._refuse(
                tag,
                invalid(
                    f"timeout_s must be a number of seconds >= 0 (0: none), got {submit.timeout_s}"
                ),
            )
        else:
            self._in_flight.count += 1
            handoff = None
            if submit.awaits_handoff:
                handoff = self.handoffs[tag] = asyncio.get_running_loop().create_future()
            task = self.tasks[tag] = asyncio.create_task(self._serve(submit, handoff))
            # Bookkeeping in a done callback, not in _serve: a task cancelled before its first
            # step (a cancel in the same message as its submit) never runs _serve's finally.
            task.add_done_callback(lambda done: self._ended(tag, done))

    def _refuse(self, tag: int, exc: RpcError, refused: bool = False) -> None:
        self.stream.fail(tag, exc.code, exc.message, refused=refused)
        self._count(GENERATE_METHOD, exc.code)

    def _ended(self, tag: int, task: asyncio.Task) -> None:
        self._in_flight.count -= 1
        announced = self._freed.pop(task, False)
        if self.tasks.get(tag) is task:
            del self.tasks[tag]
            self._started.discard(tag)
            waiting = self.handoffs.pop(tag, None)
            # Ended before its handoff came (the router's, or its prefill's ahead of it)?
            announced = waiting is not None and (waiting.cancelled() or not waiting.done())
        if task.cancelled():
            code = grpc.StatusCode.CANCELLED
        elif (
            task.exception() is not None
        ):  # not an Exception (those are statuses): the process is going down
            code = grpc.StatusCode.UNKNOWN
        else:
            code = task.result()
        if announced and code == grpc.StatusCode.CANCELLED:
            return  # dropped before its handoff (no generation phase came): no call ran
        self._count(GENERATE_METHOD, code)

    async def _serve(
        self, submit: worker_pb2.SessionSubmit, handoff: asyncio.Future | None
    ) -> grpc.StatusCode:
        """Runs one request to its end; what ends it in error goes on the stream as its status.
        Returns the status code it ended with. handoff: where an announced request's handoff
        comes (read() sets it)."""
        self._started.add(submit.tag)
        deadline = asyncio.timeout(submit.timeout_s or None)
        try:
            async with deadline:
                await self._run(submit, self.stream, self.owner, handoff)
        except asyncio.CancelledError:
            return grpc.StatusCode.CANCELLED  # the caller cancelled it, or the session ended
        except Exception as exc:  # noqa: BLE001 - every failure becomes the request's status
            if isinstance(exc, TimeoutError) and deadline.expired():
                exc = RpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the request's deadline passed ({submit.timeout_s:g} s after it reached the worker)",
                )
            code, details = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("a session request failed", exc_info=exc)
            self.stream.fail(
                submit.tag, code, details, retry_pushback_ms(exc) or 0, reason=failure_reason(exc)
            )
            return code
        return grpc.StatusCode.OK

    def close(self) -> None:
        """The call is over: its requests stop (each aborts in the engine), its stream fails what is unwritten."""
        for task in self.tasks.values():
            task.cancel()
        self.stream.close()


class Sessions:
    """The worker's open sessions."""

    def __init__(
        self,
        run: RunSubmitted,
        in_flight: InFlightCalls,
        count: CountStatus,
        max_request_bytes: int,
        max_sessions: int = MAX_SESSIONS,
    ):
        """max_request_bytes: the server's bound on one message (the caller keeps its messages under it)."""
        self._run = run
        self.max_request_bytes = max_request_bytes
        self._in_flight = in_flight
        self._count = count
        self.max_sessions = max_sessions
        self._open: dict[str, Session] = {}

    @property
    def num_open(self) -> int:
        return len(self._open)

    async def serve(self, owner: str, requests, context=None):
        """Runs a session for owner (the caller's identity) and yields its messages until the caller
        leaves. With the call's context, the session closes as soon as the call ends (a generator
        suspended in a write is finalized only later)."""
        if len(self._open) >= self.max_sessions:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self._open)} sessions are open on this worker (at most {self.max_sessions}); "
                f"close one first",
            )
        session = Session(owner, self._run, self._in_flight, self._count, self.max_request_bytes)
        self._open[session.stream.stream_id] = session
        if context is not None:
            context.add_done_callback(lambda _: self._close(session))
        reader = asyncio.create_task(session.read(requests))

        def read_failed(task: asyncio.Task) -> None:
            """A broken caller (a bad message, a tag twice): the stream ends; its error is the call's status."""
            if not task.cancelled() and task.exception() is not None:
                session.stream.close()

        reader.add_done_callback(read_failed)
        try:
            async for batch in session.stream.batches():
                yield batch
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()
        finally:
            reader.cancel()
            self._close(session)

    def _close(self, session: Session) -> None:
        self._open.pop(session.stream.stream_id, None)
        session.close()


def _same_handoff(a, b) -> bool:
    """The same handoff (KvParams), as far as the decode goes on from it: the signed state, the
    first tokens and the drafts (the last two are not under the signature)."""
    return (
        a.opaque_state == b.opaque_state
        and a.first_gen_tokens == b.first_gen_tokens
        and a.draft_tokens == b.draft_tokens
    )

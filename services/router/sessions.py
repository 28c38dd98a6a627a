"""The router's end of its sessions (Worker.Session, worker/sessions.py): one bidi stream per
worker carries every Generate the router runs there, in (SessionRequest: submits and cancels,
batched while the stream is busy) and out (OutputBatch: their outputs, a batch per engine step,
and each request's end or error status). Route.relay reads a request's outputs from the inbox
(inbox.py) its tag names here; a request too large for a session message, or a worker without
sessions, gets a Generate call of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from tandem.router.inbox import CUT, ENDED, Inbox, SessionBroken, failure_error
from tandem.v1 import llm_pb2, types_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.router.sessions")

# Seconds after a failed open before the next try (meanwhile requests get calls of their own),
# and after a worker answered that it has no Session.
RETRY_OPEN_S = 1.0
RETRY_UNSUPPORTED_S = 60.0
# Largest SessionRequest the router writes (and largest request it submits on a session),
# within what the worker accepts: a bigger request gets a call of its own, whose cost is small
# beside its prompt's.
MAX_MESSAGE_BYTES = 64 << 10
# A submit's bytes in a SessionRequest beyond its own: the field's tag and length (< 64 KiB).
_ENTRY_OVERHEAD = 4
# A cancel's most bytes in a SessionRequest (a packed 64-bit varint), and the packed field's header.
_CANCEL_BYTES, _CANCELS_HEADER = 10, 4
# Requests a session runs at once, when the worker does not say (worker/sessions.py's bound).
DEFAULT_MAX_REQUESTS = 4096


class OpenSession:
    """One Session call: the requests it carries, by tag, the messages waiting to be written, and
    the reader and writer tasks."""

    def __init__(
        self,
        call,
        stream_id: str,
        on_orphan: Callable[[types_pb2.RequestOutput], None] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ):
        self.call = call
        self.stream_id = stream_id
        # Called with an output whose relay is over (a cancelled or failed request's stragglers).
        self.on_orphan = on_orphan
        self.max_message_bytes = max_message_bytes
        self.max_requests = max_requests
        self.inboxes: dict[int, Inbox] = {}
        self.failure: tuple[grpc.StatusCode, str] | None = None
        self._next_tag = 0
        # Not written yet: submits by tag, with their size and deadline (time.monotonic(); their
        # timeout_s is what is left of it when written), and cancels. A cancel of a submit not
        # written yet just drops it.
        self._submits: dict[int, tuple[worker_pb2.SessionSubmit, int, float | None]] = {}
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def attach(self) -> tuple[int, Inbox] | None:
        """A tag and its inbox; None once the session has failed (its failure was sent to the
        inboxes it had: a new one would never hear of it) or runs the most requests the worker
        takes on it."""
        if self.failure is not None or len(self.inboxes) >= self.max_requests:
            return None
        self._next_tag += 1
        inbox = self.inboxes[self._next_tag] = Inbox()
        return self._next_tag, inbox

    def submit(
        self,
        tag: int,
        request: llm_pb2.GenerateRequest,
        client: str,
        split: bool,
        deadline: float | None,
    ) -> bool:
        """Queues the request of tag for the worker; False (nothing queued) when it is too large
        for a session message: it needs a call of its own. deadline: time.monotonic(), or None."""
        # timeout_s is set when the submit is written (what is left of the deadline then); a
        # stand-in now, so the size counts the field (a double: the same size whatever its value).
        submit = worker_pb2.SessionSubmit(
            tag=tag,
            request=request,
            client=client,
            split=split,
            timeout_s=1.0 if deadline is not None else 0.0,
        )
        size = submit.ByteSize() + _ENTRY_OVERHEAD
        if size + _CANCELS_HEADER > self.max_message_bytes:
            return False
        self._submits[tag] = (submit, size, deadline)
        self._wake.set()
        return True

    def cut(self, tag: int, inbox: Inbox) -> None:
        """Ends the relay of tag here at once (its reader gets CancelledError) and stops the request on the worker."""
        self.cancel(tag)
        inbox.put(CUT)

    def cancel(self, tag: int) -> None:
        """Stops the request of tag on the worker (unless it was never sent) and forgets it here."""
        self.inboxes.pop(tag, None)
        if self._submits.pop(tag, None) is None and self.failure is None:
            self._cancels.append(tag)
            self._wake.set()

    def detach(self, tag: int) -> None:
        self.inboxes.pop(tag, None)

    async def _write(self) -> None:
        """Writes what is waiting, as few messages as fit: a burst of requests costs one write."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._submits or self._cancels:
                    await self.call.write(self._next_message())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            # The call is over (the reader tells the requests why) or cannot be written any more.
            log.info("session %s: writing stopped (%s)", self.stream_id, exc)

    def _next_message(self) -> worker_pb2.SessionRequest:
        """What is waiting, as much as fits under the worker's bound: cancels first, then submits
        in order (each fits alone: submit() checked it)."""
        room = self.max_message_bytes - _CANCELS_HEADER
        num_cancels = min(len(self._cancels), room // _CANCEL_BYTES)
        message = worker_pb2.SessionRequest(cancels=self._cancels[:num_cancels])
        del self._cancels[:num_cancels]
        room -= num_cancels * _CANCEL_BYTES
        now = time.monotonic()
        for tag, (submit, size, deadline) in list(self._submits.items()):
            if size > room:
                break
            if deadline is not None:  # what is left of it now, not when the request was queued
                submit.timeout_s = max(1e-3, deadline - now)
            message.submits.append(submit)
            room -= size
            del self._submits[tag]
        return message

    async def _read(self) -> None:
        inboxes = self.inboxes
        failure = (grpc.StatusCode.UNAVAILABLE, "the worker closed the session")
        try:
            # read(), as _open's first read: grpc.aio refuses a call read both ways.
            while (batch := await self.call.read()) is not grpc.aio.EOF:
                if batch.tokens:
                    self._deliver_mixed(batch)
                else:
                    for tag, output in zip(batch.tags, batch.outputs):
                        self._deliver(inboxes.get(tag), output)
                for tag in batch.ended:
                    inbox = inboxes.get(tag)
                    if inbox is not None:
                        inbox.put(ENDED)
                for failed in batch.failed:
                    inbox = inboxes.get(failed.tag)
                    if inbox is not None:
                        inbox.put(failure_error(failed))
        except grpc.aio.AioRpcError as exc:
            failure = (exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            failure = (grpc.StatusCode.UNAVAILABLE, "the router closed the session")
            raise
        except Exception as exc:  # noqa: BLE001 - a bad batch ends the session (its requests move on)
            log.exception("session %s failed", self.stream_id)
            failure = (grpc.StatusCode.INTERNAL, f"the session broke: {exc}")
        finally:
            self.failure = failure
            self._writer.cancel()
            self.call.cancel()  # the worker's side ends too, whatever ended ours
            log.info("session %s ended: %s %s", self.stream_id, failure[0].name, failure[1])
            for inbox in inboxes.values():
                inbox.put(SessionBroken(*failure))

    def _deliver(self, inbox: Inbox | None, output: types_pb2.RequestOutput) -> None:
        if inbox is not None:
            inbox.put(output)
        elif self.on_orphan is not None:  # its relay is over (a cancelled request's stragglers)
            self.on_orphan(output)

    def _deliver_mixed(self, batch: worker_pb2.OutputBatch) -> None:
        """A batch with lone tokens: entry i is batch.tokens[i], or the next full output where that is -1."""
        tags, tokens = batch.tags, batch.tokens
        if (
            len(tokens) != len(tags)
            or len(batch.cumulative_logprobs) != len(tags)
            or sum(1 for t in tokens if t < 0) != len(batch.outputs)
        ):
            raise ValueError(
                f"malformed output batch: {len(tags)} tags, {len(tokens)} tokens, "
                f"{len(batch.cumulative_logprobs)} logprobs, {len(batch.outputs)} outputs"
            )
        inboxes = self.inboxes
        outputs = iter(batch.outputs)
        for tag, token, cumulative in zip(tags, tokens, batch.cumulative_logprobs):
            inbox = inboxes.get(tag)
            if token < 0:
                self._deliver(inbox, next(outputs))
            elif (
                inbox is not None
            ):  # a lone token whose relay is over is nobody's (it holds no handoff)
                inbox.put_token(token, cumulative)

    def close(self) -> None:
        self._reader.cancel()
        self._writer.cancel()
        self.call.cancel()


class WorkerSession:
    """One worker's session, opened on first use and again after it broke."""

    def __init__(
        self,
        stub: worker_pb2_grpc.WorkerStub,
        address: str,
        on_orphan: Callable[[types_pb2.RequestOutput], None] | None = None,
    ):
        self._stub = stub
        self._address = address
        self._on_orphan = on_orphan
        self._session: OpenSession | None = None
        self._opening: asyncio.Task | None = None
        # After a failed open, requests get calls of their own until then (loop time).
        self._retry_at = 0.0

    async def attach(self, timeout: float) -> tuple[OpenSession, int, Inbox] | None:
        """(session, tag, inbox) for one request, or None when the worker's session cannot be had
        (the request then gets a call of its own, as any caller's)."""
        session = self._session
        if session is None or session.failure is not None:
            if asyncio.get_running_loop().time() < self._retry_at:
                return None
            if self._opening is None:
                self._opening = asyncio.create_task(self._open(timeout))
            session = await asyncio.shield(self._opening)
            if session is None:
                return None
        attached = session.attach()
        if attached is None:  # it failed meanwhile, or is full: this request gets a call of its own
            return None
        tag, inbox = attached
        return session, tag, inbox

    async def _open(self, timeout: float) -> OpenSession | None:
        try:
            return await self._open_call(timeout)
        finally:
            self._opening = None  # done, whoever still waits for it

    async def _open_call(self, timeout: float) -> OpenSession | None:
        call = self._stub.Session()
        try:
            first = await asyncio.wait_for(call.read(), timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            call.cancel()
            # A worker without Session (an older version) is asked again only now and then: it
            # may have been upgraded in place meanwhile.
            unsupported = (
                isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() is grpc.StatusCode.UNIMPLEMENTED
            )
            self._retry_at = asyncio.get_running_loop().time() + (
                RETRY_UNSUPPORTED_S if unsupported else RETRY_OPEN_S
            )
            log.info(
                "no session with %s (%s); its requests get calls of their own",
                self._address,
                exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "timeout",
            )
            return None
        except BaseException:  # cancelled while it opened: the call goes with it
            call.cancel()
            raise
        if first is grpc.aio.EOF or not first.stream_id:
            call.cancel()
            self._retry_at = asyncio.get_running_loop().time() + RETRY_OPEN_S
            return None
        max_bytes = min(MAX_MESSAGE_BYTES, first.max_request_bytes or MAX_MESSAGE_BYTES)
        self._session = OpenSession(
            call,
            first.stream_id,
            self._on_orphan,
            max_bytes,
            first.max_requests or DEFAULT_MAX_REQUESTS,
        )
        return self._session

    def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self._session is not None:
            self._session.close()

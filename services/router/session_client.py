"""The router's end of its sessions (Worker.Session, worker/session_server.py): one bidi stream per
worker carries every Generate the router runs there, in (SessionRequest: submits and cancels,
batched while the stream is busy; EngineRequest: token ids) and out (EngineOutputs: their
EngineOutput entries, a batch per engine step, and each request's end or error status). A
request's relay (relay.py) reads its outputs from the inbox (inbox.py) its tag names here. It is
the one way the router's requests reach a worker: a request waits for a session that is full,
goes alone in a message when it is too large to share one, and fails as its own call would
(RESOURCE_EXHAUSTED) when it is larger than the worker takes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from tandem.common.engine_messages import engine_request, kv_params
from tandem.common.errors import RpcError
from tandem.router.inbox import CUT, ENDED, Inbox, SessionBroken, failure_error, stream_failure
from tandem.v1 import internal_pb2, llm_pb2, types_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger("tandem.router.session_client")

# Largest SessionRequest the router fills with several submits (within what the worker
# accepts): a larger submit goes alone in a message, up to the worker's bound.
MAX_MESSAGE_BYTES = 64 << 10
# A submit's bytes in a SessionRequest beyond its own: the field's tag and its length's varint.
_ENTRY_OVERHEAD = 6
# A cancel's most bytes in a SessionRequest (a packed 64-bit varint), and the packed field's header.
_CANCEL_BYTES, _CANCELS_HEADER = 10, 4
# Requests a session runs at once, when the worker does not say (worker/session_server.py's bound).
DEFAULT_MAX_REQUESTS = 4096


class OpenSession:
    """One Session call: the requests it carries, by tag, the messages waiting to be written, and
    the reader and writer tasks."""

    def __init__(
        self,
        call,
        stream_id: str,
        on_orphan: Callable[[internal_pb2.EngineOutput], None] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        max_request_bytes: int = 0,
        takes_handoffs: bool = False,
    ):
        """max_message_bytes: what the router fills with several entries; max_request_bytes: the
        worker's bound on one message (a larger submit cannot be sent; 0: max_message_bytes);
        takes_handoffs: the worker takes announced requests (EngineOutputs.takes_handoffs)."""
        self.call = call
        self.takes_handoffs = takes_handoffs
        self.stream_id = stream_id
        # Called with an entry whose relay is over (a cancelled or failed request's stragglers).
        self.on_orphan = on_orphan
        self.max_message_bytes = max_message_bytes
        self.max_request_bytes = max(max_request_bytes, max_message_bytes)
        self.max_requests = max_requests
        # Set whenever a request leaves (or the session fails): a caller waiting for room looks again.
        self._room = asyncio.Event()
        self.inboxes: dict[int, Inbox] = {}
        self.failure: tuple[grpc.StatusCode, str] | None = None
        self._next_tag = 0
        # Not written yet: submits by tag, with their size and deadline (time.monotonic(); their
        # timeout_s is what is left of it when written), and cancels. A cancel of a submit not
        # written yet just drops it.
        self._submits: dict[int, tuple[worker_pb2.SessionSubmit, int, float | None]] = {}
        self._cancels: list[int] = []
        # Handoffs of announced submits, by tag: each written once its submit has been.
        self._handoffs: dict[int, worker_pb2.SessionHandoff] = {}
        self._wake = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def attach(self) -> tuple[int, Inbox] | None:
        """A tag and its inbox; None once the session has failed (its failure was sent to the
        inboxes it had: a new one would never hear of it) or runs the most requests the worker
        takes on it (wait_for_room, then try again)."""
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
        return_first_gen_tokens: bool = False,
        prefix_source: worker_pb2.PrefixSource | None = None,
        awaits_handoff: bool = False,
        hand_off_to: str = "",
    ) -> None:
        """Queues the request of tag for the worker; RESOURCE_EXHAUSTED (nothing queued), as its
        own call would get, when it is larger than the worker takes in a message. deadline:
        time.monotonic(), or None. return_first_gen_tokens: a generation phase's output starts
        with the tokens its request carries (a client's own generation_only request);
        awaits_handoff: a generation_only request whose handoff hand_off() sends later;
        hand_off_to: the context_only half of a split announced to the decode at that address,
        where the prefill sends the handoff too."""
        # timeout_s is set when the submit is written (what is left of the deadline then); a
        # stand-in now, so the size counts the field (a double: the same size whatever its value).
        submit = worker_pb2.SessionSubmit(
            tag=tag,
            request=engine_request(request, return_first_gen_tokens),
            client=client,
            split=split,
            timeout_s=1.0 if deadline is not None else 0.0,
            awaits_handoff=awaits_handoff,
            hand_off_to=hand_off_to,
        )
        if prefix_source is not None:
            submit.prefix_source.CopyFrom(prefix_source)
        size = submit.ByteSize() + _ENTRY_OVERHEAD
        if size > self.max_request_bytes:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request is {size} bytes; the worker takes at most {self.max_request_bytes} "
                f"(its --max-request-bytes): send a shorter prompt",
            )
        self._submits[tag] = (submit, size, deadline)
        inbox = self.inboxes.get(tag)
        if inbox is not None:
            inbox.request_id = request.request_id
        self._wake.set()

    def hand_off(self, tag: int, params: types_pb2.DisaggregatedParams) -> None:
        """Queues the handoff of tag's announced request (submitted with awaits_handoff)."""
        self._handoffs[tag] = worker_pb2.SessionHandoff(tag=tag, kv_params=kv_params(params))
        self._wake.set()

    async def wait_for_room(self) -> None:
        """Until a request leaves the session (or it fails)."""
        self._room.clear()
        if self.failure is None and len(self.inboxes) >= self.max_requests:
            await self._room.wait()

    def cut(self, tag: int, inbox: Inbox) -> None:
        """Ends the relay of tag here at once (its reader gets CancelledError) and stops the request on the worker."""
        self.cancel(tag)
        inbox.put(CUT)

    def cancel(self, tag: int) -> None:
        """Stops the request of tag on the worker (unless it was never sent) and forgets it here."""
        self.detach(tag)
        self._handoffs.pop(tag, None)
        if self._submits.pop(tag, None) is None and self.failure is None:
            self._cancels.append(tag)
            self._wake.set()

    def detach(self, tag: int) -> None:
        if self.inboxes.pop(tag, None) is not None:
            self._room.set()

    async def _write(self) -> None:
        """Writes what is waiting, as few messages as fit: a burst of requests costs one write."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._submits or self._cancels or self._handoffs:
                    await self.call.write(self._next_message())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            # The call is over (the reader tells the requests why) or cannot be written any more.
            log.info("session %s: writing stopped (%s)", self.stream_id, exc)

    def _next_message(self) -> worker_pb2.SessionRequest:
        """What is waiting, as much as fits in max_message_bytes: cancels first, then submits in
        order, then the handoffs whose submits went (in this message or before: the worker takes
        a message's submits first); a submit larger than that goes alone (submit() checked the
        worker's bound), and so does a handoff."""
        room = self.max_message_bytes - _CANCELS_HEADER
        num_cancels = min(len(self._cancels), room // _CANCEL_BYTES)
        message = worker_pb2.SessionRequest(cancels=self._cancels[:num_cancels])
        del self._cancels[:num_cancels]
        room -= num_cancels * _CANCEL_BYTES
        now = time.monotonic()
        for tag, (submit, size, deadline) in list(self._submits.items()):
            alone = not message.cancels and not message.submits
            if size > room and not alone:
                break
            if deadline is not None:  # what is left of it now, not when the request was queued
                submit.timeout_s = max(1e-3, deadline - now)
            message.submits.append(submit)
            room -= size
            del self._submits[tag]
        for tag, handoff in list(self._handoffs.items()):
            if tag in self._submits:
                continue  # its submit has not gone yet
            size = handoff.ByteSize() + _ENTRY_OVERHEAD
            alone = not message.cancels and not message.submits and not message.handoffs
            if size > room and not alone:
                break
            message.handoffs.append(handoff)
            room -= size
            del self._handoffs[tag]
        return message

    async def _read(self) -> None:
        inboxes = self.inboxes
        failure = (grpc.StatusCode.UNAVAILABLE, "the worker closed the session")
        try:
            # read(), as _open's first read: grpc.aio refuses a call read both ways.
            while (batch := await self.call.read()) is not grpc.aio.EOF:
                for entry in batch.outputs:
                    inbox = inboxes.get(entry.tag)
                    if inbox is not None:
                        inbox.put_entry(entry)
                    elif self.on_orphan is not None:  # its relay is over: a straggler
                        self.on_orphan(entry)
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
            self._room.set()
            self._writer.cancel()
            self.call.cancel()  # the worker's side ends too, whatever ended ours
            log.info("session %s ended: %s %s", self.stream_id, failure[0].name, failure[1])
            for inbox in inboxes.values():
                inbox.put(SessionBroken(*failure))

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
        on_orphan: Callable[[internal_pb2.EngineOutput], None] | None = None,
    ):
        self._stub = stub
        self._address = address
        self._on_orphan = on_orphan
        self._session: OpenSession | None = None
        self._opening: asyncio.Task | None = None

    async def attach(self, timeout: float) -> tuple[OpenSession, int, Inbox]:
        """(session, tag, inbox) for one request: on the open session, or one opened now (within
        timeout), waiting while it runs the most requests the worker takes. A worker whose
        session cannot be opened fails the request UNAVAILABLE, as a call to it would."""
        while True:
            session = self._session
            if session is None or session.failure is not None:
                if self._opening is None:
                    self._opening = asyncio.create_task(self._open(timeout))
                session = await asyncio.shield(self._opening)
            attached = session.attach()
            if attached is not None:
                return (session, *attached)
            await session.wait_for_room()  # full (or it failed meanwhile: another opens)

    def try_attach(self, timeout: float) -> tuple[OpenSession, int, Inbox] | None:
        """attach() without waiting: None unless the session is open, has room and takes
        announced requests (an announcement must not hold up the context phase). A session not
        open is opened meanwhile (within timeout), for the requests after this one."""
        session = self._session
        if session is None or session.failure is not None:
            if self._opening is None:
                self._opening = asyncio.create_task(self._open(timeout))
                # Its failure is the next attach()'s to report (it opens again).
                self._opening.add_done_callback(
                    lambda opening: opening.cancelled() or opening.exception()
                )
            return None
        if not session.takes_handoffs:
            return None
        attached = session.attach()
        return None if attached is None else (session, *attached)

    async def _open(self, timeout: float) -> OpenSession:
        try:
            return await self._open_call(timeout)
        finally:
            self._opening = None  # done, whoever still waits for it

    async def _open_call(self, timeout: float) -> OpenSession:
        call = self._stub.Session()
        try:
            first = await asyncio.wait_for(call.read(), timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            call.cancel()
            if isinstance(exc, grpc.aio.AioRpcError):
                code, why = exc.code(), f"{exc.code().name}: {exc.details()}"
            else:
                code, why = grpc.StatusCode.UNAVAILABLE, f"no answer in {timeout:g} s"
            log.info("no session with %s (%s)", self._address, why)
            if code is not grpc.StatusCode.UNAVAILABLE:
                code, why = grpc.StatusCode.UNAVAILABLE, f"{why} (a worker that serves no Session?)"
            raise stream_failure(code, f"no session with worker {self._address}: {why}") from None
        except BaseException:  # cancelled while it opened: the call goes with it
            call.cancel()
            raise
        if first is grpc.aio.EOF or not first.stream_id:
            call.cancel()
            raise stream_failure(
                grpc.StatusCode.UNAVAILABLE, f"worker {self._address} closed its session at once"
            )
        worker_bound = first.max_request_bytes or MAX_MESSAGE_BYTES
        self._session = OpenSession(
            call,
            first.stream_id,
            self._on_orphan,
            min(MAX_MESSAGE_BYTES, worker_bound),
            first.max_requests or DEFAULT_MAX_REQUESTS,
            worker_bound,
            first.takes_handoffs,
        )
        return self._session

    def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self._session is not None:
            self._session.close()

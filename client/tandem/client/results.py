"""RequestOutput as generate_async returns it: awaitable, async-iterable when
streaming, abortable, with a blocking result() for synchronous callers."""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import Optional

import grpc

from tandem.client.outputs import CompletionOutput, RequestOutputState
from tandem.v1 import llm_pb2

_END = object()


class RequestOutput(RequestOutputState):
    def __init__(self, transport, request: llm_pb2.GenerateRequest, streaming: bool):
        super().__init__(request.request_id, request.prompt.text if request.prompt.HasField("text") else None)
        self._transport = transport
        self.streaming = streaming
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()
        try:
            self._loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
            self._event: Optional[asyncio.Event] = asyncio.Event()
        except RuntimeError:
            self._loop, self._event = None, None
        self._error: Optional[BaseException] = None
        self._done = False
        self._aborted_locally = False
        self._cancel = transport.stream_to("Generate", request, self._push, lambda exc: self._push((_END, exc)))

    # -- delivery (transport thread) --
    def _push(self, item) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._event.set)

    def _take(self, item) -> bool:
        """Applies one delivered item; False once the stream has ended."""
        if isinstance(item, tuple) and item and item[0] is _END:
            self._done = True
            exc = item[1]
            if self._aborted_locally and (exc is None or isinstance(exc, (asyncio.CancelledError, grpc.RpcError))):
                self._finish_cancelled()
            elif exc is not None and not isinstance(exc, asyncio.CancelledError):
                self._error = exc
            if self._error is not None:
                raise self._error
            return False
        self._apply(item)
        return True

    def _finish_cancelled(self) -> None:
        """The call was cancelled from this side after abort(): finish like a server-side abort."""
        if not self.outputs:
            self.outputs.append(CompletionOutput(index=0))
        for out in self.outputs:
            out.finish_reason = out.finish_reason or "cancelled"
        self.finished = True

    def _next_sync(self, timeout: Optional[float] = None):
        with self._cv:
            if not self._cv.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"request {self.request_id} produced nothing in {timeout} s")
            return self._items.popleft()

    async def _next_async(self):
        if self._loop is not asyncio.get_running_loop():
            return await asyncio.to_thread(self._next_sync)
        while True:
            with self._cv:
                if self._items:
                    return self._items.popleft()
                self._event.clear()
            await self._event.wait()

    # -- the seed's API --
    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        if self._done:
            if self._error is not None:
                raise self._error
            return
        try:
            while self._take(await self._next_async()):
                yield self
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away (task cancelled, loop left early): cancel the RPC so the
            # server aborts the request instead of generating for nobody.
            if not self._done:
                self._cancel()
            raise

    async def aresult(self) -> "RequestOutput":
        async for _ in self:
            pass
        return self

    def __await__(self):
        return self.aresult().__await__()

    def result(self, timeout: Optional[float] = None) -> "RequestOutput":
        while not self._done:
            self._take(self._next_sync(timeout))
        if self._error is not None:
            raise self._error
        return self

    def abort(self) -> None:
        """Aborts the request on the server; the output then finishes with finish_reason 'cancelled'."""
        future = self._transport.submit(self._transport.unary("Abort", llm_pb2.AbortRequest(request_id=self.request_id)))

        def after_abort(f):
            # A request the server does not know (not registered yet, or finished) is cancelled locally.
            if f.cancelled() or f.exception() is not None or not f.result().aborted:
                self._aborted_locally = True
                self._cancel()
        future.add_done_callback(after_abort)

    @property
    def aborted(self) -> bool:
        return any(o.finish_reason == "cancelled" for o in self.outputs)

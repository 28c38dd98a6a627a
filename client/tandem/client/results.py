"""RequestOutput as generate_async returns it, with tensorrt_llm's GenerationResult API
(tensorrt_llm/executor/result.py): awaitable, iterable (sync and async) when streaming,
result() / aresult(), abort() and aborted()."""

from __future__ import annotations

import asyncio
import collections
import threading

from tandem.client.errors import RequestError
from tandem.client.outputs import CompletionOutput, RequestOutputState
from tandem.v1 import llm_pb2

_END = object()


class RequestOutput(RequestOutputState):
    def __init__(self, transport, request: llm_pb2.GenerateRequest, streaming: bool):
        params = request.sampling_params
        super().__init__(
            request.request_id,
            request.prompt.text if request.prompt.HasField("text") else None,
            params.logprobs if params.HasField("logprobs") else None,
            params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
            params.n if params.HasField("n") and params.n > 0 else 1,
        )
        self._transport = transport
        self.streaming = streaming
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._event: asyncio.Event | None = asyncio.Event()
        except RuntimeError:
            self._loop, self._event = None, None
        self._error: BaseException | None = None
        self._done = False
        self._aborted = False
        self._aborted_locally = False
        # Whether iterating has handed out a state yet (an early abort still hands out one).
        self._yielded = False
        self._cancel = transport.stream_to(
            "Generate", request, self._push, lambda exc: self._push((_END, exc))
        )

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
            if self._aborted_locally and (
                exc is None or isinstance(exc, (asyncio.CancelledError, RequestError))
            ):
                self._finish_cancelled()
                # Aborted before its first output: it ends with one, cancelled (TensorRT-LLM's).
                return not self._yielded
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
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

    def _next_sync(self, timeout: float | None = None):
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
        # A generator rather than self, so that leaving the loop early (or cancelling the task
        # that reads it) cancels the call and the server aborts the request.
        return self._aiter()

    async def _aiter(self):
        try:
            while True:
                try:
                    yield await self.__anext__()
                except StopAsyncIteration:
                    return
        except GeneratorExit:
            if not self._done:
                self._cancel()
            raise

    async def __anext__(self) -> RequestOutput:
        """The next streamed state of this request; StopAsyncIteration once it has finished."""
        if self._done:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        try:
            if self._take(await self._next_async()):
                self._yielded = True
                return self
        except asyncio.CancelledError:
            if not self._done:
                self._cancel()
            raise
        raise StopAsyncIteration

    def __iter__(self):
        """Synchronous streaming: `for out in llm.generate_async(..., streaming=True)` from plain code."""
        try:
            while True:
                try:
                    yield self.__next__()
                except StopIteration:
                    return
        except GeneratorExit:
            if not self._done:
                self._cancel()
            raise

    def __next__(self) -> RequestOutput:
        if self._done:
            if self._error is not None:
                raise self._error
            raise StopIteration
        if self._take(self._next_sync()):
            self._yielded = True
            return self
        raise StopIteration

    async def aresult(self) -> RequestOutput:
        async for _ in self:
            pass
        return self

    def __await__(self):
        return self.aresult().__await__()

    def result(self, timeout: float | None = None) -> RequestOutput:
        while not self._done:
            self._take(self._next_sync(timeout))
        if self._error is not None:
            raise self._error
        return self

    def abort(self) -> None:
        """Aborts the request on the server; the output then finishes with finish_reason 'cancelled'."""
        self._aborted = True
        future = self._transport.submit(
            self._transport.unary("Abort", llm_pb2.AbortRequest(request_id=self.request_id))
        )

        def after_abort(f):
            # A request the server does not know (not registered yet, or finished) is cancelled locally.
            if f.cancelled() or f.exception() is not None or not f.result().aborted:
                self._aborted_locally = True
                self._cancel()

        future.add_done_callback(after_abort)

    def aborted(self) -> bool:
        """Whether abort() was called on this output (as in tensorrt_llm) or the server cancelled it
        (pause_generation, an Abort from elsewhere)."""
        return self._aborted or any(o.finish_reason == "cancelled" for o in self.outputs)

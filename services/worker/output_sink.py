"""The output path of a request that came on a session (the router's requests): each engine
output becomes its EngineOutput entries in the session's next batch right where the engine core
hands it over, on the event loop, without waking the request's coroutine.

A worker's own Generate puts every output on the request's queue, wakes its coroutine, and
passes the message through a chain of async generators (the request's, the text front's, two
metric layers, the interceptors'): ~85 us of the loop's time per output on the 2-core CPU
machine, so a step of 256 sequences cost the worker 20 ms of the GIL it shares with the engine
thread (bench/RESULTS.md, issue 7, offline). Here the same steps run as plain calls; the
coroutine waits once, for the request's end. Every session request takes it (n sequences and
beam search too); a decode step's bare tokens skip the message altogether.
"""

from __future__ import annotations

import asyncio

from tandem.common.metrics import RequestTracker
from tandem.engine.messages import StepOutput
from tandem.text.front import TextRequest
from tandem.worker.output_processor import WorkerRequest
from tandem.worker.output_streams import OutputStream


class OutputSink:
    """Stands where a request's queue stands (the engine core calls put_nowait with each of its
    outputs, the request puts its own CANCELLED and failures): builds each message at once."""

    def __init__(
        self, text_request: TextRequest, tracker: RequestTracker, stream: OutputStream, tag: int
    ):
        self.request: WorkerRequest | None = None
        self.text_request = text_request
        self.tracker = tracker
        self.stream = stream
        self.tag = tag
        # Resolved once the request's last message is written (or with the error that ends it).
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._first = True
        self._finished = False
        # Messages pushed and not yet written, and an error that ends the request once they are
        # (its status must not overtake them: the caller would drop their tokens).
        self._num_unwritten = 0
        self._error: BaseException | None = None

    def bind(self, request: WorkerRequest) -> None:
        """Takes request's outputs from now on (before it is started)."""
        self.request = request
        request.stream = self
        # Its decode steps' outputs can go as bare token entries (OutputStream.push_tokens): one
        # sequence, no logprobs, so a step's message is its new tokens and nothing else.
        self._bare_tokens = (
            request.options.logprobs is None
            and not request.beam_search
            and len(request.sequences) == 1
        )
        self._state = next(iter(request.sequences.values()))

    async def wait(self) -> None:
        """Until the request's last message is written; raises what ended it otherwise."""
        try:
            await self.done
        finally:
            if self.done.done() and not self.done.cancelled():
                self.done.exception()  # retrieved: a cancelled call's end was raised elsewhere

    def put_nowait(self, item) -> None:
        if self._finished or self.done.done():
            # After the end (an output that raced with an abort): its lease is nobody's.
            if (
                isinstance(item, StepOutput)
                and item.lease is not None
                and self.request.withdraw is not None
            ):
                self.request.withdraw(item.lease.lease_id)
            return
        if (
            self._bare_tokens
            and item.__class__ is StepOutput
            and not item.finished
            and item.lease is None
            and item.perf is None
            and item.generation_logits is None
            and item.new_token_ids
            and not self._first
            and self.tracker.first_token_at is not None
        ):
            self._push_tokens(item)
            return
        request = self.request
        try:
            msg = request.message([item], self._first)
            self._first = False
            self.text_request.processor.pass_through(msg)
            self.tracker.saw(msg)
            self.tracker.counted(msg, len(request.prompt_token_ids))
            self._finished = msg.finished
            self.stream.push(self.tag, msg, self._written_callback(msg.finished))
            self._num_unwritten += 1
        except BaseException as exc:  # noqa: BLE001 - ends the request with its status
            self._finished = True
            self._error = exc
            if not self._num_unwritten:
                self._end(exc)

    def _push_tokens(self, item: StepOutput) -> None:
        """What message() and the tracker would do with a decode step's new tokens, without the message."""
        if self._state.finished:  # a token that raced with an abort
            return
        request = self.request
        metrics = request.metrics
        if item.num_cached_prompt_tokens > metrics.num_cached_prompt_tokens:
            metrics.num_cached_prompt_tokens = item.num_cached_prompt_tokens
        try:
            self.stream.push_tokens(
                self.tag,
                item.new_token_ids,
                request.first_cumulative + item.cumulative_logprob,
                self._token_written,
            )
        except BaseException as exc:  # noqa: BLE001 - the stream is closed: the request ends with its status
            self._finished = True
            self._error = exc
            if not self._num_unwritten:
                self._end(exc)
            return
        self._num_unwritten += 1
        self.tracker.count_tokens(0, len(item.new_token_ids))

    def _token_written(self, error: BaseException | None) -> None:
        self._num_unwritten -= 1
        if error is not None:
            self._end(error)
        elif self._error is not None and not self._num_unwritten:
            self._end(self._error)

    def _written_callback(self, is_last: bool):
        def written(error: BaseException | None) -> None:
            self._num_unwritten -= 1
            if error is not None:
                self._end(error)
                return
            self.request.delivered()
            if is_last:
                self._end(None)
            elif self._error is not None and not self._num_unwritten:
                self._end(self._error)

        return written

    def _end(self, error: BaseException | None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)

    def empty(self) -> bool:
        return True  # nothing waits here: each output went out as it came

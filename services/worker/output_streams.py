"""The output half of a session (Worker.Session, session_server.py): the outputs of every request
the router runs on this worker go out batched, one message per engine step for all of them,
instead of one message per request per step. gRPC's cost is per message, on both ends: at a batch
of 256 a step cost the worker and the router 256 sends and reads; here it costs one.

A request's outputs are EngineOutput entries (internal.proto): the new token ids of a step, and
what else the step's message held (common/engine_messages.py). Each request's end goes in the
batch after its last output: its tag in `ended`, or, where its own call would have ended with an
error status, the status in `failed`. So the caller has every output of a request once it sees
the request's end.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import grpc

from tandem.common.engine_messages import engine_outputs, token_entry
from tandem.common.errors import RpcError, unavailable
from tandem.v1 import internal_pb2, types_pb2, worker_pb2


class OutputStream:
    """One session's outputs. Outputs are pushed onto the pending batch (with a callback run once
    the batch that holds them is written, or the stream fails), and the Session call writes
    whatever is pending as one message whenever it can: while the caller reads slowly, the
    batches grow (fewer, larger messages when the caller lags)."""

    def __init__(self, max_request_bytes: int = 0, max_requests: int = 0):
        self.stream_id = uuid.uuid4().hex
        # What the session's caller may send in one message and run at once (told in the first batch).
        self.max_request_bytes = max_request_bytes
        self.max_requests = max_requests
        self._outputs: list[internal_pb2.EngineOutput] = []
        self._ended: list[int] = []
        self._failed: list[worker_pb2.SessionFailure] = []
        # finish() was called: the stream ends once nothing is pending.
        self._finishing = False
        # Run (with None, or the stream's error) once the pending batch is written.
        self._callbacks: list[Callable[[BaseException | None], None]] = []
        # The callbacks of the batch being written.
        self._writing: list[Callable[[BaseException | None], None]] = []
        self._wake = asyncio.Event()
        self._error: RpcError | None = None

    def push(
        self,
        tag: int,
        msg: types_pb2.RequestOutput,
        on_written: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Puts msg's entries in the next batch. A finished msg is the request's last: its end goes
        in the same batch. on_written(None) runs once that batch is written, on_written(error) if
        the stream closes first."""
        if self._error is not None:
            raise self._error
        self._outputs.extend(engine_outputs(tag, msg))
        if msg.finished:
            self._ended.append(tag)
        if on_written is not None:
            self._callbacks.append(on_written)
        self._wake.set()

    def push_tokens(
        self,
        tag: int,
        token_ids: list[int],
        cumulative_logprob: float,
        on_written: Callable[[BaseException | None], None],
    ) -> None:
        """push of a step that made token_ids in sequence 0 and nothing else (not the request's
        last), without the message: its entry is made here."""
        if self._error is not None:
            raise self._error
        self._outputs.append(token_entry(tag, token_ids, cumulative_logprob))
        self._callbacks.append(on_written)
        self._wake.set()

    def fail(
        self,
        tag: int,
        code: grpc.StatusCode,
        details: str,
        retry_pushback_ms: int = 0,
        refused: bool = False,
        reason: str = "",
    ) -> None:
        """The request of tag ended with an error status (after whatever it pushed before);
        refused: it never started (the caller may send it again elsewhere); reason: what failed
        (SessionFailure.reason)."""
        if self._error is None:
            self._failed.append(
                worker_pb2.SessionFailure(
                    tag=tag,
                    code=code.value[0],
                    details=details,
                    retry_pushback_ms=retry_pushback_ms,
                    refused=refused,
                    reason=reason,
                )
            )
            self._wake.set()

    def finish(self) -> None:
        """Ends the stream well once what is pending is written (the caller sends no more requests
        and the last of its requests has ended)."""
        self._finishing = True
        self._wake.set()

    async def batches(self):
        """The Session call's messages: the stream id, then a batch whenever outputs are pending,
        until the stream closes (or finishes)."""
        yield worker_pb2.EngineOutputs(
            stream_id=self.stream_id,
            max_request_bytes=self.max_request_bytes,
            max_requests=self.max_requests,
            takes_handoffs=True,
        )
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._error is not None:
                    return
                if not self._outputs and not self._ended and not self._failed:
                    if self._finishing:
                        return
                    continue
                batch = worker_pb2.EngineOutputs(
                    outputs=self._outputs, ended=self._ended, failed=self._failed
                )
                self._writing, self._callbacks = self._callbacks, []
                self._outputs, self._ended, self._failed = [], [], []
                yield batch
                writing, self._writing = self._writing, []
                for callback in writing:
                    callback(None)
                if self._finishing:
                    self._wake.set()  # once more round: it returns when nothing came meanwhile
        finally:
            self.close()

    def close(self) -> None:
        """Fails what was pushed and not written; later pushes raise. Idempotent."""
        if self._error is None:
            self._error = unavailable(f"session {self.stream_id} closed (its caller went away)")
        callbacks = self._writing + self._callbacks
        self._writing, self._callbacks = [], []
        self._wake.set()  # the writer returns
        for callback in callbacks:
            callback(self._error)

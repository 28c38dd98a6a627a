"""RequestOutput helpers shared by workers and the router (no torch)."""

from __future__ import annotations

from tandem.v1 import types_pb2


def merge_outputs(messages: list[types_pb2.RequestOutput]) -> types_pb2.RequestOutput:
    """Folds a request's streamed messages into one (non-streaming Generate). Linear in the
    total size: text pieces and ids are collected first and set once per sequence."""
    merged = types_pb2.RequestOutput()
    last: dict[int, types_pb2.CompletionOutput] = {}
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    logprobs: dict[int, list[types_pb2.TokenLogprobs]] = {}
    for msg in messages:
        head = types_pb2.RequestOutput()
        head.CopyFrom(msg)
        head.ClearField("outputs")
        merged.MergeFrom(head)
        for out in msg.outputs:
            last.setdefault(out.index, types_pb2.CompletionOutput(index=out.index)).MergeFrom(out)
            texts.setdefault(out.index, []).append(out.text)
            ids.setdefault(out.index, []).extend(out.token_ids)
            logprobs.setdefault(out.index, []).extend(out.logprobs)
    for index in sorted(last):
        out = merged.outputs.add()
        out.CopyFrom(last[index])
        out.text = "".join(texts[index])
        del out.token_ids[:]
        out.token_ids.extend(ids[index])
        del out.logprobs[:]
        out.logprobs.extend(logprobs[index])
    return merged


class TokenInterval:
    """A streamed request's messages, merged so that each carries at least interval new tokens
    (the router's --stream-interval, SGLang's and vLLM's stream interval): fewer, larger
    messages for the same tokens. The first message goes on at once (time to first token), the
    last with whatever is held; tokens held when the stream fails go on before its error
    (flush). There is no timer: tokens wait for the next ones at most interval - 1 engine steps."""

    def __init__(self, interval: int):
        self.interval = interval
        self._held: list[types_pb2.RequestOutput] = []
        self._num_held = 0
        self._first = True

    def add(self, msg: types_pb2.RequestOutput) -> types_pb2.RequestOutput | None:
        """The message to send now, if msg makes one."""
        self._held.append(msg)
        if self._first or msg.finished:
            self._first = False
            return self.flush()
        for out in msg.outputs:
            self._num_held += len(out.token_ids)
        return self.flush() if self._num_held >= self.interval else None

    def flush(self) -> types_pb2.RequestOutput | None:
        """What is held, as one message (None when nothing is)."""
        if not self._held:
            return None
        out = merged(self._held)
        self._held, self._num_held = [], 0
        return out


def merged(messages: list[types_pb2.RequestOutput]) -> types_pb2.RequestOutput:
    """The one message that stands for messages (itself when there is one)."""
    return messages[0] if len(messages) == 1 else merge_outputs(messages)


def cancelled_output(request_id: str) -> types_pb2.RequestOutput:
    """The last message of a request aborted before its worker could say so itself."""
    out = types_pb2.RequestOutput(request_id=request_id, finished=True)
    out.outputs.add(index=0, finish_reason=types_pb2.FINISH_REASON_CANCELLED)
    return out

"""The text front of a process that faces clients: prompts in (tokenized here), text out.

Behind it, producers see token ids only: the request they get has its prompt as ids, no
stop strings and detokenize off, and always streams, so that a stop string can stop the
producer early; a client that did not ask to stream gets one merged message at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tandem.common.limits import (
    RequestLimits,
    check_prompt_size,
    check_prompt_tokens,
    check_request,
)
from tandem.common.metrics import RequestTracker
from tandem.common.outputs import TokenInterval, merge_outputs
from tandem.common.streams import closing
from tandem.text.processor import StopCallback, TextOptions, TextProcessor
from tandem.text.tokenizer import Tokenizer
from tandem.v1 import llm_pb2, types_pb2

# Prompts longer than this are tokenized on a worker thread, not on the event loop.
_INLINE_TOKENIZE_CHARS = 4096


def _opt(msg, name: str, default):
    return getattr(msg, name) if msg.HasField(name) else default


@dataclass
class TextRequest:
    """What the front made of a client's GenerateRequest."""

    engine_request: llm_pb2.GenerateRequest
    processor: TextProcessor
    streaming: bool

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.engine_request.prompt.token_ids.ids)


class TextFront:
    def __init__(
        self, tokenizer: Tokenizer, limits: RequestLimits | None = None, max_model_len: int = 0
    ):
        """max_model_len: the served model's context, when known here (0: the worker checks it)."""
        self.tokenizer = tokenizer
        self.limits = limits or RequestLimits()
        self.max_model_len = max_model_len

    async def encode_prompt(
        self, prompt: types_pb2.Prompt, add_special_tokens: bool
    ) -> tuple[list[int], str | None]:
        """(token ids, prompt text or None); a prompt over the limits is refused before it is tokenized."""
        check_prompt_size(prompt, self.limits)
        kind = prompt.WhichOneof("kind")
        if kind == "text":
            if not prompt.text:
                raise ValueError("the prompt is empty: give text or token ids")
            if len(prompt.text) > _INLINE_TOKENIZE_CHARS:
                return await asyncio.to_thread(
                    self.tokenizer.encode_long, prompt.text, add_special_tokens
                ), prompt.text
            return self.tokenizer.encode(prompt.text, add_special_tokens), prompt.text
        if kind == "token_ids":
            return list(prompt.token_ids.ids), None
        if kind == "preprocessed":
            p = prompt.preprocessed
            return list(p.prompt_token_ids), (p.prompt if p.HasField("prompt") else None)
        raise ValueError(
            "the prompt is empty: set prompt.text, prompt.token_ids or prompt.preprocessed"
        )

    async def prepare(self, request: llm_pb2.GenerateRequest) -> TextRequest:
        params = request.sampling_params
        check_request(request, self.limits)
        ids, text = await self.encode_prompt(
            request.prompt, _opt(params, "add_special_tokens", True)
        )
        if params.HasField("truncate_prompt_tokens"):
            if params.truncate_prompt_tokens <= 0:
                raise ValueError(
                    f"truncate_prompt_tokens must be > 0, got {params.truncate_prompt_tokens}"
                )
            ids = ids[-params.truncate_prompt_tokens :]
        check_prompt_tokens(len(ids), self.limits, self.max_model_len)
        detokenize = _opt(params, "detokenize", True)
        stop = tuple(params.stop) if detokenize else ()
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        # exclude_input_from_output=False: the prompt heads each sequence's token_ids (and text).
        prefix = tuple(ids) if not _opt(params, "exclude_input_from_output", True) else ()
        options = TextOptions(
            detokenize=detokenize,
            skip_special_tokens=_opt(params, "skip_special_tokens", True),
            stop=stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            strip_logprobs=bool(stop) and not params.HasField("logprobs"),
            prefix_token_ids=prefix,
        )
        engine_request = llm_pb2.GenerateRequest()
        engine_request.CopyFrom(request)
        if request.prompt.WhichOneof("kind") != "token_ids" or len(ids) != len(
            request.prompt.token_ids.ids
        ):  # token ids as given need no copy back (a long prompt's ids are most of the request)
            engine_request.prompt.token_ids.ids[:] = ids
        engine_request.streaming = True
        engine_params = engine_request.sampling_params
        engine_params.detokenize = False
        engine_params.ClearField("truncate_prompt_tokens")
        engine_params.ClearField("exclude_input_from_output")
        del engine_params.stop[:]
        if options.strip_logprobs:
            engine_params.logprobs = 0
        # A generation_only output starts with the context phase's tokens: its text is detokenized
        # from them on, as an aggregated run's is.
        processor = TextProcessor(
            self.tokenizer, options, text, num_sequences=max(1, _opt(params, "n", 1))
        )
        return TextRequest(engine_request, processor, request.streaming)

    @staticmethod
    async def respond(
        text_request: TextRequest,
        messages: AsyncIterator[types_pb2.RequestOutput],
        on_stop: StopCallback,
        tracker: RequestTracker,
        stream_interval: int = 1,
    ) -> AsyncIterator[types_pb2.RequestOutput]:
        """The client's messages from the producer's token-id messages (ClientStream), with
        on_stop stopping the producer's sequence where a stop string ends it. One generator: the
        only layer between the producer and the call's handler (the router's handler runs the
        same loop itself, and so saves this layer)."""
        stream = ClientStream(text_request, tracker, stream_interval)
        try:
            async with closing(messages) as messages:
                async for msg in messages:
                    out, stops = stream.feed(msg)
                    for index, handoff in stops:
                        await on_stop(index, handoff)
                    out = stream.send(out)
                    if out is not None:
                        yield out
                    if stream.done:
                        break
            last = stream.finish()
            if last is not None:
                yield last
        except Exception:
            held = stream.held()
            if held is not None:  # what arrived before the failure is the client's
                yield held
            raise

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of vocabulary [0, {vocab}): {bad[:8]}")
        return self.tokenizer.decode(token_ids, skip_special_tokens)


class ClientStream:
    """A request's client-facing messages from its producer's token-id messages: text added, stop
    strings applied, merged into one unless streaming (or into messages of stream_interval tokens
    or more), counted by tracker. Its owner's loop feeds it each message, stops the sequences
    feed names, then sends on what send hands back."""

    __slots__ = ("processor", "tracker", "num_prompt_tokens", "unstreamed", "interval")

    def __init__(
        self, text_request: TextRequest, tracker: RequestTracker, stream_interval: int = 1
    ):
        self.processor = text_request.processor
        self.tracker = tracker
        self.num_prompt_tokens = len(text_request.prompt_token_ids)
        # A client that did not ask to stream gets one merged message at the end.
        self.unstreamed: list[types_pb2.RequestOutput] | None = (
            None if text_request.streaming else []
        )
        self.interval = (
            TokenInterval(stream_interval)
            if text_request.streaming and stream_interval > 1
            else None
        )

    def feed(self, msg: types_pb2.RequestOutput):
        """(msg with its text, or None while the text front holds it; the (index, handoff) of
        each sequence a stop string ended in it: stop them before sending the message on)."""
        self.tracker.saw(msg)
        return self.processor.feed(msg)

    def send(self, out: types_pb2.RequestOutput | None) -> types_pb2.RequestOutput | None:
        """What of out goes to the client now."""
        if out is None:
            return None
        if self.unstreamed is not None:
            self.unstreamed.append(out)
            return None
        if self.interval is not None:
            out = self.interval.add(out)
            if out is None:
                return None
        self.tracker.counted(out, self.num_prompt_tokens)
        return out

    @property
    def done(self) -> bool:
        """Every sequence has ended (a stop string ends one before its producer does)."""
        return self.processor.done

    def finish(self) -> types_pb2.RequestOutput | None:
        """The last message, after the producer's last (or once done)."""
        last = self.processor.finish()
        if self.unstreamed is not None:
            if last is not None:
                self.unstreamed.append(last)
            last = merge_outputs(self.unstreamed)
        elif self.interval is not None:
            last = self.interval.flush() if last is None else self.interval.add(last)
        if last is not None:
            self.tracker.counted(last, self.num_prompt_tokens)
        return last

    def held(self) -> types_pb2.RequestOutput | None:
        """After the producer failed: what arrived before the failure and was held back for the
        stream interval (the client's before the error)."""
        held = self.interval.flush() if self.interval is not None else None
        if held is not None:
            self.tracker.counted(held, self.num_prompt_tokens)
        return held

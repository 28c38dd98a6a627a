"""One Generate call on a worker: runs the request's n sequences in the engine and
turns their step outputs into RequestOutput messages."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from tandem.engine.llm_engine import StepOutput
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.sequence import FinishReason, Phase
from tandem.worker.convert import FINISH_REASONS, logprobs_proto
from tandem.worker.detokenizer import IncrementalDetokenizer
from tandem.worker.engine_loop import EngineFailure, EngineLoop
from tandem.worker.tokenizer import Tokenizer
from tandem.v1 import types_pb2

# Put on a request's stream by Abort / PauseGeneration.
CANCELLED = object()


@dataclasses.dataclass
class _SequenceState:
    index: int
    engine_id: str
    detokenizer: IncrementalDetokenizer | None
    finished: bool = False
    num_tokens: int = 0


class GenerateCall:
    def __init__(self, engine_loop: EngineLoop, tokenizer: Tokenizer, request_id: str, prompt_token_ids: list[int],
                 prompt_text: str | None, options: SamplingOptions, phase: Phase, priority: float,
                 cache_salt: str | None, streaming: bool):
        self.engine_loop = engine_loop
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.options = options
        self.streaming = streaming
        self.stream: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.num_cached_prompt_tokens = 0
        self.sequences: dict[str, _SequenceState] = {}
        for i in range(options.n):
            engine_id = request_id if options.n == 1 else f"{request_id}#{i}"
            opts = options if options.seed is None or i == 0 else dataclasses.replace(options, seed=options.seed + i)
            detok = (IncrementalDetokenizer(tokenizer, opts.skip_special_tokens, opts.stop, opts.include_stop_str_in_output)
                     if opts.detokenize else None)
            self.sequences[engine_id] = _SequenceState(i, engine_id, detok)
            engine_loop.add_request(engine_id, stream=self.stream, prompt_token_ids=prompt_token_ids,
                                    options=dataclasses.replace(opts, n=1), phase=phase, priority=priority,
                                    cache_salt=cache_salt)

    @property
    def is_finished(self) -> bool:
        return all(s.finished for s in self.sequences.values())

    def cancel(self) -> None:
        """Abort every unfinished sequence; the stream then ends with finish_reason cancelled."""
        for state in self.sequences.values():
            if not state.finished:
                self.engine_loop.abort(state.engine_id)
        self.stream.put_nowait(CANCELLED)

    async def outputs(self):
        """Yields RequestOutput messages: one per engine step batch when streaming, else one at the end."""
        pending: list[types_pb2.RequestOutput] = []
        first = True
        try:
            while not self.is_finished:
                items = [await self.stream.get()]
                while not self.stream.empty():
                    items.append(self.stream.get_nowait())
                msg = self._message(items, first)
                first = False
                if self.streaming:
                    yield msg
                else:
                    pending.append(msg)
        finally:
            for state in self.sequences.values():
                if not state.finished:
                    self.engine_loop.abort(state.engine_id)
        if not self.streaming:
            yield _merge(pending)

    def _message(self, items: list, first: bool) -> types_pb2.RequestOutput:
        by_seq: dict[str, types_pb2.CompletionOutput] = {}
        for item in items:
            if item is CANCELLED:
                for state in self.sequences.values():
                    if not state.finished:
                        state.finished = True
                        out = self._completion(by_seq, state)
                        out.finish_reason = types_pb2.FINISH_REASON_CANCELLED
                continue
            if isinstance(item, EngineFailure):
                raise item.error
            self._apply(by_seq, item)
        msg = types_pb2.RequestOutput(request_id=self.request_id, finished=self.is_finished,
                                      outputs=sorted(by_seq.values(), key=lambda o: o.index))
        if first:
            msg.prompt_token_ids.extend(self.prompt_token_ids)
            if self.prompt_text is not None:
                msg.prompt = self.prompt_text
        if msg.finished:
            now = time.monotonic()
            metrics = msg.metrics
            metrics.time_to_first_token_s = (self.first_token_at or now) - self.arrival
            metrics.e2e_latency_s = now - self.arrival
            metrics.num_cached_prompt_tokens = self.num_cached_prompt_tokens
            metrics.num_computed_prompt_tokens = len(self.prompt_token_ids) - self.num_cached_prompt_tokens
        return msg

    def _completion(self, by_seq: dict, state: _SequenceState) -> types_pb2.CompletionOutput:
        if state.engine_id not in by_seq:
            by_seq[state.engine_id] = types_pb2.CompletionOutput(index=state.index)
        return by_seq[state.engine_id]

    def _apply(self, by_seq: dict, out: StepOutput) -> None:
        state = self.sequences.get(out.request_id)
        if state is None or state.finished:
            return  # a token that raced with a stop string
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.num_cached_prompt_tokens = out.num_cached_prompt_tokens
        comp = self._completion(by_seq, state)
        comp.token_ids.extend(out.new_token_ids)
        comp.cumulative_logprob = out.cumulative_logprob
        if self.options.logprobs is not None:
            comp.logprobs.extend(logprobs_proto(e) for e in out.new_logprobs)
        state.num_tokens += len(out.new_token_ids)
        finish_reason = out.finish_reason if out.finished else None
        if state.detokenizer is not None:
            comp.text += state.detokenizer.add(out.new_token_ids, final=out.finished)
            if state.detokenizer.stop_string is not None and not out.finished:
                self.engine_loop.abort(state.engine_id)
                finish_reason = FinishReason.STOP
            if state.detokenizer.stop_string is not None:
                comp.stop_string = state.detokenizer.stop_string
                finish_reason = FinishReason.STOP
        if finish_reason is not None:
            state.finished = True
            comp.finish_reason = FINISH_REASONS[finish_reason]
            if out.stop_token_id is not None and not comp.HasField("stop_string"):
                comp.stop_token_id = out.stop_token_id


def _merge(messages: list[types_pb2.RequestOutput]) -> types_pb2.RequestOutput:
    """Folds a request's streamed messages into one (non-streaming Generate)."""
    merged = types_pb2.RequestOutput()
    by_index: dict[int, types_pb2.CompletionOutput] = {}
    for msg in messages:
        outputs = list(msg.outputs)
        msg.ClearField("outputs")
        merged.MergeFrom(msg)
        for out in outputs:
            target = by_index.setdefault(out.index, types_pb2.CompletionOutput(index=out.index))
            text, ids, lps = target.text + out.text, list(target.token_ids) + list(out.token_ids), list(target.logprobs) + list(out.logprobs)
            target.MergeFrom(out)
            target.text = text
            del target.token_ids[:]
            target.token_ids.extend(ids)
            del target.logprobs[:]
            target.logprobs.extend(lps)
    merged.outputs.extend(by_index[i] for i in sorted(by_index))
    return merged

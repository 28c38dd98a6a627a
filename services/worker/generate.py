"""One Generate call on a worker: runs the request's n sequences in the engine and
turns their step outputs into RequestOutput messages."""
from __future__ import annotations

import asyncio
import dataclasses
import time

from tandem.common.outputs import merge_outputs
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
# Seconds of lease a KV pull needs left to start; with less the decode computes the prompt itself.
LEASE_SAFETY_MARGIN_S = 1.0


@dataclasses.dataclass
class _SequenceState:
    index: int
    engine_id: str
    detokenizer: IncrementalDetokenizer | None
    options: SamplingOptions
    finished: bool = False
    num_tokens: int = 0


class GenerateCall:
    """phase picks the lifecycle: CONTEXT_AND_GENERATION runs everything here; CONTEXT_ONLY ends
    with the first token and a handoff (handoff_keeper); GENERATION_ONLY starts from a handoff
    whose KV start_import() pulls (first_token_ids are the tokens the context phase produced)."""

    def __init__(self, engine_loop: EngineLoop, tokenizer: Tokenizer, request_id: str, prompt_token_ids: list[int],
                 prompt_text: str | None, options: SamplingOptions, phase: Phase, priority: float,
                 cache_salt: str | None, streaming: bool, disaggregated_params: types_pb2.DisaggregatedParams | None = None,
                 handoff_keeper=None):
        if options.n > 1 and phase is not Phase.CONTEXT_AND_GENERATION:
            raise NotImplementedError("n > 1 is not supported with disaggregated serving yet; use n=1 or an aggregated worker")
        self.engine_loop = engine_loop
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.options = options
        self.phase = phase
        self.priority = priority
        self.cache_salt = cache_salt
        self.streaming = streaming
        self.disagg_in = disaggregated_params or types_pb2.DisaggregatedParams()
        self.handoff_keeper = handoff_keeper
        self.stream: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.num_cached_prompt_tokens = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_s = 0.0
        self._undelivered_handoffs: list[int] = []
        self._import_task: asyncio.Task | None = None
        self.sequences: dict[str, _SequenceState] = {}
        for i in range(options.n):
            engine_id = request_id if options.n == 1 else f"{request_id}#{i}"
            opts = options if options.seed is None or i == 0 else dataclasses.replace(options, seed=options.seed + i)
            detok = (IncrementalDetokenizer(tokenizer, opts.skip_special_tokens, opts.stop, opts.include_stop_str_in_output)
                     if opts.detokenize else None)
            self.sequences[engine_id] = _SequenceState(i, engine_id, detok, options=dataclasses.replace(opts, n=1))

    def submit(self) -> None:
        for state in self.sequences.values():
            self.engine_loop.add_request(state.engine_id, stream=self.stream, prompt_token_ids=self.prompt_token_ids,
                                         options=state.options, phase=self.phase, priority=self.priority,
                                         cache_salt=self.cache_salt)

    def resume(self) -> None:
        """GENERATION_ONLY without a handoff: carry on after first_gen_tokens, recomputing the KV here
        (a request migrated from a worker that died)."""
        (state,) = self.sequences.values()
        first = list(self.disagg_in.first_gen_tokens)
        self._prime(state, first)
        self.engine_loop.add_request(state.engine_id, stream=self.stream, prompt_token_ids=self.prompt_token_ids,
                                     options=state.options, phase=Phase.CONTEXT_AND_GENERATION, priority=self.priority,
                                     cache_salt=self.cache_salt, output_token_ids=first)

    def _prime(self, state: _SequenceState, tokens: list[int]) -> None:
        """Feeds tokens another worker already streamed, one at a time as it did, so the
        text held back here is exactly what it held back."""
        if state.detokenizer is not None:
            for token in tokens:
                state.detokenizer.add([token])
        state.num_tokens = len(tokens)

    def start_import(self, importer, handoff) -> None:
        """GENERATION_ONLY: reserve blocks, pull the prompt's KV, then let the engine decode."""
        (state,) = self.sequences.values()
        first = list(self.disagg_in.first_gen_tokens)
        self._prime(state, first)  # the context phase already streamed this text
        self.engine_loop.register(state.engine_id, self.stream)
        self._import_task = asyncio.create_task(self._import(importer, handoff, state, first))

    async def _import(self, importer, handoff, state: _SequenceState, first: list[int]) -> None:
        rid = state.engine_id
        try:
            plan = None
            # A lease about to run out may be freed (and its blocks reused) while we read.
            if handoff.lease_expires_at - time.time() > LEASE_SAFETY_MARGIN_S:
                plan = await self.engine_loop.call(lambda e: e.reserve_import(
                    rid, self.prompt_token_ids, first, state.options, self.priority, self.cache_salt))
            if plan is None:
                # No room for the prompt's KV now (or no time): compute it here, and let the
                # prefill free its copy at once.
                self.engine_loop.add_request(rid, stream=self.stream, prompt_token_ids=self.prompt_token_ids,
                                             options=state.options, phase=self.phase, priority=self.priority,
                                             cache_salt=self.cache_salt, output_token_ids=first)
                await importer.release_remote(handoff)
                return
            self.kv_transfer_bytes, self.kv_transfer_s = await importer.pull(handoff, plan)
            self.num_cached_prompt_tokens = len(self.prompt_token_ids)
            await self.engine_loop.call(lambda e: e.complete_import(rid))
        except asyncio.CancelledError:
            # Queued after our reserve_import, so it frees whatever that reserved.
            self.engine_loop.abort(rid)
            raise
        except Exception as exc:  # noqa: BLE001 - the request fails with exc's status
            self.engine_loop.abort(rid)  # stops routing outputs to our stream, so tell it directly
            self.stream.put_nowait(EngineFailure(exc))

    @property
    def is_finished(self) -> bool:
        return all(s.finished for s in self.sequences.values())

    def cancel(self) -> None:
        """Abort every unfinished sequence; the stream then ends with finish_reason cancelled."""
        if self._import_task is not None:
            self._import_task.cancel()
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
                    self._undelivered_handoffs.clear()
                else:
                    pending.append(msg)
            if not self.streaming:
                yield merge_outputs(pending)
                self._undelivered_handoffs.clear()
        finally:
            if self._import_task is not None:
                self._import_task.cancel()
            for state in self.sequences.values():
                if not state.finished:
                    self.engine_loop.abort(state.engine_id)
            for ctx_request_id in self._undelivered_handoffs:
                # Nobody will ever pull a handoff the caller did not receive.
                asyncio.ensure_future(self.handoff_keeper.release(ctx_request_id))

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
            metrics.kv_transfer_bytes = self.kv_transfer_bytes
            metrics.kv_transfer_s = self.kv_transfer_s
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
        self.num_cached_prompt_tokens = max(self.num_cached_prompt_tokens, out.num_cached_prompt_tokens)
        comp = self._completion(by_seq, state)
        comp.token_ids.extend(out.new_token_ids)
        comp.cumulative_logprob = out.cumulative_logprob
        if self.options.logprobs is not None:
            comp.logprobs.extend(logprobs_proto(e) for e in out.new_logprobs)
        state.num_tokens += len(out.new_token_ids)
        finish_reason = out.finish_reason if out.finished else None
        if state.detokenizer is not None:
            # A handoff is not the end of the text: the decode side holds back what we would hold back.
            final = out.finished and out.handoff_block_ids is None
            comp.text += state.detokenizer.add(out.new_token_ids, final=final)
            if state.detokenizer.stop_string is not None and not out.finished:
                self.engine_loop.abort(state.engine_id)
                finish_reason = FinishReason.STOP
            if state.detokenizer.stop_string is not None:
                comp.stop_string = state.detokenizer.stop_string
                finish_reason = FinishReason.STOP
        if out.handoff_block_ids is not None:
            if finish_reason is FinishReason.STOP:
                self.engine_loop.abort(state.engine_id)  # a stop string in the first token: nothing to hand off
            else:
                self._hand_off(comp, out)
            state.finished = True
        if finish_reason is not None:
            state.finished = True
            comp.finish_reason = FINISH_REASONS[finish_reason]
            if out.stop_token_id is not None and not comp.HasField("stop_string"):
                comp.stop_token_id = out.stop_token_id

    def _hand_off(self, comp: types_pb2.CompletionOutput, out: StepOutput) -> None:
        """CONTEXT_ONLY done: the first token plus where its KV is. finish_reason stays unset:
        the request continues on a decode worker."""
        ctx_request_id, opaque = self.handoff_keeper.handoff(out.request_id, out.handoff_block_ids,
                                                            self.prompt_token_ids, self.cache_salt,
                                                            out.lease_expires_at)
        self._undelivered_handoffs.append(ctx_request_id)
        params = comp.disaggregated_params
        params.request_type = types_pb2.REQUEST_TYPE_CONTEXT_ONLY
        params.first_gen_tokens.extend(out.new_token_ids)
        params.ctx_request_id = ctx_request_id
        params.opaque_state = opaque
        params.ctx_endpoint = self.handoff_keeper.endpoint
        if self.disagg_in.HasField("disagg_request_id"):
            params.disagg_request_id = self.disagg_in.disagg_request_id

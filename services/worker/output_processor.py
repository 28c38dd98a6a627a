"""One Generate on a worker: its n sequences in the engine, their step outputs turned into
RequestOutput messages of token ids (text is the front's job: tandem.text).

Which lifecycle the request runs is the phase's business (worker/phases.py, prefill/context.py,
decode/generation.py); this class only carries the sequences' state and builds messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import AddRequest, EngineFailure, StepOutput
from tandem.engine.sampling_options import SamplingOptions, for_generation_phase
from tandem.engine.sequence import FinishReason, Phase, natural_finish
from tandem.engine.sequence_perf import SequencePerf
from tandem.v1 import types_pb2
from tandem.worker.perf_message import perf_metrics

FINISH_REASONS = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: types_pb2.FINISH_REASON_CANCELLED,
}


def _entry_logprob(entry: types_pb2.TokenLogprobs, token: int) -> float | None:
    return entry.logprobs[token] if token in entry.logprobs else None


# Put on a request's stream by Abort / PauseGeneration.
CANCELLED = object()


@dataclasses.dataclass(frozen=True)
class SequenceStopped:
    """Put on a request's stream when the front stops one of its sequences (a stop string)."""

    engine_id: str


@dataclasses.dataclass
class SequenceState:
    index: int
    engine_id: str
    options: SamplingOptions
    finished: bool = False
    # The lease of a context phase handed off in this sequence's output, until the caller has it.
    undelivered_lease: int | None = None
    # Its first message went out (a generation_only output starts with first_gen_tokens).
    started: bool = False
    # The engine's latest perf metrics of it (return_perf_metrics), for the message that ends it.
    perf: SequencePerf | None = None


@dataclasses.dataclass
class RequestMetricsState:
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    # The same moment on the wall clock, and the KV pull's window (the perf metrics' times).
    arrival_time: float = dataclasses.field(default_factory=time.time)
    first_token_at: float | None = None
    # When the engine first scheduled it (time.monotonic; None: not yet), and when it ended.
    scheduled_at: float | None = None
    finished_at: float | None = None
    num_cached_prompt_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_start: float = 0.0
    kv_transfer_end: float = 0.0
    # How its KV handoff ended here (a decode's generation phase), a types_pb2.KvHandoffMetrics,
    # and how long it waited for room in the pool first.
    kv_handoff: types_pb2.KvHandoffMetrics | None = None
    room_wait_s: float = 0.0
    # Its blocks were reserved when the router announced it, before its handoff came.
    reserved_early: bool = False
    # Its handoff came from the prefill itself (Worker/HandOff), ahead of the router's.
    handoff_from_prefill: bool = False
    # How its cross-worker prefix pull ended (decode/prefix_pull.py), where the router asked for one.
    prefix_pull: types_pb2.PrefixPullMetrics | None = None


class WorkerRequest:
    def __init__(
        self,
        core: EngineCore,
        request_id: str,
        prompt_token_ids: list[int],
        options: SamplingOptions,
        phase: Phase,
        priority: float,
        cache_salt: str | None,
        disaggregated_params: types_pb2.DisaggregatedParams | None = None,
        adapter=None,
        return_first_gen_tokens: bool = True,
    ):
        if options.n > 1 and phase is not Phase.CONTEXT_AND_GENERATION:
            raise NotImplementedError(
                "n > 1 is not supported with disaggregated serving yet; use n=1 or an aggregated worker"
            )
        self.disagg_in = disaggregated_params or types_pb2.DisaggregatedParams()
        # A generation_only output starts with the tokens the context phase sampled (TensorRT-LLM's
        # generation output holds the first token too), with their logprobs when the handoff has
        # them, unless its caller streamed them already (the router's split and migrations).
        self.returns_first_tokens = return_first_gen_tokens
        self.first_tokens: list[int] = (
            list(self.disagg_in.first_gen_tokens) if phase is Phase.GENERATION_ONLY else []
        )
        self.first_logprobs = list(self.disagg_in.first_gen_log_probs)[: len(self.first_tokens)]
        known = [_entry_logprob(e, t) for e, t in zip(self.first_logprobs, self.first_tokens)]
        self.first_cumulative = (
            sum(known) if len(known) == len(self.first_tokens) and None not in known else 0.0
        )
        if phase is Phase.GENERATION_ONLY:
            options = for_generation_phase(options)
        self.core = core
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.options = options
        self.phase = phase
        self.priority = priority
        self.cache_salt = cache_salt
        # The LoRA adapter (engine.lora_adapter.LoRAAdapter) every sequence runs with, or None.
        self.adapter = adapter
        # The caller that started the request (the only one that may abort it), and the client
        # its context phase's handoff is for (None: the router's own split).
        self.owner = ""
        self.client: str | None = None
        # The client the request is made for, on every leg (a split's too): an Abort that another
        # router passes on names it (WorkerServicer.Abort).
        self.requester: str | None = None
        self.stream: asyncio.Queue = asyncio.Queue()
        self.metrics = RequestMetricsState()
        # W3C trace context of the request's span here (common/tracing.py; empty: untraced).
        self.trace_headers: dict[str, str] = {}
        # The router's split, its generation phase announced to a decode worker: that worker's
        # address, where a context phase sends its handoff too (prefill/context.py); or "".
        self.hand_off_to = ""
        # Set by a context phase: turns a handed-off output into the caller's DisaggregatedParams,
        # and gives a lease back when its handoff never reaches the caller.
        self.hand_off: Callable[[StepOutput], types_pb2.DisaggregatedParams] | None = None
        self.withdraw: Callable[..., None] | None = None
        # Work started on the request's behalf outside the engine (a KV pull), cancelled with it.
        self.tasks: list[asyncio.Task] = []
        # Set where the router named a peer to pull the prompt's prefix from (decode/prefix_pull.py):
        # the first submit() loads the prefix there first (an async function of the phase).
        self.load_prefix: Callable[[Phase], Awaitable[None]] | None = None
        # Run when the call is over (a context phase's admission ends).
        self.on_close: list[Callable[[], None]] = []
        self.sequences: dict[str, SequenceState] = {}
        self.beam_search = options.beam_width > 1
        if (
            self.beam_search
        ):  # one engine request searches the beams; its output holds the n returned
            if phase is not Phase.CONTEXT_AND_GENERATION:
                raise NotImplementedError(
                    "use_beam_search runs on an aggregated worker (it is not split over "
                    "prefill and decode yet)"
                )
            self.sequences[request_id] = SequenceState(0, request_id, options)
        # The prompt's logprobs (prompt_logprobs), from the first sequence that has them, sent once.
        self.prompt_logprobs_sent = False
        self.pending_prompt_logprobs: list[types_pb2.TokenLogprobs] = []
        self.context_logits_sent = False
        self.pending_context_logits: list[types_pb2.LogitsRow] = []
        for i in range(0 if self.beam_search else options.n):
            engine_id = request_id if options.n == 1 else f"{request_id}#{i}"
            opts = (
                options
                if options.seed is None or i == 0
                else dataclasses.replace(options, seed=options.seed + i)
            )
            if opts.n != 1:
                opts = dataclasses.replace(opts, n=1)
            self.sequences[engine_id] = SequenceState(i, engine_id, opts)

    @property
    def only_sequence(self) -> SequenceState:
        (state,) = self.sequences.values()
        return state

    @property
    def first_gen_tokens(self) -> list[int]:
        return list(self.disagg_in.first_gen_tokens)

    def finish_if_first_tokens_end(self) -> bool:
        """generation_only: when the context phase's tokens already end the sequence (max_tokens=1,
        EOS, a stop token), it ends here with them and nothing runs. Returns whether it did."""
        state = self.only_sequence
        reason, stop_token = natural_finish(
            state.options,
            len(self.prompt_token_ids),
            self.first_tokens,
            self.core.facts.limits.max_model_len,
        )
        if reason is None:
            return False
        self.stream.put_nowait(StepOutput(state.engine_id, [], [], 0.0, True, reason, stop_token))
        return True

    def submit(self, phase: Phase, output_token_ids: list[int] | None = None) -> None:
        """Queues every sequence in the engine (after pulling its prefix, where load_prefix is set:
        the pull submits it, with or without the prefix)."""
        if self.load_prefix is not None and not output_token_ids:
            load, self.load_prefix = self.load_prefix, None
            self.tasks.append(asyncio.create_task(load(phase)))
            return
        for state in self.sequences.values():
            self.core.add_request(
                AddRequest(
                    state.engine_id,
                    self.prompt_token_ids,
                    state.options,
                    phase=phase,
                    priority=self.priority,
                    cache_salt=self.cache_salt,
                    output_token_ids=list(output_token_ids or []),
                    adapter=self.adapter,
                ),
                self.stream,
            )

    def fail(self, exc: BaseException) -> None:
        """Ends the request with exc's status (its engine side is aborted by the caller)."""
        self.stream.put_nowait(EngineFailure(exc))

    @property
    def is_finished(self) -> bool:
        return all(s.finished for s in self.sequences.values())

    def cancel(self) -> None:
        """Abort every unfinished sequence; the stream then ends with finish_reason cancelled."""
        for task in self.tasks:
            task.cancel()
        for state in self.sequences.values():
            if not state.finished:
                self.core.abort(state.engine_id)
        self.stream.put_nowait(CANCELLED)

    async def stop(self, index: int, handoff: types_pb2.DisaggregatedParams | None = None) -> None:
        """The front ended sequence `index` (a stop string): abort it, or give back the lease its
        withheld handoff names."""
        for state in self.sequences.values():
            if state.index != index:
                continue
            if state.undelivered_lease is not None and self.withdraw is not None:
                self.withdraw(state.undelivered_lease, stopped=True)
                state.undelivered_lease = None
            elif not state.finished:
                self.core.abort(state.engine_id)
                self.stream.put_nowait(SequenceStopped(state.engine_id))

    async def outputs(self):
        """Yields one RequestOutput per batch of engine outputs, until every sequence is done."""
        first = True
        while not self.is_finished:
            items = [await self.stream.get()]
            while not self.stream.empty():
                items.append(self.stream.get_nowait())
            yield self.message(items, first)
            first = False

    def delivered(self) -> None:
        """The caller has every message so far: their handoffs are its to use (or to release)."""
        for state in self.sequences.values():
            state.undelivered_lease = None

    def close(self) -> None:
        """The call is over: nothing of the request may stay behind in the engine, and a handoff
        the caller never received is given back at once."""
        for task in self.tasks:
            task.cancel()
        for state in self.sequences.values():
            if not state.finished:
                self.core.abort(state.engine_id)
            if state.undelivered_lease is not None and self.withdraw is not None:
                self.withdraw(state.undelivered_lease)
                state.undelivered_lease = None
        while not self.stream.empty():  # outputs nobody read: a lease among them is nobody's
            item = self.stream.get_nowait()
            if isinstance(item, StepOutput) and item.lease is not None:
                self.withdraw(item.lease.lease_id)
        for callback in self.on_close:
            callback()

    def message(self, items: list, first: bool) -> types_pb2.RequestOutput:
        by_seq: dict[str, types_pb2.CompletionOutput] = {}
        for item in items:
            if item is CANCELLED:
                for state in self.sequences.values():
                    if not state.finished:
                        self._cancel(by_seq, state)
                continue
            if isinstance(item, EngineFailure):
                raise item.error
            if isinstance(item, SequenceStopped):
                state = self.sequences[item.engine_id]
                if not state.finished:
                    self._cancel(by_seq, state)
                continue
            self._apply(by_seq, item)
        msg = types_pb2.RequestOutput(
            request_id=self.request_id,
            finished=self.is_finished,
            outputs=sorted(by_seq.values(), key=lambda o: o.index),
        )
        handoff = next(
            (o.disaggregated_params for o in msg.outputs if o.HasField("disaggregated_params")),
            None,
        )
        if handoff is not None:
            msg.disaggregated_params.CopyFrom(handoff)
        if self.pending_context_logits:
            msg.context_logits.extend(self.pending_context_logits)
            self.pending_context_logits = []
        if self.pending_prompt_logprobs:
            msg.prompt_logprobs.extend(self.pending_prompt_logprobs)
            self.pending_prompt_logprobs = []
        if first:
            msg.prompt_token_ids.extend(self.prompt_token_ids)
        if msg.finished:
            self._fill_metrics(msg.metrics)
        return msg

    def _cancel(self, by_seq: dict, state: SequenceState) -> None:
        """Ends state's sequence short of its finish (an abort, or a stop string the front found)."""
        state.finished = True
        comp = self._completion(by_seq, state)
        comp.finish_reason = types_pb2.FINISH_REASON_CANCELLED
        if state.perf is not None:
            comp.perf_metrics.CopyFrom(self._perf_metrics(state.perf))

    def _fill_metrics(self, metrics: types_pb2.RequestMetrics) -> None:
        m = self.metrics
        now = m.finished_at = time.monotonic()
        metrics.time_to_first_token_s = (m.first_token_at or now) - m.arrival
        metrics.e2e_latency_s = now - m.arrival
        metrics.num_cached_prompt_tokens = m.num_cached_prompt_tokens
        metrics.num_computed_prompt_tokens = len(self.prompt_token_ids) - m.num_cached_prompt_tokens
        metrics.kv_transfer_bytes = m.kv_transfer_bytes
        metrics.kv_transfer_s = m.kv_transfer_s
        if m.kv_handoff is not None:
            metrics.kv_handoff.CopyFrom(m.kv_handoff)
        if m.prefix_pull is not None:
            metrics.prefix_pull.CopyFrom(m.prefix_pull)

    def _completion(self, by_seq: dict, state: SequenceState) -> types_pb2.CompletionOutput:
        if state.engine_id not in by_seq:
            comp = by_seq[state.engine_id] = types_pb2.CompletionOutput(index=state.index)
            if not state.started:
                state.started = True
                if not self.returns_first_tokens:
                    return by_seq[state.engine_id]
                comp.token_ids.extend(self.first_tokens)
                comp.cumulative_logprob = self.first_cumulative
                if self.options.logprobs is not None and self.first_tokens:
                    entries = self.first_logprobs + [types_pb2.TokenLogprobs()] * (
                        len(self.first_tokens) - len(self.first_logprobs)
                    )
                    comp.logprobs.extend(entries)
        return by_seq[state.engine_id]

    def _apply(self, by_seq: dict, out: StepOutput) -> None:
        state = self.sequences.get(out.request_id)
        if state is None or state.finished:  # a token that raced with an abort
            if out.lease is not None:
                self.withdraw(out.lease.lease_id)
            return
        if self.metrics.first_token_at is None:
            self.metrics.first_token_at = time.monotonic()
        if out.first_scheduled_at and self.metrics.scheduled_at is None:
            self.metrics.scheduled_at = out.first_scheduled_at
        self.metrics.num_cached_prompt_tokens = max(
            self.metrics.num_cached_prompt_tokens, out.num_cached_prompt_tokens
        )
        if out.beams is not None:
            self._apply_beams(by_seq, state, out.beams, out.perf)
            return
        comp = self._completion(by_seq, state)
        state.perf = out.perf
        if out.perf is not None and out.finished:
            comp.perf_metrics.CopyFrom(self._perf_metrics(out.perf))
        comp.token_ids.extend(out.new_token_ids)
        comp.cumulative_logprob = self.first_cumulative + out.cumulative_logprob
        ranks = out.new_ranks or [None] * len(out.new_logprobs)
        new_logprobs = [
            types_pb2.TokenLogprobs(logprobs=e or {}, ranks=r or {})
            for e, r in zip(out.new_logprobs, ranks)
        ]
        if out.generation_logits:
            comp.generation_logits.extend(
                types_pb2.LogitsRow(values=row.tolist()) for row in out.generation_logits
            )
        if out.context_logits is not None and not self.context_logits_sent:
            self.context_logits_sent = True
            self.pending_context_logits = [
                types_pb2.LogitsRow(values=row) for row in out.context_logits.tolist()
            ]
        if out.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            self.pending_prompt_logprobs = [
                types_pb2.TokenLogprobs(logprobs=v, ranks=r) for v, r in out.prompt_logprobs
            ]
        if self.options.logprobs is not None:
            comp.logprobs.extend(new_logprobs)
        if (
            out.lease is not None
            and self.disagg_in.finish_in_context
            and out.finish_reason is not None
        ):
            # The router's split: a request its first token ends is over here, no handoff.
            self.withdraw(out.lease.lease_id, stopped=True)
            out.lease = None
        if out.lease is not None:
            # The context phase is done: the first token plus where its KV is; the request goes on
            # where the handoff is presented (TensorRT-LLM's finish_reason 'not_finished').
            handoff = self.hand_off(out)
            if self.options.logprobs is not None:
                handoff.first_gen_log_probs.extend(new_logprobs)
            comp.disaggregated_params.CopyFrom(handoff)
            comp.finish_reason = types_pb2.FINISH_REASON_NOT_FINISHED
            state.undelivered_lease = out.lease.lease_id
            state.finished = True
        elif out.finished:
            state.finished = True
            comp.finish_reason = FINISH_REASONS[out.finish_reason]
            if out.stop_token_id is not None and out.stop_token_id not in state.options.eos_ids():
                # A stop token (TensorRT-LLM's stop word): the stop reason, and out of token_ids unless
                # include_stop_str_in_output. The end id (EOS) stays and sets no stop reason
                # (executor/result.py, GenerationResultBase._handle_sequence).
                comp.stop_token_id = out.stop_token_id
                if not state.options.include_stop_str_in_output and comp.token_ids:
                    del comp.token_ids[-1]
                    del comp.logprobs[len(comp.token_ids) :]

    def _perf_metrics(self, perf: SequencePerf) -> types_pb2.PerfMetrics:
        m = self.metrics
        out = perf_metrics(
            perf, m.arrival_time, m.kv_transfer_start, m.kv_transfer_end, m.kv_transfer_bytes
        )
        if m.kv_handoff is not None:
            out.kv_handoff.CopyFrom(m.kv_handoff)
        if m.prefix_pull is not None:
            out.prefix_pull.CopyFrom(m.prefix_pull)
        return out

    def _apply_beams(
        self, by_seq: dict, state: SequenceState, beams: list, perf: SequencePerf | None = None
    ) -> None:
        """The finished beam search: one CompletionOutput per returned beam, best first (TensorRT-LLM
        returns the beams together, executor/result.py, _handle_sequence with use_beam_search)."""
        state.finished = True
        for index, beam in enumerate(beams):
            comp = by_seq[f"{state.engine_id}#beam{index}"] = types_pb2.CompletionOutput(
                index=index,
                token_ids=beam.token_ids,
                cumulative_logprob=beam.cumulative_logprob,
                finish_reason=FINISH_REASONS[beam.finish_reason],
            )
            if (
                beam.finish_reason is FinishReason.STOP
                and beam.token_ids[-1] not in state.options.eos_ids()
            ):
                comp.stop_token_id = beam.token_ids[-1]
            if self.options.logprobs is not None:
                comp.logprobs.extend(
                    types_pb2.TokenLogprobs(logprobs={t: v})
                    for t, v in zip(beam.token_ids, beam.token_logprobs)
                )
            if perf is not None:  # one engine request searched them all
                comp.perf_metrics.CopyFrom(self._perf_metrics(perf))

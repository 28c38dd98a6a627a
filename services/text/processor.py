"""Text on top of a stream of token-id outputs: incremental detokenization and stop strings.

One TextProcessor per request, as vLLM v1's OutputProcessor keeps one state per request:
the process facing the client (the router, or a worker called directly) runs it over
whatever produces the token ids (one worker, a prefill/decode split, a migration), so no
text state ever crosses a handoff or a migration.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tandem.text.detokenizer import IncrementalDetokenizer
from tandem.text.tokenizer import Tokenizer
from tandem.v1 import types_pb2

# Called when a stop string ends sequence `index` early: the producer must stop it. handoff is
# the context phase's DisaggregatedParams the output carried, now withheld from the client.
StopCallback = Callable[[int, "types_pb2.DisaggregatedParams | None"], Awaitable[None]]


@dataclass(frozen=True)
class TextOptions:
    """What of a request's SamplingParams the text layer applies."""

    detokenize: bool = True
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # The producer was asked for the sampled tokens' logprobs only so that a stop string can
    # cut cumulative_logprob exactly; the client did not ask for them.
    strip_logprobs: bool = False
    # Shown before each sequence's tokens (the prompt, when exclude_input_from_output is false).
    prefix_token_ids: tuple[int, ...] = ()


class _Sequence:
    def __init__(self, detokenizer: IncrementalDetokenizer | None):
        self.detokenizer = detokenizer
        self.stopped = (
            False  # ended here by a stop string; the producer's later outputs are dropped
        )
        self.finished = False
        # With stop strings (not kept in the output), tokens whose text is held back are held back
        # too, with their logprobs: a stop string takes its tokens out of token_ids.
        self.held_tokens: list[int] = []
        self.held_logprobs: list[types_pb2.TokenLogprobs] = []
        self.num_released = 0
        self.prefixed = False  # TextOptions.prefix_token_ids went out


class TextProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        options: TextOptions,
        prompt_text: str | None = None,
        num_sequences: int = 1,
    ):
        self.tokenizer = tokenizer
        self.options = options
        self.prompt_text = prompt_text
        # n: a sequence not seen yet (its first token still to come) is not finished.
        self.num_sequences = num_sequences
        self._sequences: dict[int, _Sequence] = {}
        self._first = True
        # The message that ended every sequence by a stop string, until the producer's last one.
        self._held: types_pb2.RequestOutput | None = None
        self.done = False

    def _sequence(self, index: int) -> _Sequence:
        if index not in self._sequences:
            o = self.options
            detok = (
                IncrementalDetokenizer(
                    self.tokenizer, o.skip_special_tokens, o.stop, o.include_stop_str_in_output
                )
                if o.detokenize
                else None
            )
            self._sequences[index] = _Sequence(detok)
        return self._sequences[index]

    def feed(
        self, msg: types_pb2.RequestOutput
    ) -> tuple[
        types_pb2.RequestOutput | None, list[tuple[int, types_pb2.DisaggregatedParams | None]]
    ]:
        """Adds text to the producer's next message. Returns the message for the client (None while
        one is held) and the sequences a stop string ended in it (the producer must stop them).
        When stop strings end every sequence, the message that says so waits for the producer's
        own last message (its metrics), into which it is merged. `done` once the client's last
        message went out: the producer's further messages are not wanted."""
        if self.is_passthrough:
            self.pass_through(msg)
            self.done = msg.finished
            return msg, []
        stops = self._apply(msg)
        held = self._held
        if held is not None:
            held.finished = held.finished or msg.finished
            if msg.HasField("metrics"):
                held.metrics.CopyFrom(msg.metrics)
            _merge_perf_metrics(held, msg)
            if not held.finished:
                return None, stops
            self._held = None
            self.done = True
            return held, stops
        if stops and not msg.finished and self._all_finished:
            self._held = msg  # every sequence is done here; the producer is stopping
            return None, stops
        self.done = msg.finished
        return msg, stops

    def finish(self) -> types_pb2.RequestOutput | None:
        """The producer ended without a last message of its own: the held one, as the last."""
        held, self._held = self._held, None
        if held is not None:
            held.finished = True
            self.done = True
        return held

    @property
    def is_passthrough(self) -> bool:
        """Token ids only (detokenize off, so no stop string), nothing to put ahead of them or take
        out: the producer's messages go on as they are, but for the prompt's text on the first."""
        o = self.options
        return not o.detokenize and not o.prefix_token_ids and not o.strip_logprobs

    def pass_through(self, msg: types_pb2.RequestOutput) -> None:
        """A passthrough request's one change to a message: the prompt's text on the first."""
        if self._first and self.prompt_text is not None:
            msg.prompt = self.prompt_text
        self._first = False

    @property
    def _all_finished(self) -> bool:
        finished = sum(1 for s in self._sequences.values() if s.finished)
        return finished >= self.num_sequences

    def _apply(
        self, msg: types_pb2.RequestOutput
    ) -> list[tuple[int, types_pb2.DisaggregatedParams | None]]:
        if self._first and self.prompt_text is not None:
            msg.prompt = self.prompt_text
        self._first = False
        stops = []
        kept = []
        for comp in msg.outputs:
            state = self._sequence(comp.index)
            if state.stopped:  # tokens that raced with the stop string are dropped
                if comp.HasField("perf_metrics"):  # the producer's record of the stopped sequence
                    kept.append(
                        types_pb2.CompletionOutput(index=comp.index, perf_metrics=comp.perf_metrics)
                    )
                continue
            kept.append(comp)
            if self._apply_completion(comp, state):
                handoff = None
                if comp.HasField("disaggregated_params"):
                    handoff = types_pb2.DisaggregatedParams()
                    handoff.CopyFrom(comp.disaggregated_params)
                    comp.ClearField(
                        "disaggregated_params"
                    )  # a stop in the first token: nothing to hand off
                stops.append((comp.index, handoff))
            elif comp.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED:
                state.finished = True
        if len(kept) != len(msg.outputs):
            del msg.outputs[:]
            msg.outputs.extend(kept)
        return stops

    def _apply_completion(self, comp: types_pb2.CompletionOutput, state: _Sequence) -> bool:
        """Detokenizes comp's new tokens; True when a stop string ended the sequence here."""
        detok = state.detokenizer
        prefix = [] if state.prefixed else list(self.options.prefix_token_ids)
        state.prefixed = True
        if detok is None:
            self._strip_logprobs(comp)
            self._prepend(comp, prefix)
            return False
        prefix_text = detok.add_prefix(prefix) if prefix else ""
        state.num_released += len(prefix)
        tokens = list(comp.token_ids)
        # The end of this call's sequence (a handed-off context_only output included: its caller
        # gets the first token's text, and the generation_only call detokenizes from that token on).
        final = comp.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED
        text = []
        for j, token in enumerate(tokens):
            text.append(detok.add(token, final=final and j == len(tokens) - 1))
            if detok.stop_string is not None:
                self._cut(comp, j + 1)
                break
        if final and not tokens:
            text.append(detok.add(None, final=True))
        comp.text = prefix_text + "".join(text)
        if detok.stop and not detok.include_stop:
            self._hold_tokens(comp, state, final)
        self._strip_logprobs(comp)
        self._prepend(comp, prefix)
        if detok.stop_string is None:
            return False
        state.stopped = state.finished = True
        comp.finish_reason = types_pb2.FINISH_REASON_STOP
        comp.stop_string = detok.stop_string
        return True

    @staticmethod
    def _cut(comp: types_pb2.CompletionOutput, num_kept: int) -> None:
        """Drops the tokens after the one that completed a stop string, and their logprobs."""
        dropped = list(comp.token_ids[num_kept:])
        if not dropped:
            return
        for token, entry in zip(dropped, comp.logprobs[num_kept:]):
            comp.cumulative_logprob -= entry.logprobs.get(token, 0.0)
        del comp.token_ids[num_kept:]
        del comp.logprobs[num_kept:]

    @staticmethod
    def _hold_tokens(comp: types_pb2.CompletionOutput, state: _Sequence, final: bool) -> None:
        """Sends on the tokens whose text is out (all of them at the end); a stop string drops the
        held tokens whose text starts inside it (their logprobs stay in cumulative_logprob, as
        TensorRT-LLM's cum_log_probs keep the stop word's)."""
        detok = state.detokenizer
        aligned = len(comp.logprobs) == len(comp.token_ids)
        state.held_tokens += comp.token_ids
        state.held_logprobs += comp.logprobs if aligned else []
        if detok.stop_string is not None:
            num_out = detok.num_kept_tokens
        elif final:
            num_out = len(detok.token_ids)
        else:
            num_out = detok.num_emitted_tokens
        release = max(0, num_out - state.num_released)
        del comp.token_ids[:]
        comp.token_ids.extend(state.held_tokens[:release])
        del comp.logprobs[:]
        comp.logprobs.extend(state.held_logprobs[:release])
        del state.held_tokens[:release]
        del state.held_logprobs[:release]
        state.num_released += release

    @staticmethod
    def _prepend(comp: types_pb2.CompletionOutput, prefix: list[int]) -> None:
        """The prompt ahead of the first tokens (no logprobs of their own: empty entries)."""
        if not prefix:
            return
        if comp.logprobs:
            entries = [types_pb2.TokenLogprobs() for _ in prefix] + list(comp.logprobs)
            del comp.logprobs[:]
            comp.logprobs.extend(entries)
        ids = prefix + list(comp.token_ids)
        del comp.token_ids[:]
        comp.token_ids.extend(ids)

    def _strip_logprobs(self, comp: types_pb2.CompletionOutput) -> None:
        if self.options.strip_logprobs:
            del comp.logprobs[:]


def _merge_perf_metrics(held: types_pb2.RequestOutput, msg: types_pb2.RequestOutput) -> None:
    """Puts the perf metrics of msg's sequences into held, the message that ends them."""
    by_index = {comp.index: comp for comp in held.outputs}
    for comp in msg.outputs:
        if comp.HasField("perf_metrics"):
            target = by_index.get(comp.index)
            if target is None:
                target = held.outputs.add(index=comp.index)
            target.perf_metrics.CopyFrom(comp.perf_metrics)

"""RequestOutput / CompletionOutput as the seed exposes them, accumulated from the stream."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.client.params import DisaggregatedParams
from tandem.client.perf_metrics import KvHandoff, PrefixPull, RequestPerfMetrics
from tandem.v1 import types_pb2

_FINISH = {
    types_pb2.FINISH_REASON_UNSPECIFIED: None,
    types_pb2.FINISH_REASON_STOP: "stop",
    types_pb2.FINISH_REASON_LENGTH: "length",
    types_pb2.FINISH_REASON_CANCELLED: "cancelled",
    types_pb2.FINISH_REASON_NOT_FINISHED: "not_finished",
}


@dataclass(slots=True)
class Logprob:
    """tensorrt_llm.executor.result.Logprob: a token's log-probability and its rank in the
    vocabulary (1 = the most likely); rank is None where it is not known."""

    logprob: float
    rank: int | None = None


# One {token id: Logprob} per position (tensorrt_llm.executor.result.TokenLogprobs).
TokenLogprobs = list[dict[int, Logprob]]


def token_logprobs(
    entry: types_pb2.TokenLogprobs, num_top: int, sampled: int | None
) -> dict[int, Logprob]:
    """One position's entries, most likely first. The server sends the top num_top tokens plus the
    sampled one; ranks it sends are used, and the top num_top are ranked by their order. The sampled
    token outside the top num_top has rank None unless the server sent it (its rank is not known here)."""
    ranked = sorted(entry.logprobs.items(), key=lambda item: -item[1])
    outside = sampled if len(ranked) > num_top and sampled in entry.logprobs else None
    out, next_rank = {}, 1
    for token, logprob in ranked:
        rank = entry.ranks[token] if token in entry.ranks else None
        if token != outside and next_rank <= num_top:
            rank, next_rank = rank or next_rank, next_rank + 1
        out[token] = Logprob(logprob, rank)
    return out


def logits_array(rows: list[list[float]]):
    """Logits rows [positions, vocab] as a float32 numpy array when numpy is installed, else the
    nested lists: the client needs neither numpy nor torch (TensorRT-LLM gives a torch tensor;
    torch.from_numpy makes one without a copy)."""
    try:
        import numpy
    except ImportError:
        return rows
    return numpy.asarray(rows, dtype=numpy.float32)


@dataclass
class CompletionOutput:
    """tensorrt_llm.executor.result.CompletionOutput. cumulative_logprob and logprobs are filled
    only when SamplingParams.logprobs was set, as in TensorRT-LLM. generation_logits ([tokens,
    vocab]; a numpy array, or lists without numpy) when return_generation_logits;
    request_perf_metrics from the sequence's last message when return_perf_metrics. The extra
    model outputs stay None: the server refuses the params that would fill them."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: TokenLogprobs = field(default_factory=list)
    prompt_logprobs: TokenLogprobs = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "timeout" | "cancelled" | "not_finished"
    stop_reason: int | str | None = None
    generation_logits: list | None = None
    additional_context_outputs: dict | None = None
    additional_generation_outputs: dict | None = None
    disaggregated_params: DisaggregatedParams | None = None
    request_perf_metrics: RequestPerfMetrics | None = None
    # What the latest streamed message added.
    _generation_rows: list = field(default_factory=list, repr=False)
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    logprobs_diff: TokenLogprobs = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def _apply(self, msg: types_pb2.CompletionOutput, num_logprobs: int | None) -> None:
        self.text_diff = msg.text
        self.token_ids_diff = list(msg.token_ids)
        aligned = len(msg.logprobs) == len(msg.token_ids)
        self.logprobs_diff = (
            [
                token_logprobs(lp, num_logprobs or 0, msg.token_ids[i] if aligned else None)
                for i, lp in enumerate(msg.logprobs)
            ]
            if num_logprobs is not None
            else []
        )
        self.text += self.text_diff
        self.token_ids.extend(self.token_ids_diff)
        self.logprobs.extend(self.logprobs_diff)
        if num_logprobs is not None:
            self.cumulative_logprob = msg.cumulative_logprob
        if msg.finish_reason:
            self.finish_reason = _FINISH[msg.finish_reason]
        which = msg.WhichOneof("stop_reason")
        if which:
            self.stop_reason = getattr(msg, which)
        if msg.HasField("disaggregated_params"):
            self.disaggregated_params = DisaggregatedParams.from_proto(msg.disaggregated_params)
        if msg.HasField("perf_metrics"):
            self.request_perf_metrics = RequestPerfMetrics.from_proto(msg.perf_metrics)
        if msg.generation_logits:
            self._generation_rows += [list(row.values) for row in msg.generation_logits]
            self.generation_logits = logits_array(self._generation_rows)


@dataclass
class RequestMetrics:
    time_to_first_token_s: float = 0.0
    e2e_latency_s: float = 0.0
    num_cached_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    served_by: list[str] = field(default_factory=list)
    # A split request's KV handoff on its decode worker (None: not split).
    kv_handoff: KvHandoff | None = None
    # The cross-worker prefix pull the router asked for (None: none asked).
    prefix_pull: PrefixPull | None = None


class RequestOutputState:
    """The accumulated state of one request; RequestOutput (results.py) adds the async API on top.
    num_logprobs / num_prompt_logprobs: what the request asked for (None: not asked)."""

    def __init__(
        self,
        request_id: str = "",
        prompt: str | None = None,
        num_logprobs: int | None = None,
        num_prompt_logprobs: int | None = None,
        num_outputs: int = 0,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids: list[int] = []
        # One per returned sequence from the start, as TensorRT-LLM creates them (num_outputs: n).
        self.outputs: list[CompletionOutput] = [
            CompletionOutput(index=i) for i in range(num_outputs)
        ]
        self.finished = False
        self.metrics = RequestMetrics()
        self.context_logits = None  # [prompt positions, vocab] when return_context_logits
        self.mm_embedding_handle = None  # text-only models
        self._num_logprobs = num_logprobs
        self._num_prompt_logprobs = num_prompt_logprobs
        self._prompt_logprobs: TokenLogprobs = []
        self._disaggregated_params: DisaggregatedParams | None = None

    @property
    def outputs_by_index(self) -> dict[int, CompletionOutput]:
        return {o.index: o for o in self.outputs}

    @property
    def disaggregated_params(self) -> DisaggregatedParams | None:
        """The request-level handoff of a context_only request (TensorRT-LLM's result.disaggregated_params)."""
        if self._disaggregated_params is not None:
            return self._disaggregated_params
        return next(
            (o.disaggregated_params for o in self.outputs if o.disaggregated_params is not None),
            None,
        )

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused (prefix cache or a handoff), as TensorRT-LLM's cached_tokens."""
        return self.metrics.num_cached_prompt_tokens

    def _apply(self, msg: types_pb2.RequestOutput) -> None:
        self.request_id = msg.request_id or self.request_id
        if msg.HasField("prompt"):
            self.prompt = msg.prompt
        if msg.prompt_token_ids:
            self.prompt_token_ids = list(msg.prompt_token_ids)
        if msg.HasField("disaggregated_params"):
            self._disaggregated_params = DisaggregatedParams.from_proto(msg.disaggregated_params)
        if msg.context_logits:
            self.context_logits = logits_array([list(row.values) for row in msg.context_logits])
        if msg.prompt_logprobs:
            self._prompt_logprobs = [
                token_logprobs(lp, self._num_prompt_logprobs or 0, None)
                for lp in msg.prompt_logprobs
            ]
            for out in self.outputs:
                out.prompt_logprobs = self._prompt_logprobs
        current = self.outputs_by_index
        for out in self.outputs:
            out.text_diff, out.token_ids_diff, out.logprobs_diff = "", [], []
        for m in msg.outputs:
            if m.index not in current:
                current[m.index] = CompletionOutput(
                    index=m.index, prompt_logprobs=self._prompt_logprobs
                )
                self.outputs.append(current[m.index])
                self.outputs.sort(key=lambda o: o.index)
            current[m.index]._apply(m, self._num_logprobs)
        self.finished = msg.finished
        if msg.HasField("metrics"):
            m = msg.metrics
            self.metrics = RequestMetrics(
                m.time_to_first_token_s,
                m.e2e_latency_s,
                m.num_cached_prompt_tokens,
                m.num_computed_prompt_tokens,
                m.kv_transfer_bytes,
                m.kv_transfer_s,
                list(m.served_by),
                KvHandoff.from_proto(m.kv_handoff) if m.HasField("kv_handoff") else None,
                PrefixPull.from_proto(m.prefix_pull) if m.HasField("prefix_pull") else None,
            )

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, finished={self.finished})"
        )

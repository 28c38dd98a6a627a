"""RequestOutput / CompletionOutput as the seed exposes them, accumulated from the stream."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from tandem.client.params import DisaggregatedParams
from tandem.v1 import types_pb2

_FINISH = {types_pb2.FINISH_REASON_UNSPECIFIED: None, types_pb2.FINISH_REASON_STOP: "stop",
           types_pb2.FINISH_REASON_LENGTH: "length", types_pb2.FINISH_REASON_CANCELLED: "cancelled"}


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"
    stop_reason: Union[int, str, None] = None
    disaggregated_params: Optional[DisaggregatedParams] = None
    # What the latest streamed message added.
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    logprobs_diff: list[dict[int, float]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def _apply(self, msg: types_pb2.CompletionOutput) -> None:
        self.text_diff = msg.text
        self.token_ids_diff = list(msg.token_ids)
        self.logprobs_diff = [dict(lp.logprobs) for lp in msg.logprobs]
        self.text += self.text_diff
        self.token_ids.extend(self.token_ids_diff)
        self.logprobs.extend(self.logprobs_diff)
        self.cumulative_logprob = msg.cumulative_logprob
        if msg.finish_reason:
            self.finish_reason = _FINISH[msg.finish_reason]
        which = msg.WhichOneof("stop_reason")
        if which:
            self.stop_reason = getattr(msg, which)
        if msg.HasField("disaggregated_params"):
            self.disaggregated_params = DisaggregatedParams.from_proto(msg.disaggregated_params)


@dataclass
class RequestMetrics:
    time_to_first_token_s: float = 0.0
    e2e_latency_s: float = 0.0
    num_cached_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    served_by: list[str] = field(default_factory=list)


class RequestOutputState:
    """The accumulated state of one request; RequestOutput (llm.py) adds the async API on top."""

    def __init__(self, request_id: str = "", prompt: Optional[str] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids: list[int] = []
        self.outputs: list[CompletionOutput] = []
        self.finished = False
        self.metrics = RequestMetrics()

    @property
    def outputs_by_index(self) -> dict[int, CompletionOutput]:
        return {o.index: o for o in self.outputs}

    def _apply(self, msg: types_pb2.RequestOutput) -> None:
        self.request_id = msg.request_id or self.request_id
        if msg.HasField("prompt"):
            self.prompt = msg.prompt
        if msg.prompt_token_ids:
            self.prompt_token_ids = list(msg.prompt_token_ids)
        current = self.outputs_by_index
        for out in self.outputs:
            out.text_diff, out.token_ids_diff, out.logprobs_diff = "", [], []
        for m in msg.outputs:
            if m.index not in current:
                current[m.index] = CompletionOutput(index=m.index)
                self.outputs.append(current[m.index])
                self.outputs.sort(key=lambda o: o.index)
            current[m.index]._apply(m)
        self.finished = msg.finished
        if msg.HasField("metrics"):
            m = msg.metrics
            self.metrics = RequestMetrics(m.time_to_first_token_s, m.e2e_latency_s, m.num_cached_prompt_tokens,
                                          m.num_computed_prompt_tokens, m.kv_transfer_bytes, m.kv_transfer_s,
                                          list(m.served_by))

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, finished={self.finished})")

"""The internal plane's messages (internal.proto) beside the public ones they stand for.

A worker's Session carries EngineRequest in and EngineOutput entries out: token ids, never the
public GenerateRequest or RequestOutput. The text front of the process a client called is where
the public messages live: it turns its token-id GenerateRequest into an EngineRequest
(engine_request) and builds the client's RequestOutput from the entries that come back
(OutputBuilder). A worker still runs a session's request through the request path its own
Generate uses, so it converts the other way at the session's edge (generate_request,
engine_outputs).
"""

from __future__ import annotations

from tandem.v1 import internal_pb2, llm_pb2, types_pb2

# GenerateRequest fields an EngineRequest carries as they are (message fields copied when set).
_SHARED_MESSAGES = (
    "sampling_params",
    "lora_request",
    "prompt_adapter_request",
    "kv_cache_retention_config",
    "scheduling_params",
    "conversation_params",
)
_SHARED_OPTIONALS = ("cache_salt", "priority")


def _copy_shared(src, dst) -> None:
    """The fields a GenerateRequest and an EngineRequest both have, under the same names."""
    for name in _SHARED_MESSAGES:
        if src.HasField(name):
            getattr(dst, name).CopyFrom(getattr(src, name))
    for name in _SHARED_OPTIONALS:
        if src.HasField(name):
            setattr(dst, name, getattr(src, name))


def kv_params(params: types_pb2.DisaggregatedParams) -> internal_pb2.KvParams:
    """KvParams has DisaggregatedParams' fields under the same numbers and types
    (tests/test_internal_plane.py checks it): the conversion is a re-parse of its bytes."""
    return internal_pb2.KvParams.FromString(params.SerializeToString())


def disaggregated_params(params: internal_pb2.KvParams) -> types_pb2.DisaggregatedParams:
    return types_pb2.DisaggregatedParams.FromString(params.SerializeToString())


def engine_request(
    request: llm_pb2.GenerateRequest, return_first_gen_tokens: bool = False
) -> internal_pb2.EngineRequest:
    """What a worker's session gets for a GenerateRequest whose prompt the text front tokenized
    (its prompt is token ids; stop strings and detokenizing are the front's).
    return_first_gen_tokens: a generation phase's output starts with the tokens it was given."""
    if request.prompt.WhichOneof("kind") != "token_ids":
        raise ValueError("an engine request takes a tokenized prompt (prompt.token_ids)")
    out = internal_pb2.EngineRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt.token_ids.ids,
        trace_headers=request.trace_headers,
        return_first_gen_tokens=return_first_gen_tokens,
    )
    _copy_shared(request, out)
    if request.HasField("disaggregated_params"):
        out.kv_params.CopyFrom(kv_params(request.disaggregated_params))
    return out


def generate_request(request: internal_pb2.EngineRequest) -> llm_pb2.GenerateRequest:
    """The worker's side of engine_request: the token-id GenerateRequest its request path runs
    (streamed: the session sends each step's entries as they come)."""
    out = llm_pb2.GenerateRequest(
        request_id=request.request_id, streaming=True, trace_headers=request.trace_headers
    )
    out.prompt.token_ids.ids.extend(request.prompt_token_ids)
    _copy_shared(request, out)
    if request.HasField("kv_params"):
        out.disaggregated_params.CopyFrom(disaggregated_params(request.kv_params))
    return out


def token_entry(
    tag: int, token_ids: list[int], cumulative_logprob: float, index: int = 0
) -> internal_pb2.EngineOutput:
    """The entry of a step that made token_ids and nothing else of note."""
    return internal_pb2.EngineOutput(
        tag=tag, index=index, new_token_ids=token_ids, cumulative_logprob=cumulative_logprob
    )


def engine_outputs(tag: int, msg: types_pb2.RequestOutput) -> list[internal_pb2.EngineOutput]:
    """A worker's message of token ids as its session entries: one per sequence it holds (one of
    index -1 when it holds none), the request's fields on the first (prompt) and the last
    (metrics, finished). It has no text: a session's requests are token ids."""
    entries = []
    for out in msg.outputs:
        entry = internal_pb2.EngineOutput(
            tag=tag,
            index=out.index,
            new_token_ids=out.token_ids,
            cumulative_logprob=out.cumulative_logprob,
            new_logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            generation_logits=out.generation_logits,
        )
        if out.WhichOneof("stop_reason") == "stop_token_id":
            entry.stop_token_id = out.stop_token_id
        if out.HasField("disaggregated_params"):
            entry.kv_params.CopyFrom(kv_params(out.disaggregated_params))
        if out.HasField("perf_metrics"):
            entry.perf_metrics.CopyFrom(out.perf_metrics)
        entries.append(entry)
    if not entries:
        entries.append(internal_pb2.EngineOutput(tag=tag, index=-1))
    head, last = entries[0], entries[-1]
    head.prompt_token_ids.extend(msg.prompt_token_ids)
    head.prompt_logprobs.extend(msg.prompt_logprobs)
    head.context_logits.extend(msg.context_logits)
    if msg.HasField("metrics"):
        last.metrics.CopyFrom(msg.metrics)
    last.finished = msg.finished
    return entries


class OutputBuilder:
    """One RequestOutput from a request's entries, in the order they came: each sequence's tokens,
    logprobs and logits appended, its other fields as last given (what merging the messages
    they stand for would give)."""

    __slots__ = ("msg", "_sequences", "_in_order")

    def __init__(self, request_id: str):
        self.msg = types_pb2.RequestOutput(request_id=request_id)
        self._sequences: dict[int, types_pb2.CompletionOutput] = {}
        self._in_order = True

    def add(self, entry: internal_pb2.EngineOutput) -> None:
        msg = self.msg
        if entry.index >= 0:
            comp = self._sequences.get(entry.index)
            if comp is None:
                if self._sequences and entry.index < max(self._sequences):
                    self._in_order = False
                comp = self._sequences[entry.index] = msg.outputs.add(index=entry.index)
            comp.token_ids.extend(entry.new_token_ids)
            if entry.cumulative_logprob:  # as a merge of messages: 0 leaves the last value
                comp.cumulative_logprob = entry.cumulative_logprob
            if entry.new_logprobs:
                comp.logprobs.extend(entry.new_logprobs)
            if entry.generation_logits:
                comp.generation_logits.extend(entry.generation_logits)
            if entry.finish_reason:
                comp.finish_reason = entry.finish_reason
            if entry.HasField("stop_token_id"):
                comp.stop_token_id = entry.stop_token_id
            if entry.HasField("kv_params"):
                handoff = disaggregated_params(entry.kv_params)
                comp.disaggregated_params.CopyFrom(handoff)
                if not msg.HasField("disaggregated_params"):
                    msg.disaggregated_params.CopyFrom(handoff)
            if entry.HasField("perf_metrics"):
                comp.perf_metrics.CopyFrom(entry.perf_metrics)
        if entry.prompt_token_ids:
            msg.prompt_token_ids.extend(entry.prompt_token_ids)
        if entry.prompt_logprobs:
            msg.prompt_logprobs.extend(entry.prompt_logprobs)
        if entry.context_logits:
            msg.context_logits.extend(entry.context_logits)
        if entry.HasField("metrics"):
            msg.metrics.CopyFrom(entry.metrics)
        if entry.finished:
            msg.finished = True

    def build(self) -> types_pb2.RequestOutput:
        """The message (the builder is done with it: add nothing after)."""
        msg = self.msg
        if not self._in_order:
            outputs = sorted(msg.outputs, key=lambda out: out.index)
            ordered = [types_pb2.CompletionOutput() for _ in outputs]
            for dst, src in zip(ordered, outputs):
                dst.CopyFrom(src)
            del msg.outputs[:]
            msg.outputs.extend(ordered)
        return msg

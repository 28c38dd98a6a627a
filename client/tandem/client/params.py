"""The seed's parameter types (tensorrt_llm names) and their protobuf form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from tandem.client.sampling_params import GuidedDecodingParams, SamplingParams
from tandem.v1 import types_pb2

__all__ = [
    "SamplingParams",
    "GuidedDecodingParams",
    "DisaggregatedParams",
    "SchedulingParams",
    "ConversationParams",
    "LoRARequest",
    "PromptAdapterRequest",
    "KvCacheRetentionConfig",
    "PreprocessedInputs",
    "TextPrompt",
    "TokensPrompt",
    "prompt_to_proto",
]


class TextPrompt(TypedDict, total=False):
    prompt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]


_REQUEST_TYPES = {
    "context_and_generation": types_pb2.REQUEST_TYPE_CONTEXT_AND_GENERATION,
    "context_only": types_pb2.REQUEST_TYPE_CONTEXT_ONLY,
    "generation_only": types_pb2.REQUEST_TYPE_GENERATION_ONLY,
}


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    """tensorrt_llm.disaggregated_params.DisaggregatedParams, checked at construction as there.
    disagg_request_id ties the two halves together (newer TensorRT-LLM has it too); ctx_endpoint
    is tandem's: the context worker that holds the KV, set by the router. The multimodal
    (encoder-prefill) fields are refused: tandem serves text-only models."""

    request_type: str | None = None  # "context_only" | "generation_only" | "context_and_generation"
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    multimodal_embedding_handles: list[dict[str, Any]] | None = None
    multimodal_hashes: list[list[int]] | None = None
    disagg_request_id: int | None = None
    ctx_endpoint: str | None = None
    # One {token id: Logprob} per first_gen_token (newer TensorRT-LLM's first_gen_log_probs), when
    # the context request asked for logprobs: the generation_only output reports them.
    first_gen_log_probs: list[dict[int, Any]] | None = None

    def __post_init__(self):
        if self.request_type is not None:
            self.request_type = self.request_type.lower()
            if self.request_type not in _REQUEST_TYPES:
                raise ValueError(
                    f"Unknown request type: {self.request_type}. Must be context_only, "
                    "generation_only or context_and_generation"
                )
        for name in ("multimodal_embedding_handles", "multimodal_hashes"):
            if getattr(self, name) is not None:
                raise NotImplementedError(
                    f"DisaggregatedParams.{name}: tandem serves text-only models"
                )

    def to_proto(self) -> types_pb2.DisaggregatedParams:
        msg = types_pb2.DisaggregatedParams()
        if self.request_type is not None:
            msg.request_type = _REQUEST_TYPES[self.request_type]
        msg.first_gen_tokens.extend(self.first_gen_tokens or [])
        msg.draft_tokens.extend(self.draft_tokens or [])
        if self.ctx_request_id is not None:
            msg.ctx_request_id = self.ctx_request_id
        if self.disagg_request_id is not None:
            msg.disagg_request_id = self.disagg_request_id
        msg.opaque_state = self.opaque_state or b""
        msg.ctx_endpoint = self.ctx_endpoint or ""
        for entry in self.first_gen_log_probs or []:
            position = msg.first_gen_log_probs.add()
            for token, value in entry.items():
                position.logprobs[token] = getattr(value, "logprob", value)
                if getattr(value, "rank", None) is not None:
                    position.ranks[token] = value.rank
        return msg

    @classmethod
    def from_proto(cls, msg: types_pb2.DisaggregatedParams) -> DisaggregatedParams:
        from tandem.client.outputs import Logprob  # outputs imports this module

        names = {v: k for k, v in _REQUEST_TYPES.items()}
        first_logprobs = [
            {t: Logprob(v, e.ranks[t] if t in e.ranks else None) for t, v in e.logprobs.items()}
            for e in msg.first_gen_log_probs
        ] or None
        return cls(
            request_type=names[msg.request_type],
            first_gen_tokens=list(msg.first_gen_tokens),
            first_gen_log_probs=first_logprobs,
            ctx_request_id=msg.ctx_request_id if msg.HasField("ctx_request_id") else None,
            opaque_state=msg.opaque_state or None,
            draft_tokens=list(msg.draft_tokens) or None,
            disagg_request_id=msg.disagg_request_id if msg.HasField("disagg_request_id") else None,
            ctx_endpoint=msg.ctx_endpoint or None,
        )


@dataclass
class SchedulingParams:
    attention_dp_rank: int | None = None
    attention_dp_relax: bool = False
    agent_hierarchy: str | None = None

    def to_proto(self) -> types_pb2.SchedulingParams:
        return types_pb2.SchedulingParams(**{k: v for k, v in vars(self).items() if v is not None})


@dataclass
class ConversationParams:
    conversation_id: str = ""
    turn: int | None = None

    def to_proto(self) -> types_pb2.ConversationParams:
        return types_pb2.ConversationParams(
            **{k: v for k, v in vars(self).items() if v is not None}
        )


@dataclass
class LoRARequest:
    """A LoRA adapter for a request (tensorrt_llm.executor.request.LoRARequest). lora_path is a PEFT
    directory on the workers' disk, so unlike TensorRT-LLM the client does not check that it exists:
    the worker does, and refuses the request when it cannot load it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"

    def __post_init__(self):
        if self.lora_ckpt_source not in ("hf", "nemo"):
            raise ValueError(
                f"lora_ckpt_source must be 'hf' or 'nemo', got '{self.lora_ckpt_source}'"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def ckpt_source(self) -> str:
        return self.lora_ckpt_source

    def to_proto(self) -> types_pb2.LoRARequest:
        return types_pb2.LoRARequest(
            lora_name=self.lora_name,
            lora_int_id=self.lora_int_id,
            lora_path=self.lora_path,
            lora_ckpt_source=self.lora_ckpt_source,
        )


@dataclass
class PromptAdapterRequest:
    prompt_adapter_name: str
    prompt_adapter_id: int
    prompt_adapter_local_path: str = ""
    prompt_adapter_num_virtual_tokens: int = 0

    def to_proto(self) -> types_pb2.PromptAdapterRequest:
        return types_pb2.PromptAdapterRequest(**vars(self))


@dataclass
class KvCacheRetentionConfig:
    """token_range_retention_configs: list of (token_start, token_end | None, priority, duration_seconds | None)."""

    token_range_retention_configs: list[tuple] = field(default_factory=list)
    decode_retention_priority: int = 35
    decode_duration_seconds: float | None = None

    def to_proto(self) -> types_pb2.KvCacheRetentionConfig:
        msg = types_pb2.KvCacheRetentionConfig(
            decode_retention_priority=self.decode_retention_priority
        )
        if self.decode_duration_seconds is not None:
            msg.decode_duration_seconds = self.decode_duration_seconds
        for start, end, priority, duration in self.token_range_retention_configs:
            r = msg.token_range_retention_configs.add(token_start=start, priority=priority)
            if end is not None:
                r.token_end = end
            if duration is not None:
                r.duration_seconds = duration
        return msg


@dataclass
class PreprocessedInputs:
    """What preprocess() returns; generate_async accepts it and skips tokenization."""

    prompt_token_ids: list[int]
    prompt: str | None = None
    sampling_params: types_pb2.SamplingParams | None = None
    disaggregated_params: DisaggregatedParams | None = None

    def to_proto(self) -> types_pb2.PreprocessedInputs:
        msg = types_pb2.PreprocessedInputs(prompt_token_ids=self.prompt_token_ids)
        if self.prompt is not None:
            msg.prompt = self.prompt
        if self.sampling_params is not None:
            msg.sampling_params.CopyFrom(self.sampling_params)
        if self.disaggregated_params is not None:
            msg.disaggregated_params.CopyFrom(self.disaggregated_params.to_proto())
        return msg


PromptInputs = str | list[int] | TextPrompt | TokensPrompt | PreprocessedInputs


def prompt_to_proto(inputs: Any) -> types_pb2.Prompt:
    """str | list[int] | {"prompt": str} | {"prompt_token_ids": [...]} | PreprocessedInputs -> Prompt."""
    if isinstance(inputs, str):
        return types_pb2.Prompt(text=inputs)
    if isinstance(inputs, PreprocessedInputs):
        return types_pb2.Prompt(preprocessed=inputs.to_proto())
    if isinstance(inputs, dict):
        if "prompt_token_ids" in inputs:
            return types_pb2.Prompt(
                token_ids=types_pb2.TokenIds(ids=list(inputs["prompt_token_ids"]))
            )
        if "prompt" in inputs:
            return types_pb2.Prompt(text=inputs["prompt"])
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    if isinstance(inputs, (list, tuple)) and all(isinstance(t, int) for t in inputs):
        return types_pb2.Prompt(token_ids=types_pb2.TokenIds(ids=list(inputs)))
    raise TypeError(
        f"unsupported prompt type {type(inputs).__name__}: give str, list[int], TextPrompt, "
        "TokensPrompt or PreprocessedInputs"
    )

from tandem.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvParams(_message.Message):
    __slots__ = ("request_type", "first_gen_tokens", "ctx_request_id", "opaque_state", "draft_tokens", "disagg_request_id", "ctx_endpoint", "first_gen_log_probs", "finish_in_context")
    REQUEST_TYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_GEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_STATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_GEN_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_IN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_type: _types_pb2.RequestType
    first_gen_tokens: _containers.RepeatedScalarFieldContainer[int]
    ctx_request_id: int
    opaque_state: bytes
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    disagg_request_id: int
    ctx_endpoint: str
    first_gen_log_probs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprobs]
    finish_in_context: bool
    def __init__(self, request_type: _Optional[_Union[_types_pb2.RequestType, str]] = ..., first_gen_tokens: _Optional[_Iterable[int]] = ..., ctx_request_id: _Optional[int] = ..., opaque_state: _Optional[bytes] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., disagg_request_id: _Optional[int] = ..., ctx_endpoint: _Optional[str] = ..., first_gen_log_probs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprobs, _Mapping]]] = ..., finish_in_context: _Optional[bool] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "kv_params", "lora_request", "prompt_adapter_request", "kv_cache_retention_config", "scheduling_params", "conversation_params", "cache_salt", "priority", "trace_headers", "return_first_gen_tokens")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ADAPTER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_RETENTION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FIRST_GEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _types_pb2.SamplingParams
    kv_params: KvParams
    lora_request: _types_pb2.LoRARequest
    prompt_adapter_request: _types_pb2.PromptAdapterRequest
    kv_cache_retention_config: _types_pb2.KvCacheRetentionConfig
    scheduling_params: _types_pb2.SchedulingParams
    conversation_params: _types_pb2.ConversationParams
    cache_salt: str
    priority: float
    trace_headers: _containers.ScalarMap[str, str]
    return_first_gen_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., kv_params: _Optional[_Union[KvParams, _Mapping]] = ..., lora_request: _Optional[_Union[_types_pb2.LoRARequest, _Mapping]] = ..., prompt_adapter_request: _Optional[_Union[_types_pb2.PromptAdapterRequest, _Mapping]] = ..., kv_cache_retention_config: _Optional[_Union[_types_pb2.KvCacheRetentionConfig, _Mapping]] = ..., scheduling_params: _Optional[_Union[_types_pb2.SchedulingParams, _Mapping]] = ..., conversation_params: _Optional[_Union[_types_pb2.ConversationParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[float] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., return_first_gen_tokens: _Optional[bool] = ...) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("tag", "index", "new_token_ids", "cumulative_logprob", "new_logprobs", "finish_reason", "stop_token_id", "kv_params", "generation_logits", "perf_metrics", "finished", "prompt_token_ids", "prompt_logprobs", "context_logits", "metrics")
    TAG_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_PARAMS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_LOGITS_FIELD_NUMBER: _ClassVar[int]
    PERF_METRICS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    tag: int
    index: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cumulative_logprob: float
    new_logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprobs]
    finish_reason: _types_pb2.FinishReason
    stop_token_id: int
    kv_params: KvParams
    generation_logits: _containers.RepeatedCompositeFieldContainer[_types_pb2.LogitsRow]
    perf_metrics: _types_pb2.PerfMetrics
    finished: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprobs]
    context_logits: _containers.RepeatedCompositeFieldContainer[_types_pb2.LogitsRow]
    metrics: _types_pb2.RequestMetrics
    def __init__(self, tag: _Optional[int] = ..., index: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., cumulative_logprob: _Optional[float] = ..., new_logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., kv_params: _Optional[_Union[KvParams, _Mapping]] = ..., generation_logits: _Optional[_Iterable[_Union[_types_pb2.LogitsRow, _Mapping]]] = ..., perf_metrics: _Optional[_Union[_types_pb2.PerfMetrics, _Mapping]] = ..., finished: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprobs, _Mapping]]] = ..., context_logits: _Optional[_Iterable[_Union[_types_pb2.LogitsRow, _Mapping]]] = ..., metrics: _Optional[_Union[_types_pb2.RequestMetrics, _Mapping]] = ...) -> None: ...

from google.protobuf import struct_pb2 as _struct_pb2
from tandem.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling_params", "streaming", "lora_request", "prompt_adapter_request", "kv_cache_retention_config", "disaggregated_params", "trace_headers", "scheduling_params", "conversation_params", "cache_salt", "priority")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ADAPTER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_RETENTION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _types_pb2.Prompt
    sampling_params: _types_pb2.SamplingParams
    streaming: bool
    lora_request: _types_pb2.LoRARequest
    prompt_adapter_request: _types_pb2.PromptAdapterRequest
    kv_cache_retention_config: _types_pb2.KvCacheRetentionConfig
    disaggregated_params: _types_pb2.DisaggregatedParams
    trace_headers: _containers.ScalarMap[str, str]
    scheduling_params: _types_pb2.SchedulingParams
    conversation_params: _types_pb2.ConversationParams
    cache_salt: str
    priority: float
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_types_pb2.Prompt, _Mapping]] = ..., sampling_params: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., streaming: _Optional[bool] = ..., lora_request: _Optional[_Union[_types_pb2.LoRARequest, _Mapping]] = ..., prompt_adapter_request: _Optional[_Union[_types_pb2.PromptAdapterRequest, _Mapping]] = ..., kv_cache_retention_config: _Optional[_Union[_types_pb2.KvCacheRetentionConfig, _Mapping]] = ..., disaggregated_params: _Optional[_Union[_types_pb2.DisaggregatedParams, _Mapping]] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., scheduling_params: _Optional[_Union[_types_pb2.SchedulingParams, _Mapping]] = ..., conversation_params: _Optional[_Union[_types_pb2.ConversationParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("inputs", "add_special_tokens", "return_raw_logits", "model_kwargs")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_RAW_LOGITS_FIELD_NUMBER: _ClassVar[int]
    MODEL_KWARGS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[_types_pb2.Prompt]
    add_special_tokens: bool
    return_raw_logits: bool
    model_kwargs: _struct_pb2.Struct
    def __init__(self, inputs: _Optional[_Iterable[_Union[_types_pb2.Prompt, _Mapping]]] = ..., add_special_tokens: _Optional[bool] = ..., return_raw_logits: _Optional[bool] = ..., model_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "values")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("outputs", "raw")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EncoderOutput]
    raw: Tensor
    def __init__(self, outputs: _Optional[_Iterable[_Union[EncoderOutput, _Mapping]]] = ..., raw: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class EncoderOutput(_message.Message):
    __slots__ = ("prompt_token_ids", "logits", "pooled")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logits: Tensor
    pooled: Tensor
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., pooled: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PreprocessRequest(_message.Message):
    __slots__ = ("prompt", "sampling_params", "disaggregated_params")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    prompt: _types_pb2.Prompt
    sampling_params: _types_pb2.SamplingParams
    disaggregated_params: _types_pb2.DisaggregatedParams
    def __init__(self, prompt: _Optional[_Union[_types_pb2.Prompt, _Mapping]] = ..., sampling_params: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., disaggregated_params: _Optional[_Union[_types_pb2.DisaggregatedParams, _Mapping]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class CollectiveRpcRequest(_message.Message):
    __slots__ = ("method", "args", "kwargs", "unique_reply_rank", "target_ranks")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_REPLY_RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_RANKS_FIELD_NUMBER: _ClassVar[int]
    method: str
    args: _struct_pb2.ListValue
    kwargs: _struct_pb2.Struct
    unique_reply_rank: int
    target_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, method: _Optional[str] = ..., args: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., unique_reply_rank: _Optional[int] = ..., target_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class CollectiveRpcResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Value]
    def __init__(self, results: _Optional[_Iterable[_Union[_struct_pb2.Value, _Mapping]]] = ...) -> None: ...

class GetDataTransceiverStateRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class GetDataTransceiverStateResponse(_message.Message):
    __slots__ = ("state", "worker_id")
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    worker_id: str
    def __init__(self, state: _Optional[bytes] = ..., worker_id: _Optional[str] = ...) -> None: ...

class GetKvCacheCapacityRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class KvCacheCapacity(_message.Message):
    __slots__ = ("max_num_blocks", "tokens_per_block", "max_num_tokens", "num_free_blocks")
    MAX_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    max_num_blocks: int
    tokens_per_block: int
    max_num_tokens: int
    num_free_blocks: int
    def __init__(self, max_num_blocks: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., max_num_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("timeout",)
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    timeout: float
    def __init__(self, timeout: _Optional[float] = ...) -> None: ...

class JsonList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[str]] = ...) -> None: ...

class JsonItem(_message.Message):
    __slots__ = ("item",)
    ITEM_FIELD_NUMBER: _ClassVar[int]
    item: str
    def __init__(self, item: _Optional[str] = ...) -> None: ...

class AdminRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class AdminResponse(_message.Message):
    __slots__ = ("detail",)
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    detail: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, detail: _Optional[_Iterable[str]] = ...) -> None: ...

class MemoryTagsRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("ipc_handles", "checkpoint_path", "finalize", "nixl_weights")
    IPC_HANDLES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    FINALIZE_FIELD_NUMBER: _ClassVar[int]
    NIXL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ipc_handles: IpcHandles
    checkpoint_path: str
    finalize: bool
    nixl_weights: NixlWeights
    def __init__(self, ipc_handles: _Optional[_Union[IpcHandles, _Mapping]] = ..., checkpoint_path: _Optional[str] = ..., finalize: _Optional[bool] = ..., nixl_weights: _Optional[_Union[NixlWeights, _Mapping]] = ...) -> None: ...

class NixlWeights(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "memory_type", "tensors")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    memory_type: str
    tensors: _containers.RepeatedCompositeFieldContainer[NixlTensor]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., memory_type: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[NixlTensor, _Mapping]]] = ...) -> None: ...

class NixlTensor(_message.Message):
    __slots__ = ("name", "address", "num_bytes", "device_id", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: int
    num_bytes: int
    device_id: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., address: _Optional[int] = ..., num_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class IpcHandles(_message.Message):
    __slots__ = ("handles",)
    class HandlesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.ScalarMap[str, str]
    def __init__(self, handles: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SetupRequest(_message.Message):
    __slots__ = ("timeout",)
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    timeout: float
    def __init__(self, timeout: _Optional[float] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "ready", "lora_adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    ready: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_types_pb2.LoRARequest]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., ready: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[_types_pb2.LoRARequest, _Mapping]]] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("llm_id", "model", "role", "disaggregated_params", "startup_metrics", "workers", "collective_rpc_methods", "max_model_len", "encode_only", "lora_adapters", "embedding_size")
    LLM_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STARTUP_METRICS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_RPC_METHODS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ENCODE_ONLY_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    llm_id: str
    model: str
    role: str
    disaggregated_params: _struct_pb2.Struct
    startup_metrics: _struct_pb2.Struct
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    collective_rpc_methods: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    encode_only: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_types_pb2.LoRARequest]
    embedding_size: int
    def __init__(self, llm_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[str] = ..., disaggregated_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., startup_metrics: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., collective_rpc_methods: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ..., encode_only: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[_types_pb2.LoRARequest, _Mapping]]] = ..., embedding_size: _Optional[int] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files", "bos_token_id", "eos_token_ids")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
